"""Prefix caching on vs off on the embedded model (``LLM()``, default EAGLE-3 K=3), side by side
in one run: two engines, one with the cache and one without, their runs interleaved (on, off,
off, on, ...) so the machine's drift hits both alike.

no-hit:   ``--num-prompts`` random-token prompts of ``--prompt-len`` tokens (nothing shared:
          every lookup misses), one batch, ``--output-len`` tokens each -> output tok/s (mean,
          and min-max over the repeats: the noise), the cost of looking up and registering
          blocks. Ratio on / off: 1 = no cost.
prefix:   a closed loop of one request at a time, each a fresh ``--prompt-len``-token shared
          prefix (new per repeat) plus 8 tokens of its own -> mean TTFT (the first request of
          a repeat misses, the others hit all but their tail). Ratio on / off < 1: TTFT falls.

    python -m benchmarks.bench_prefix_cache [--method eagle3] [--repeats 3] [--prompt-len 384]
        [--model DIR]

``--model``: another target folder (default: the embedded model), e.g. a hybrid
linear-attention one, whose steps stage the state at block boundaries and whose hits restore
state snapshots.
"""

import argparse
import json
import statistics

import torch

from specdec import LLM
from specdec.bench.sweep import measure


def prompts(kind: str, n: int, length: int, seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    if kind == "no-hit":
        return torch.randint(1, vocab, (n, length), generator=gen).tolist()
    shared = torch.randint(1, vocab, (length,), generator=gen).tolist()
    return [shared + torch.randint(1, vocab, (8,), generator=gen).tolist() for _ in range(n)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", default="eagle3", help="none, eagle3, ... (default eagle3)")
    p.add_argument("--repeats", type=int, default=3, help="runs per engine and kind (default 3)")
    p.add_argument("--num-prompts", type=int, default=8, help="requests per run (default 8)")
    p.add_argument("--prompt-len", type=int, default=384, help="prompt tokens (default 384)")
    p.add_argument("--output-len", type=int, default=16, help="output tokens (default 16)")
    p.add_argument("--device", default=None, help="default: the accelerator, else cpu")
    p.add_argument("--model", default=None, help="target folder (default: the embedded model)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    a = p.parse_args()
    spec = (None if a.method == "none"
            else {"method": a.method, "num_speculative_tokens": 3})
    engines = {on: LLM(a.model, spec, device=a.device, enable_prefix_caching=on,
                       max_num_seqs=a.num_prompts, max_num_batched_tokens=512,
                       max_model_len=a.prompt_len + 8 + a.output_len + 8) for on in (True, False)}
    vocab = engines[True].vocab_size
    runs = {(kind, on): [] for kind in ("no-hit", "prefix") for on in (True, False)}
    for r in range(-1, a.repeats):  # repeat -1: warm-up, not kept
        for kind, concurrency in (("no-hit", None), ("prefix", 1)):
            for on in ((True, False) if r % 2 else (False, True)):
                # a seed per repeat and kind: no run shares a prompt with another
                seed = 1000 * r + (kind == "prefix")
                batch = prompts(kind, a.num_prompts, a.prompt_len, seed, vocab)
                raw = measure(engines[on], batch, a.output_len, 0.0, concurrency)
                if r >= 0:
                    runs[kind, on].append(raw)
    figures = {}
    for (kind, on), raws in runs.items():
        tok_s = [x["output_tokens"] / x["wall_s"] for x in raws]
        figures[f"{kind} {'on' if on else 'off'}"] = dict(
            tok_s=statistics.mean(tok_s), tok_s_min=min(tok_s), tok_s_max=max(tok_s),
            ttft_ms=1e3 * statistics.mean(t for x in raws for t in x["ttft_s"]),
            queries=sum(x["prefix_cache_queries"] for x in raws),
            hits=sum(x["prefix_cache_hits"] for x in raws))
    print(f"{'run':<12}{'tok/s':>9}{'(min-max)':>14}{'TTFT ms':>10}{'queries':>9}{'hits':>8}")
    for name, f in figures.items():
        spread = f"{f['tok_s_min']:.1f}-{f['tok_s_max']:.1f}"
        print(f"{name:<12}{f['tok_s']:>9.1f}{spread:>14}{f['ttft_ms']:>10.1f}{f['queries']:>9}"
              f"{f['hits']:>8}")
    fig = figures
    ratios = {"no-hit tok/s on/off": fig["no-hit on"]["tok_s"] / fig["no-hit off"]["tok_s"],
              "prefix TTFT on/off": fig["prefix on"]["ttft_ms"] / fig["prefix off"]["ttft_ms"]}
    for name, value in ratios.items():
        print(f"{name}: {value:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(args=vars(a), figures=figures, ratios=ratios), f, indent=1)


if __name__ == "__main__":
    main()
