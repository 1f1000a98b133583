"""The torch paged attention's query rows vs token-major, in the CPU engine, side by side.

    python -m benchmarks.bench_cpu_attention_layout [--concurrency 4 16] [--rounds 5]
        [--threads 1]

``rows`` is the engine as built: the attention plan lays queries out in rows of one
request's tokens (request-major for verification and equal prefill chunks, segments for a
prefill chunk among decodes; ``kernels/paged_attention_torch.py``) and gathers keys once per
row; ``token-major`` gathers every token's keys (``row_shape`` forced to one token per row).
Each run is a fresh child process; the order alternates every round (this machine's speed
drifts by tens of percent over minutes).

Two workloads per method (plain, EAGLE-3 K=3 padded) and concurrency C (greedy, float32,
32-token prompts): ``waves``, C requests of 32 output tokens at once (prefill steps, then
decode steps); ``staggered``, C requests kept in flight as a serving client does, 4C in
all, the first wave finishing at staggered lengths so that later arrivals join running
decodes (steps with a prefill chunk among decodes, as when served). Figures: the median over
rounds of the tokens/s, of the ms per step with a prefill chunk and per decode-only step;
ratio = rows / token-major tokens/s, the median of the per-round ratios (> 1: rows faster).
"""

import argparse
import json
import statistics
import subprocess
import sys

from rich.console import Console
from rich.table import Table

CONFIGS = ("rows", "token-major")
METHODS = {"plain": None, "EAGLE-3": {"method": "eagle3", "num_speculative_tokens": 3}}
WORKLOADS = ("waves", "staggered")

CHILD = """
import json, statistics, sys, time
import torch
config, workload, threads, conc = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spec = json.loads(sys.argv[5])
torch.set_num_threads(threads)
import specdec.kernels.paged_attention_torch as paged
from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams, Status
if config == "token-major":
    paged.row_shape = lambda num_tokens, num_reqs, max_query_len: (1, num_tokens)
llm = LLM(speculative_config=spec,
          graph_backend="compile_dynamic" if config == "compile_dynamic" else "eager")
width = 1 + (spec or {}).get("num_speculative_tokens", 0)

def prompt(i):
    return [(7 * i + j) % 2000 + 1 for j in range(32)]

def run():
    if workload == "waves":
        lengths = [32] * conc
    else:  # the first wave ends at staggered lengths, then 32 tokens each
        lengths = [max(1, 32 * (i + 1) // conc) for i in range(conc)] + [32] * (3 * conc)
    live, added, tokens = [], 0, 0
    llm.steps.clear()
    start = time.perf_counter()
    while added < len(lengths) or live:
        while added < len(lengths) and len(live) < conc:
            live.append(llm.add_request(prompt(added), SamplingParams(
                max_tokens=lengths[added], ignore_eos=True)))
            added += 1
        rec = llm.step()
        tokens += sum(rec.new_tokens.values())
        live = [r for r in live if r.status is not Status.FINISHED]
    seconds = time.perf_counter() - start
    chunk = [s.seconds for s in llm.steps if s.num_tokens > width * s.num_reqs]
    decode = [s.seconds for s in llm.steps if s.num_tokens <= width * s.num_reqs]
    return tokens / seconds, 1e3 * statistics.median(chunk), 1e3 * statistics.median(decode)

run()  # warm-up
runs = [run() for _ in range(3)]
print(json.dumps([statistics.median(r[i] for r in runs) for i in range(3)]))
"""


def run_child(config: str, workload: str, threads: int, conc: int, spec) -> list[float]:
    """[tokens/s, ms per step with a prefill chunk, ms per decode step], in a fresh process."""
    out = subprocess.run([sys.executable, "-c", CHILD, config, workload, str(threads),
                          str(conc), json.dumps(spec)], capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"{config} {workload} at {conc} requests failed:\n"
                           f"{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(configs: tuple[str, str], title: str, argv=None) -> None:
    """Run ``configs[0]`` against ``configs[1]`` in alternating fresh processes; print the
    table (ratio = configs[0] / configs[1] tokens/s)."""
    ap = argparse.ArgumentParser(description=title)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    results = {}  # (method, workload, conc, config) -> [[tok/s, chunk ms, decode ms], ...]
    for r in range(args.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for method, spec in METHODS.items():
            for workload in WORKLOADS:
                for conc in args.concurrency:
                    for config in order:
                        results.setdefault((method, workload, conc, config), []).append(
                            run_child(config, workload, args.threads, conc, spec))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    table = Table(title=f"{title}, medians of {args.rounds} alternating rounds")
    for col in ("method", "workload", "conc", "config", "tok/s", "step with a chunk ms",
                "decode step ms", f"{configs[0]} / {configs[1]} tok/s"):
        table.add_column(col)
    for method in METHODS:
        for workload in WORKLOADS:
            for conc in args.concurrency:
                base = results[(method, workload, conc, configs[0])]
                for config in configs:
                    runs = results[(method, workload, conc, config)]
                    med = [statistics.median(run[i] for run in runs) for i in range(3)]
                    ratio = statistics.median(b[0] / c[0] for b, c in zip(base, runs))
                    table.add_row(method, workload, str(conc), config, f"{med[0]:.0f}",
                                  f"{med[1]:.1f}", f"{med[2]:.2f}",
                                  f"{ratio:.2f}" if config != configs[0] else "")
    Console(width=140).print(table)


def main() -> None:
    compare(CONFIGS, "CPU paged attention query rows vs token-major")


if __name__ == "__main__":
    main()
