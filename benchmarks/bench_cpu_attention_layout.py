"""Request-major vs token-major paged attention in the CPU engine, side by side.

    python -m benchmarks.bench_cpu_attention_layout [--concurrency 4 16] [--rounds 5]
        [--threads 1]

``request-major`` is the engine as built: each forward hands the torch attention plan its
host bound on tokens per request, so verification steps and equal prefill chunks gather
each request's keys once (``kernels/paged_attention_torch.py``); ``token-major`` drops that
bound, so every token gathers its request's keys. Each run is a fresh child process; the
order alternates every round (this machine's speed drifts by tens of percent over minutes).

Per method (plain, EAGLE-3 K=3 padded) and concurrency: the median over rounds of the
in-process tokens/s (greedy, float32, 32-token prompts, 32 output tokens), of the ms per
prefill step (at least 8 tokens per request) and per decode step; ratio = request-major
tokens/s / token-major's, the median of the per-round ratios (> 1: request-major faster).
"""

import argparse
import json
import statistics
import subprocess
import sys

from rich.console import Console
from rich.table import Table

CONFIGS = ("request-major", "token-major")
METHODS = {"plain": None, "EAGLE-3": {"method": "eagle3", "num_speculative_tokens": 3}}

CHILD = """
import json, statistics, sys, time
import torch
config, threads, conc, spec = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
torch.set_num_threads(threads)
import specdec.engine.llm as llm_module
import specdec.kernels as kernels
if config == "token-major":
    plan = kernels.plan_paged_attention
    kernels.plan_paged_attention = lambda *a: plan(*a[:6])  # drop max_query_len
llm = llm_module.LLM(speculative_config=spec)
prompts = [[(7 * i + j) % 2000 + 1 for j in range(32)] for i in range(conc)]
llm.generate(prompts, max_tokens=32, ignore_eos=True)  # warm-up
runs = []
for _ in range(3):
    llm.steps.clear()
    start = time.perf_counter()
    outs = llm.generate(prompts, max_tokens=32, ignore_eos=True)
    seconds = time.perf_counter() - start
    big = [s.seconds for s in llm.steps if s.num_tokens >= 8 * s.num_reqs]
    small = [s.seconds for s in llm.steps if s.num_tokens < 8 * s.num_reqs]
    runs.append((sum(len(o.token_ids) for o in outs) / seconds,
                 1e3 * statistics.median(big), 1e3 * statistics.median(small)))
print(json.dumps([statistics.median(r[i] for r in runs) for i in range(3)]))
"""


def run_child(config: str, threads: int, conc: int, spec) -> list[float]:
    """[tokens/s, prefill step ms, decode step ms] of one configuration, in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, config, str(threads), str(conc),
                          json.dumps(spec)], capture_output=True, text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{config} at {conc} requests failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    results = {}  # (method, conc, config) -> list of [tok/s, prefill ms, decode ms]
    for r in range(args.rounds):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        for method, spec in METHODS.items():
            for conc in args.concurrency:
                for config in order:
                    results.setdefault((method, conc, config), []).append(
                        run_child(config, args.threads, conc, spec))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    table = Table(title=f"CPU paged attention layouts, medians of {args.rounds} "
                        "alternating rounds")
    for col in ("method", "conc", "layout", "tok/s", "prefill step ms", "decode step ms",
                "request- / token-major tok/s"):
        table.add_column(col)
    for method in METHODS:
        for conc in args.concurrency:
            base = results[(method, conc, "request-major")]
            for config in CONFIGS:
                runs = results[(method, conc, config)]
                med = [statistics.median(run[i] for run in runs) for i in range(3)]
                ratio = statistics.median(b[0] / c[0] for b, c in zip(base, runs))
                table.add_row(method, str(conc), config, f"{med[0]:.0f}", f"{med[1]:.1f}",
                              f"{med[2]:.2f}", f"{ratio:.2f}" if config != CONFIGS[0] else "")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
