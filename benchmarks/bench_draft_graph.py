"""Eager vs compiled (Torchair-MTP graph mode) draft step, per batch bucket.

    python -m benchmarks.bench_draft_graph [--model PATH] [--buckets 1 4 16] [--backend inductor]

For each bucket B it runs B greedy requests through the engine twice -- MTP eager and MTP
``graph_mode="torchair"`` -- and reports the median drafter wall time of the steps whose
batch is a uniform decode of exactly B requests (the steps the graph serves). Compilation
happens in a warm-up request set that is not timed. Figures are ratios measured side by side.
"""

import argparse
import statistics

import torch
from rich.console import Console
from rich.table import Table

from specdec.engine.llm import DEFAULT_MODEL, LLM
from specdec.engine.sequence import SamplingParams

PROMPT = "def fibonacci(n):\n"


def draft_times(llm: LLM, batch: int, max_tokens: int) -> list[float]:
    for i in range(batch):
        llm.add_request(PROMPT + "#" * i, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    times = []
    while (rec := llm.step()) is not None:
        if rec.num_reqs == batch and all(
                len(s.spec_token_ids) == llm.spec.num_speculative_tokens
                for s in llm.scheduler.running):
            times.append(rec.draft_seconds)
    return times[1:]  # the first decode step follows prefill: skip it


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--buckets", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--backend", default="inductor")
    args = ap.parse_args(argv)
    rows = []
    for b in args.buckets:
        result = {}
        for mode in ("eager", "torchair"):
            spec = {"method": "mtp", "num_speculative_tokens": args.k, "graph_mode": mode,
                    }
            llm = LLM(args.model, spec, max_num_seqs=b, max_num_batched_tokens=256, max_model_len=128,
                      capture_sizes=args.buckets)
            draft_times(llm, b, 8)  # warm-up (and compile the bucket)
            result[mode] = statistics.median(draft_times(llm, b, args.max_tokens)) * 1e3
        rows.append((b, result["eager"], result["torchair"]))
    table = Table(title=f"MTP draft step, K={args.k}, {torch.get_num_threads()} threads "
                        f"(median ms; backend={args.backend})")
    for col in ("bucket B", "eager ms", "compiled ms", "eager / compiled"):
        table.add_column(col, justify="right")
    for b, e, c in rows:
        table.add_row(str(b), f"{e:.2f}", f"{c:.2f}", f"{e / c:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
