"""Server ITL against in-process ITL: what ``specdec serve`` adds per token over the engine.

    python -m benchmarks.serve_vs_inprocess [--concurrency 1,4,16] [--repeats 2] [--out DIR]

Runs the in-process harness (``specdec bench``) and the endpoint harness (``specdec bench
serve --launch``, one server per method) on the same prompts (held-out stdlib windows through
the embedded tokenizer), lengths, K and dtype, greedy, then prints per method and concurrency
the mean ITL of each, the server's overhead per token (server - in-process) and both tokens/s.
Methods: plain (none) and EAGLE-3 K=3, padded. Run it from the repository root on an otherwise
idle machine; each harness writes its results.json under ``--out``.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

METHODS = ("none", "eagle3")


def harness_args(args) -> list[str]:
    return ["--concurrency", args.concurrency, "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--repeats", str(args.repeats),
            "--warmup", "1"]


def run(cmd: list[str]) -> None:
    Console(stderr=True).print(" ".join(cmd), markup=False, highlight=False)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def figures(results: Path) -> dict:
    """(method, concurrency) -> (mean ITL ms, tokens/s) of a results.json."""
    r = json.loads(results.read_text())
    return {(c["method"], c["concurrency"]): (c["summary"]["itl_ms"]["mean"],
                                              c["summary"]["output_tokens_per_s"])
            for c in r["configs"] if c["status"] == "ok"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_vs_inprocess",
                                 description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16", help="comma list")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-k", type=int, default=3, help="K of EAGLE-3")
    ap.add_argument("--out", type=Path, default=Path("serve-vs-inprocess"))
    args = ap.parse_args(argv)
    cli = [sys.executable, "-m", "specdec.cli", "bench"]
    inproc = args.out / "inprocess"
    run(cli + ["--methods", ",".join(METHODS), "--modes", "padded", "-k", str(args.k),
               "--out", str(inproc)] + harness_args(args))
    served = {}
    for method in METHODS:
        out = args.out / f"serve-{method}"
        run(cli + ["serve", "--launch", "--method", method, "-k", str(args.k), "--out",
                   str(out)] + harness_args(args))
        served.update(figures(out / "results.json"))
    local = figures(inproc / "results.json")
    table = Table(title=f"specdec serve vs in-process, K={args.k}, {args.prompt_len}-token "
                        f"prompts, {args.output_len} output tokens, greedy, mean ITL (ms)")
    for col in ("method", "conc", "in-process ITL", "server ITL", "overhead ms/token",
                "in-process tok/s", "server tok/s"):
        table.add_column(col, justify="right")
    for key in sorted(served, key=lambda k: (METHODS.index(k[0]), k[1])):
        (itl, tps), (itl_l, tps_l) = served[key], local.get(key, (None, None))
        table.add_row(key[0], str(key[1]), f"{itl_l:.2f}" if itl_l else "-", f"{itl:.2f}",
                      f"{itl - itl_l:+.2f}" if itl_l else "-",
                      f"{tps_l:.0f}" if tps_l else "-", f"{tps:.0f}")
    Console(width=max(Console().width, 120)).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
