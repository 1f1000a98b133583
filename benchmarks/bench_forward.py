"""CPU ms per target forward and aten ops per forward, decode batches over the paged cache.

Each request has ``--context`` tokens already in the cache and decodes one token; the
forward is ``model(input_ids [B], positions [B], kv)`` with a bound KV cache. Ops are
counted with ``torch.profiler`` (every ``aten::`` event, nested ones included, and the
top-level ones: those a CUDA run would each launch at least once).

    python -m benchmarks.bench_forward [--model specdec/assets/default/target]
        [--synthetic llama-1b] [--batch 1 16] [--context 64] [--repeats 50]
        [--dtype float32] [--emulate-cuda]

``--emulate-cuda`` counts what a CUDA forward would launch, on CPU: every dispatched function
takes its Triton path, whose kernel launches are counted instead of run (outputs are junk;
shapes are static, so the rest of the forward is unchanged), plus the top-level aten ops
that are not pure views (each at least one CUDA kernel). No timing in that mode.
"""

import argparse
import importlib
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from specdec.attention import AttentionMetadata, KVCache
from specdec.models.registry import load_pretrained
from specdec.models.synthetic import SHAPES, build_synthetic

BLOCK_SIZE = 16


def decode_batch(model, b: int, context: int) -> tuple:
    """(input_ids, positions, kv) for B requests at position ``context`` each."""
    blocks_per_req = context // BLOCK_SIZE + 1
    cache = KVCache(model.kv_cache_spec(), b * blocks_per_req, BLOCK_SIZE,
                    model.lm_head.weight.dtype, "cpu")
    torch.manual_seed(0)
    for t in cache.k + cache.v:
        t.normal_()
    table = torch.arange(b * blocks_per_req, dtype=torch.int32).view(b, blocks_per_req)
    positions = torch.full((b,), context, dtype=torch.int64)
    slots = (table[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE)
    meta = AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        seq_lens=torch.full((b,), context + 1, dtype=torch.int32), block_table=table,
        max_seq_len=context + 1)
    ids = torch.randint(0, model.config.vocab_size, (b,))
    return ids, positions, cache, meta


def count_ops(model, ids, positions, cache, meta) -> tuple[int, int]:
    """(all aten ops, top-level aten ops) of one forward + logits."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        hidden, _ = model(ids, positions, cache.bind(meta))
        model.compute_logits(hidden)
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(events), len(top)


VIEW_OPS = {"aten::view", "aten::reshape", "aten::slice", "aten::select", "aten::unsqueeze",
            "aten::permute", "aten::chunk", "aten::split", "aten::transpose", "aten::expand",
            "aten::as_strided", "aten::t", "aten::detach", "aten::alias", "aten::empty",
            "aten::empty_like", "aten::empty_strided", "aten::lift_fresh", "aten::squeeze"}


# the Triton kernels a target forward launches: module under specdec.kernels -> kernel
FORWARD_KERNELS = {"triton_paged_attention": "_paged_attention_kernel",
                   "triton_norm": "_add_rms_norm_kernel", "triton_rope": "_rope_kernel"}


class _CountLaunches:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` records one launch, runs nothing."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


def emulated_cuda_launches(model, ids, positions, cache, meta) -> tuple[int, int]:
    """(Triton launches, non-view top-level aten ops) of one forward + logits with every
    dispatched function on its Triton path."""
    from specdec import platform
    platform.triton_available = lambda device: True
    launches = []
    for module, kernel in FORWARD_KERNELS.items():
        setattr(importlib.import_module(f"specdec.kernels.{module}"), kernel,
                _CountLaunches(launches))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        hidden, _ = model(ids, positions, cache.bind(meta))
        model.compute_logits(hidden)
    top = [e.name for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    return len(launches), sum(name not in VIEW_OPS for name in top)


def time_forward(model, ids, positions, cache, meta, repeats: int) -> float:
    """Median ms of one forward + logits."""
    times = []
    for _ in range(repeats + 3):
        t0 = time.perf_counter()
        hidden, _ = model(ids, positions, cache.bind(meta))
        model.compute_logits(hidden)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="specdec/assets/default/target")
    p.add_argument("--synthetic", choices=sorted(SHAPES), help="a random-weight target "
                   "(specdec.models.synthetic) instead of --model")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--emulate-cuda", action="store_true")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    if a.synthetic:
        model = build_synthetic(a.synthetic, dtype, "cpu", methods=()).target
    else:
        model = load_pretrained(a.model, dtype=dtype)
    print(f"threads={torch.get_num_threads()} dtype={a.dtype} context={a.context}")
    with torch.inference_mode():
        for b in a.batch:
            args = decode_batch(model, b, a.context)
            if a.emulate_cuda:
                triton_launches, aten = emulated_cuda_launches(model, *args)
                print(f"batch={b:3d}  emulated CUDA launches/forward={triton_launches + aten} "
                      f"(Triton {triton_launches} + non-view aten {aten})")
                continue
            ops, top = count_ops(model, *args)
            ms = time_forward(model, *args, a.repeats)
            print(f"batch={b:3d}  ms/forward={ms:7.3f}  aten ops={ops}  top-level={top}")


if __name__ == "__main__":
    main()
