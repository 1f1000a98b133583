"""CPU ms per generated token at tensor_parallel_size 1 vs 2 (gloo), and the collectives of
one step by kind, on the embedded default model (plain greedy and EAGLE-3 K=3).

ms/token = the engine steps' wall time (``StepRecord.seconds`` of TP rank 0, the process
start-up and model load excluded) / tokens generated; median over ``--repeats`` runs (each TP=2
run is one spawn of 2 ranks). On a CPU box TP=2 is expected to be SLOWER: the ranks share the
same cores and every layer adds a gloo all-reduce; the figure shows the cost of the
collectives, not a speed-up (that needs one accelerator per rank). Every process runs one
torch thread (``--threads``; the rank processes always do): TP=1 uses one core, TP=2 two.

    python -m benchmarks.bench_tp_cpu [--prompts 4] [--max-tokens 32] [--repeats 3] [--sp]
        [--threads 1]
"""

import argparse
import collections
import statistics

import torch

from specdec import LLM, SamplingParams
from specdec.engine.dp_engine import DPJob, run_data_parallel

METHODS = {"plain": None, "eagle3 K=3": {"method": "eagle3", "num_speculative_tokens": 3}}


def ms_per_token(steps) -> float:
    tokens = sum(sum(s.new_tokens.values()) for s in steps)
    return 1e3 * sum(s.seconds for s in steps) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sp", action="store_true", help="sequence_parallel=True at TP=2")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the TP=1 run")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [[1 + i, 17, 300 + i, 42, 7][: 3 + i % 3] for i in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    print(f"{'method':<12}{'TP=1 ms/tok':>13}{'TP=2 ms/tok':>13}   collectives of a TP=2 decode step")
    for name, spec in METHODS.items():
        kw = {"speculative_config": spec, "max_model_len": 256}
        one, two, kinds = [], [], None
        for _ in range(args.repeats):
            llm = LLM(**kw)
            llm.generate(prompts, params)
            one.append(ms_per_token(llm.steps))
            job = DPJob(dict(kw, tensor_parallel_size=2, sequence_parallel=args.sp), prompts,
                        params)
            run, = run_data_parallel([job], 1, engine=LLM, tp_size=2)
            two.append(ms_per_token(run.ranks[0].steps))
            kinds = collections.Counter(op for op, _ in run.ranks[0].collectives[-2])
        print(f"{name:<12}{statistics.median(one):>13.2f}{statistics.median(two):>13.2f}   "
              f"{dict(sorted(kinds.items()))}")


if __name__ == "__main__":
    main()
