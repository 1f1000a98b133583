"""The CPU comparison the family benchmarks share: plain vs an MTP method at K = 1..3 on one
checkpoint folder, side by side (round-robin repeats), ms per output token and acceptance."""

import argparse
import statistics
import time
from pathlib import Path

import torch

from specdec import LLM


def compare_mtp(path: Path, prompts: list, method: str, max_tokens: int, repeats: int) -> None:
    """Print ms/token, speed-up over plain, acceptance rate and length, and whether each
    config's greedy tokens equal plain's (the warm-up run's outputs)."""
    configs = {"plain": None}
    for k in (1, 2, 3):
        configs[f"{method} K={k}"] = {"method": method, "num_speculative_tokens": k}
    llms = {name: LLM(model=str(path), max_num_seqs=len(prompts), max_model_len=256,
                      speculative_config=spec) for name, spec in configs.items()}

    def run(llm):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
        return time.perf_counter() - t0, outs

    first = {name: run(llm)[1] for name, llm in llms.items()}  # warm-up, not timed
    times = {name: [] for name in llms}
    for _ in range(repeats):  # round-robin: the configurations side by side
        for name, llm in llms.items():
            times[name].append(run(llm)[0])
    tokens = sum(len(o.token_ids) for o in first["plain"])
    plain_ms = statistics.median(times["plain"]) / tokens * 1e3
    width = max(map(len, llms)) + 2
    print(f"  {'config':<{width}}{'ms/token':>10}{'vs plain':>10}{'accept':>8}"
          f"{'accept len':>12}{'== plain':>10}")
    for name in llms:
        outs = first[name]
        ms = statistics.median(times[name]) / tokens * 1e3
        drafted = sum(sum(o.num_drafted) for o in outs)
        accepted = sum(sum(o.num_accepted) for o in outs)
        rate = f"{accepted / drafted:.2f}" if drafted else "-"
        alen = f"{statistics.mean(o.acceptance_length for o in outs):.2f}" if drafted else "-"
        same = [o.token_ids for o in outs] == [o.token_ids for o in first["plain"]]
        print(f"  {name:<{width}}{ms:>10.2f}{plain_ms / ms:>9.2f}x{rate:>8}{alen:>12}"
              f"{same!s:>10}")


def parse_args(doc: str):
    """The family benchmarks' flags (prompts, tokens, repeats, threads); sets the threads."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def prompts(n: int) -> list[list[int]]:
    """n fixed random prompts of varied lengths (ids 3..499)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, 500, (length,), generator=gen).tolist()
            for length in [5, 17, 40, 29, 11, 63, 8, 50][:n]]
