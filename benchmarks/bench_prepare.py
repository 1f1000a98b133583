"""µs per call of the drafter's acceptance-dependent preparation on CPU, padded vs ragged.

padded: gather_backup_tokens + prepare_next_token_ids_padded + prepare_inputs_padded
        (tensors in, tensors out; on an accelerator this is device work with no sync).
ragged: sampled.tolist() + host backup lookup + next_token_ids_ragged +
        valid_counts_ragged + prepare_inputs_ragged (the host path, which syncs).

    python -m benchmarks.bench_prepare [--repeats 300] [--inner 10]
"""

import argparse
import random
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from specdec.kernels import (gather_backup_tokens, prepare_inputs_padded,
                             prepare_next_token_ids_padded)
from specdec.kernels.ragged import next_token_ids_ragged, prepare_inputs_ragged, valid_counts_ragged

VOCAB = 32_000
MAX_MODEL_LEN = 4096


def make_step(b: int, k: int, seed: int = 0) -> dict:
    """B decode requests with K drafts each and random acceptance; every 8th request
    is a discarded 16-token prefill chunk."""
    rng = random.Random(seed)
    sampled, discard, num_draft, query_lens = [], [], [], []
    for r in range(b):
        dropped = r % 8 == 7
        d = 0 if dropped else k
        v = 0 if dropped else rng.randint(1, k + 1)
        sampled.append([rng.randrange(VOCAB) for _ in range(v)] + [-1] * (k + 1 - v))
        discard.append(dropped)
        num_draft.append(d)
        query_lens.append(16 if dropped else 1 + d)
    seq_lens = torch.tensor([rng.randint(q, MAX_MODEL_LEN - 1) for q in query_lens],
                            dtype=torch.int32)
    return dict(
        sampled=torch.tensor(sampled, dtype=torch.int32),
        discard=torch.tensor(discard),
        cu_num_draft=torch.tensor(num_draft).cumsum(0).to(torch.int32),
        num_draft=num_draft,
        query_start_loc=torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32),
        seq_lens=seq_lens,
        token_table=torch.randint(0, VOCAB, (b, MAX_MODEL_LEN + 1), dtype=torch.int32),
        rows=torch.arange(b),
    )


def padded(s: dict) -> None:
    backup = gather_backup_tokens(s["token_table"], s["rows"], s["seq_lens"])
    _, valid = prepare_next_token_ids_padded(s["sampled"], s["discard"], backup, VOCAB)
    prepare_inputs_padded(s["cu_num_draft"], valid, s["query_start_loc"])


def ragged(s: dict) -> None:
    sampled, discard = s["sampled"].tolist(), s["discard"].tolist()
    table = s["token_table"].numpy()
    backup = [int(table[r, n]) for r, n in zip(s["rows"].tolist(), s["seq_lens"].tolist())]
    next_token_ids_ragged(sampled, discard, backup, VOCAB)
    valid = valid_counts_ragged(sampled, discard, VOCAB)
    prepare_inputs_ragged(s["query_start_loc"], s["seq_lens"], s["num_draft"], valid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=300, help="timed samples per cell")
    parser.add_argument("--inner", type=int, default=10, help="calls per timed sample")
    args = parser.parse_args()
    torch.set_num_threads(1)

    steps = {b: make_step(b, args.k) for b in args.batch_sizes}
    cells = [(b, name, fn) for b in args.batch_sizes for name, fn in (("padded", padded),
                                                                       ("ragged", ragged))]
    samples = {(b, name): [] for b, name, _ in cells}
    for b, _, fn in cells:  # warm-up
        fn(steps[b])
    for _ in range(args.repeats):  # interleaved: every cell once per round
        for b, name, fn in cells:
            t0 = time.perf_counter()
            for _ in range(args.inner):
                fn(steps[b])
            samples[(b, name)].append((time.perf_counter() - t0) / args.inner * 1e6)

    table = Table(title=f"Drafter preparation on CPU, K={args.k}: median µs per call "
                        f"({args.repeats} samples x {args.inner} calls, interleaved)")
    for col in ("B", "padded µs", "ragged µs", "ragged / padded"):
        table.add_column(col, justify="right")
    for b in args.batch_sizes:
        p = statistics.median(samples[(b, "padded")])
        r = statistics.median(samples[(b, "ragged")])
        table.add_row(str(b), f"{p:.1f}", f"{r:.1f}", f"{r / p:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    main()
