"""K per step against a fixed K and plain decoding, side by side in one run.

    python -m benchmarks.dynamic_k [--methods ngram suffix eagle3] [--concurrency 1 4 16]

For each method: tokens/s of plain decoding and of the method at each fixed K (``--ks``) at
each concurrency, interleaved (one generate of each engine per round, ``--repeats`` rounds,
the median), on the embedded model with the repeat workload (``specdec bench --workload
repeat``'s prompts), greedy. From those figures the method's schedule
(``specdec.bench.report.best_k_schedule``: the fastest K per concurrency, plain as K 0), then
the method with that schedule (``num_speculative_tokens_per_batch_size``) and with the
measured policy (``num_speculative_tokens_policy="goodput"``, K up to the largest of ``--ks``)
against plain again, interleaved. Each engine runs one unmeasured round first (the policy
keeps what it measured there). Printed per method and concurrency: plain tok/s, each fixed K,
the schedule and the policy as a ratio to plain, and the mean step K of the last two. CPU figures say what a CPU does: a draft
head costs about a quarter of the 4-layer embedded target per step here.
"""

import argparse
import statistics
import time

from rich.console import Console
from rich.table import Table

from specdec import LLM, SamplingParams
from specdec.bench.report import best_k_schedule
from specdec.bench.sweep import PromptSource


def engine(method: str | None, k: int, conc: int, schedule=None, policy=None) -> LLM:
    spec = None if method is None else {"method": method, "num_speculative_tokens": k}
    if schedule is not None:
        spec["num_speculative_tokens_per_batch_size"] = schedule
    if policy is not None:
        spec["num_speculative_tokens_policy"] = policy
    return LLM(speculative_config=spec, max_num_seqs=conc,
               max_num_batched_tokens=max(256, conc * (k + 1)))


def interleaved(engines: dict, prompts, params, repeats: int) -> dict:
    """name -> (median tokens/s over ``repeats`` rounds after a warm-up round, mean step K of
    the last round)."""
    for llm in engines.values():
        llm.generate(prompts, params)
    times = {name: [] for name in engines}
    mean_k = {}
    for _ in range(repeats):
        for name, llm in engines.items():
            first = len(llm.steps)
            start = time.perf_counter()
            outs = llm.generate(prompts, params)
            times[name].append(sum(len(o.token_ids) for o in outs) /
                               (time.perf_counter() - start))
            steps = llm.steps[first:]
            mean_k[name] = sum(s.num_spec_tokens for s in steps) / max(len(steps), 1)
    return {name: (statistics.median(v), mean_k[name]) for name, v in times.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.dynamic_k",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=["ngram", "suffix", "eagle3"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--ks", nargs="+", type=int, default=[1, 3])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    k_max = max(args.ks)
    plain = LLM(max_num_seqs=max(args.concurrency))
    source = PromptSource(plain.tokenizer, plain.vocab_size)
    prompts = {c: source.prompts(c, args.prompt_len, 0, "repeat") for c in args.concurrency}
    table = Table(title=f"tok/s / plain, embedded model, repeat workload, greedy, "
                        f"{args.repeats} interleaved rounds (median)")
    for col in ("method", "conc", "plain tok/s", *(f"K={k}" for k in args.ks), "schedule",
                "mean K", "goodput", "mean K"):
        table.add_column(col, justify="left" if col == "method" else "right")
    for method in args.methods:
        fixed = {}  # conc -> {K: tok/s}
        for c in args.concurrency:
            engines = {0: plain, **{k: engine(method, k, c) for k in args.ks}}
            got = interleaved(engines, prompts[c], params, args.repeats)
            fixed[c] = {k: tps for k, (tps, _) in got.items()}
        schedule = best_k_schedule(fixed)
        for c in args.concurrency:
            got = interleaved({"plain": plain, "dyn": engine(method, k_max, c, schedule),
                               "goodput": engine(method, k_max, c, policy="goodput")},
                              prompts[c], params, args.repeats)
            base = fixed[c][0]
            table.add_row(method, str(c), f"{base:.0f}",
                          *(f"{fixed[c][k] / base:.2f}" for k in args.ks),
                          *(f"{v:.2f}" for name in ("dyn", "goodput")
                            for v in (got[name][0] / got["plain"][0], got[name][1])))
        table.add_row("", "", "", *([""] * len(args.ks)), str(schedule), "", "", "")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
