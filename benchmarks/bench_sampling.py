"""What vLLM's sampling settings cost on this CPU: a sampled step with penalties and top-k (the
"processed" variant: min_tokens, the repetition / frequency / presence penalties counted at
every draft position, then the min-p / top-k / top-p sort) over the plain sampled step
(temperature only).

engine:  ms per decode step of the embedded model (``LLM()``), plain and EAGLE-3 K=3, B
         requests decoding together, T=0.8, seeded; "processed" adds repetition_penalty 1.1,
         frequency_penalty 0.3, presence_penalty 0.2, top_k 40 (median of the uniform decode
         steps after the first, the best of ``--repeats`` runs).
verify:  ms per call of the verification alone at larger vocabularies (B=8, K=3, a token
         table of 2049 columns): ``rejection_sample`` vs ``process_logits`` +
         ``rejection_sample`` with top_k 40 (the runner's processed_top64: a topk of 64, no
         sort of the vocabulary), best of ``--repeats`` x 5 calls.

    python -m benchmarks.bench_sampling [--repeats 3] [--max-tokens 48] [--threads 1] [--quick]
"""

import argparse
import statistics
import time
from dataclasses import replace

import torch

from specdec import LLM, SamplingParams
from specdec.engine.penalties import process_logits
from specdec.engine.rejection_sampler import rejection_sample

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self,",
           "for i in range(", "    return self.", "with open(path) as f:", "x = [", "if not "]
SAMPLED = SamplingParams(temperature=0.8, ignore_eos=True)
PROCESSED = replace(SAMPLED, repetition_penalty=1.1, frequency_penalty=0.3,
                    presence_penalty=0.2, top_k=40)


def decode_ms(llm: LLM, params: SamplingParams, batch: int, max_tokens: int) -> float:
    """Median ms of the uniform decode steps (every request decoding; the first skipped):
    the median, as other work on a shared machine stalls single steps."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    first = len(llm.steps)
    llm.generate(prompts, [replace(params, max_tokens=max_tokens, seed=i)
                           for i in range(batch)])
    steps = [s for s in llm.steps[first:] if s.num_reqs == batch
             and s.num_tokens == batch * (1 + s.num_spec_tokens)][1:]
    return 1000 * statistics.median(s.seconds for s in steps)


def engine_rows(repeats: int, max_tokens: int, batches: tuple[int, ...]) -> list[tuple]:
    rows = []
    for name, spec in (("plain", None), ("eagle3 K=3", {"method": "eagle3",
                                                         "num_speculative_tokens": 3})):
        llm = LLM(speculative_config=spec, max_model_len=256, max_num_seqs=max(batches))
        for b in batches:
            ms = {}
            for label, params in (("sampled", SAMPLED), ("processed", PROCESSED)):
                decode_ms(llm, params, b, 8)  # warm
                ms[label] = min(decode_ms(llm, params, b, max_tokens) for _ in range(repeats))
            rows.append((name, b, ms["sampled"], ms["processed"]))
    return rows


def verify_rows(repeats: int, vocabs: tuple[int, ...], b: int = 8, k: int = 3,
                width: int = 2049) -> list[tuple]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for vocab in vocabs:
        logits = torch.randn(b, k + 1, vocab, generator=g) * 3
        drafts = torch.randint(0, vocab, (b, k), generator=g, dtype=torch.int32)
        num_draft = torch.full((b,), k, dtype=torch.int32)
        temperature = torch.full((b,), 0.8)
        keys, counters = torch.arange(b), torch.full((b,), 1000)
        table = torch.randint(0, vocab, (b, width), generator=g, dtype=torch.int32)
        first = torch.full((b,), 1000)
        num_prompt = torch.full((b,), 200)
        stop = torch.full((b, 16), -1, dtype=torch.int32)
        f = lambda v: torch.full((b,), v)

        def plain():
            return rejection_sample(logits, drafts, num_draft, temperature, keys, counters)

        def processed():
            x = process_logits(logits, drafts, table, torch.arange(b), first, num_prompt,
                               num_prompt, stop, f(1.1), f(0.3), f(0.2))
            return rejection_sample(x, drafts, num_draft, temperature, keys, counters,
                                    None, torch.full((b,), 40), f(0.0), width=64)
        ms = {}
        for label, fn in (("sampled", plain), ("processed", processed)):
            fn()
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                for _ in range(5):
                    fn()
                best = min(best, (time.perf_counter() - start) / 5)
            ms[label] = 1000 * best
        rows.append((vocab, b, ms["sampled"], ms["processed"]))
    return rows


def table(title: str, head: tuple[str, str], rows: list[tuple]) -> str:
    lines = [f"{title}", f"| {head[0]} | {head[1]} | sampled ms | penalties + top-k ms | ratio |",
             "|---|---|---|---|---|"]
    for a, b, s, p in rows:
        lines.append(f"| {a} | {b} | {s:.2f} | {p:.2f} | {p / s:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    ap.add_argument("--quick", action="store_true", help="a reduced run (the test's)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches, vocabs = ((1, 8), (2048, 32000, 151936)) if not args.quick else ((2,), (2048,))
    out = "\n\n".join([
        table(f"engine decode step, torch threads {torch.get_num_threads()}",
              ("engine", "B"), engine_rows(args.repeats, args.max_tokens, batches)),
        table("verification alone (B=8, K=3)", ("vocab", "B"),
              verify_rows(args.repeats, vocabs))])
    print(out)
    return out


if __name__ == "__main__":
    main()
