"""µs per call of each padded kernel: Triton vs its torch reference, B = 1, 64, 256, 1024.

On CUDA (or an NPU with triton-ascend) every column is timed on the device (wall time
of `inner` back-to-back calls between two synchronizations, so launch cost included),
each Triton result is first checked against the reference, and the number of compiled
variants per kernel is reported after all batch sizes (1 = no recompilation per B).
These are eager launches (``kernel[grid]``, Triton's per-call binding included); a captured
step replays them with no host work, so the step, not this table, is what counts.
On CPU only the torch reference is timed: the Triton interpreter is an emulator, not a
kernel timing, so it is left out.

    python -m benchmarks.bench_kernels [--batch-sizes 1 64 256 1024] [--repeats 50]
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.bench_prepare import MAX_MODEL_LEN, VOCAB, make_step
from specdec import platform
from specdec.kernels import TORCH_IMPLS, PaddedPrep

BLOCK_SIZE = 16
# the padded-drafting kernels of triton_padded.py (paged attention has its own benchmark)
NAMES = ("prepare_padded_step", "prepare_inputs_padded", "shift_first_pass_input_ids",
         "advance_draft_step")


def kernel_inputs(b: int, k: int, device: torch.device) -> dict[str, tuple]:
    """Arguments of each dispatched kernel for one step of B requests."""
    s = {key: v.to(device) if isinstance(v, torch.Tensor) else v
         for key, v in make_step(b, k).items()}
    prep = TORCH_IMPLS["prepare_padded_step"](
        s["sampled"], s["discard"], s["token_table"], s["rows"], s["seq_lens"],
        s["cu_num_draft"], s["query_start_loc"], VOCAB, out=PaddedPrep.empty(b, device))
    next_ids, valid, sample_idx = (prep.next_token_ids, prep.valid_count,
                                   prep.token_indices_to_sample)
    n = int(s["query_start_loc"][-1])
    gen = torch.Generator().manual_seed(b)
    target_ids = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
    blocks = MAX_MODEL_LEN // BLOCK_SIZE
    block_table = torch.randint(0, 100_000, (b, blocks), generator=gen,
                                dtype=torch.int32).to(device)
    return {
        "prepare_inputs_padded": (s["cu_num_draft"], valid, s["query_start_loc"]),
        "shift_first_pass_input_ids": (target_ids, sample_idx, next_ids),
        "advance_draft_step": (s["seq_lens"].long() - 1, s["seq_lens"], block_table, b,
                               BLOCK_SIZE, MAX_MODEL_LEN),
        # next token, valid count, backup, sample index, num rejected: one launch
        "prepare_padded_step": (s["sampled"], s["discard"], s["token_table"], s["rows"],
                                s["seq_lens"], s["cu_num_draft"], s["query_start_loc"], VOCAB,
                                PaddedPrep.empty(b, device)),
    }


def check_equal(name: str, b: int, got, expected) -> None:
    got = got if isinstance(got, tuple) else (got,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    for g, e in zip(got, expected):
        if g.dtype != e.dtype or not torch.equal(g, e):
            raise AssertionError(f"{name} at B={b}: Triton differs from the torch reference")


def time_call(fn, args: tuple, inner: int, sync) -> float:
    """µs per call over `inner` back-to-back calls."""
    sync()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn(*args)
    sync()
    return (time.perf_counter() - t0) / inner * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=50, help="timed samples per cell")
    parser.add_argument("--inner", type=int, default=100, help="calls per timed sample")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = platform.torch_device(args.device)
    use_triton = platform.triton_available(device)
    sync = getattr(torch, device.type).synchronize if device.type != "cpu" else (lambda: None)
    impls = {"torch": TORCH_IMPLS}
    if use_triton:
        from specdec.kernels import triton_padded as tp
        impls["triton"] = {name: getattr(tp, name) for name in NAMES}

    inputs = {b: kernel_inputs(b, args.k, device) for b in args.batch_sizes}
    cells = [(b, name, impl) for b in args.batch_sizes for name in NAMES for impl in impls]
    for b, name, impl in cells:  # warm-up (compiles) and, for Triton, a correctness check
        out = impls[impl][name](*inputs[b][name])
        if impl != "torch":
            check_equal(name, b, out, TORCH_IMPLS[name](*inputs[b][name]))
    samples = {cell: [] for cell in cells}
    for _ in range(args.repeats):  # interleaved: every cell once per round
        for b, name, impl in cells:
            samples[(b, name, impl)].append(
                time_call(impls[impl][name], inputs[b][name], args.inner, sync))

    where = f"{device} (Triton checked equal to torch)" if use_triton else \
        f"{device}: torch reference only (no Triton device; the interpreter is not timed)"
    table = Table(title=f"Padded kernels on {where}, K={args.k}: median µs per call "
                        f"({args.repeats} samples x {args.inner} calls, interleaved)")
    for col in ("B", "kernel", "torch µs", "triton µs", "torch / triton"):
        table.add_column(col, justify="right")
    for b in args.batch_sizes:
        for name in NAMES:
            t = statistics.median(samples[(b, name, "torch")])
            if use_triton:
                tr = statistics.median(samples[(b, name, "triton")])
                table.add_row(str(b), name, f"{t:.1f}", f"{tr:.1f}", f"{t / tr:.2f}x")
            else:
                table.add_row(str(b), name, f"{t:.1f}", "-", "-")
    console = Console()
    console.print(table)
    if use_triton:
        index = getattr(torch, device.type).current_device()  # triton's device_caches key
        for kernel in (tp._padded_step_kernel, tp._prepare_inputs_kernel, tp._shift_left_kernel,
                       tp._scatter_kernel, tp._advance_draft_step_kernel):
            variants = len(kernel.device_caches[index][0])
            console.print(f"{kernel.fn.__name__}: {variants} compiled variant(s) "
                          f"for B in {args.batch_sizes}")


if __name__ == "__main__":
    main()
