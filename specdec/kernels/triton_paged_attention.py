"""Paged attention as one Triton kernel: no gather of the cache, each token reads only its
own request's keys in ``[max(0, visible - W), visible)`` (``visible`` read on the device,
``W`` the sliding window, none by default), scores optionally soft-capped (``c * tanh(s / c)``),
the softmax optionally joined by a per-head sink logit (gpt-oss).

Same contract and formulas as the torch reference (``paged_attention_torch.py``, the oracle;
``tests/test_paged_attention.py`` compares them under ``TRITON_INTERPRET=1``). One program
per (token, kv head): it loads the token's ``G = Hq / Hkv`` query heads of that kv head once,
then walks the request's keys ``BLOCK_N`` at a time from the window start
``lo = max(0, visible - W)`` (0 without a window) up to ``visible`` (device values, so the
loop length is data-dependent but the launch shape is not: grid ``(N, Hkv)``), with an
online softmax (running max ``m``, sum ``l``, accumulator ``acc``) in float32 (float64 for a
float64 cache). Keys outside ``[lo, visible)`` are never read (a decode token with window W
reads W keys), so the static bound the torch path gathers up to plays no part here. The
window and the soft cap are runtime arguments (0 = none), never specialized: one binary for
every window and cap. A sink starts the online softmax at ``m = sink, l = 1`` (an entry
with no value), ``HAS_SINKS`` being a constexpr. With a draft tree (``HAS_TREE``, the torch
path's ``TreeMask``) a node's keys past its request's prefix are its ancestors' only, and its
window ends at its depth's position. tanh is ``1 - 2 / (exp(2x) + 1)`` (exact at +-inf, no libdevice call,
so the interpreter and every backend run it).
E.g. visible = 40, W = 20, BLOCK_N = 16: lo = 20, the loop reads keys 20..35 then 36..39
(4 live keys of 16); keys 0..19 are never touched.

Worked example of the online softmax (one head, scores [1, 3] then [2]): after block 1
m = 3, l = e^(1-3) + 1; block 2: m' = 3, alpha = 1, l' = l + e^(2-3); out = acc / l'
= the softmax over all three scores. Padding tokens (past the last request) attend like the
last request's last token; their rows are junk the engine never reads.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specdec.kernels.paged_attention_torch import (
    TreeMask,
    check_sliding_window,
    check_softcap,
    token_requests,
)

KEYS_PER_ITERATION = 16  # BLOCK_N (x BLOCK_G x BLOCK_D products live in registers)


# Local combiners, not tl.sum / tl.max (see triton_padded.py: triton's own @jit helpers do
# not switch to the interpreter after import).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["window", "softcap"])
def _paged_attention_kernel(q_ptr, q_stride_t, q_stride_h, k_ptr, v_ptr, kv_stride_s,
                            kv_stride_h, out_ptr, out_stride_t, out_stride_h, req_ptr,
                            qsl_ptr, seq_lens_ptr, table_ptr, table_stride, scale, window,
                            softcap, sinks_ptr, node_ptr, depth_ptr, ancestors_ptr,
                            HAS_SINKS: tl.constexpr, HAS_TREE: tl.constexpr,
                            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                            BLOCK_SIZE: tl.constexpr, BLOCK_G: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, ACC: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # token
    h = tl.program_id(1)  # kv head
    r = tl.load(req_ptr + i).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int64)
    q_end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    visible = tl.maximum(tl.minimum(seq_len - (q_end - 1 - i), seq_len), 1)
    if HAS_TREE:  # a draft-tree node: its prefix and ancestors; its window ends at its depth
        node = tl.load(node_ptr + i)
        ancestors = tl.load(ancestors_ptr + i)
        tree_start = visible - 1 - node
        end = visible - node + tl.load(depth_ptr + i)
    else:
        end = visible
    lo = tl.where(window > 0, tl.maximum(end - window, 0), 0)  # window start

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_live = g < GROUP
    d_live = d < HEAD_DIM
    heads = h * GROUP + g
    q = tl.load(q_ptr + i * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
                mask=g_live[:, None] & d_live[None, :], other=0.0).to(ACC)
    if HAS_SINKS:  # the sink: an entry of the softmax with no value
        m = tl.load(sinks_ptr + heads, mask=g_live, other=0.0).to(ACC)
        l = tl.full([BLOCK_G], 1.0, ACC)
    else:
        m = tl.full([BLOCK_G], float("-inf"), ACC)
        l = tl.full([BLOCK_G], 0.0, ACC)
    acc = tl.full([BLOCK_G, BLOCK_D], 0.0, ACC)
    n = tl.arange(0, BLOCK_N)
    # a while loop, not range(lo, visible, ...): triton 3.6's interpreter cannot turn a
    # loaded scalar into a Python range bound (3.9's can); compiled code is the same loop
    start = lo
    while start < visible:
        pos = start + n
        live = pos < visible  # pos >= lo by construction
        if HAS_TREE:
            rel = tl.minimum(tl.maximum(pos - tree_start, 0), 62)
            live = live & ((pos < tree_start) | (((ancestors >> rel) & 1) == 1))
        block = tl.load(table_ptr + r * table_stride + pos // BLOCK_SIZE, mask=live,
                        other=0).to(tl.int64)
        kv_off = ((block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * kv_stride_s
                  + h * kv_stride_h + d[None, :])
        kv_mask = live[:, None] & d_live[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(ACC)  # [BLOCK_N, BLOCK_D]
        s = tl.reduce(q[:, None, :] * k[None, :, :], 2, _add) * scale  # [BLOCK_G, BLOCK_N]
        if softcap > 0:
            s = softcap * (1 - 2 / (tl.exp(2 * s / softcap) + 1))  # softcap * tanh(s / softcap)
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.reduce(s, 1, _max))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(ACC)
        l = l * alpha + tl.reduce(p, 1, _add)
        acc = acc * alpha[:, None] + tl.reduce(p[:, :, None] * v[None, :, :], 1, _add)
        m = m_new
        start += BLOCK_N
    out = acc / l[:, None]
    tl.store(out_ptr + i * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_live[:, None] & d_live[None, :])


class TritonPlan(NamedTuple):
    """The kernel's per-forward plan: ``req`` [N] int64 plus the metadata it reads."""

    req: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    block_size: int
    tree: TreeMask | None = None  # draft-tree nodes (the torch path's TreeMask); None: causal


def plan_paged_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
         num_tokens: int, bound: int, block_size: int,
         max_query_len: int | None = None, tree: TreeMask | None = None) -> TritonPlan:
    """Same arguments as the torch ``plan_paged_attention``; ``bound`` and ``max_query_len`` are
    unused (the kernel reads each token's own ``visible`` keys in place)."""
    if tree is not None:
        tree = TreeMask(*(t.to(torch.int64).contiguous() for t in tree))
    return TritonPlan(token_requests(query_start_loc, num_tokens), query_start_loc, seq_lens,
                      block_table, block_size, tree)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    p: TritonPlan, *, sliding_window: int | None = None,
                    scale: float | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] (unit last stride), k_cache/v_cache [S, Hkv, D] (same layout) ->
    [N, Hq, D] in q's dtype. ``sliding_window`` None = full causal, ``scale`` None =
    ``D ** -0.5``, ``softcap`` None = no cap, ``sinks`` [Hq] (contiguous) None = no sink (as
    the torch path). O(1) host checks only."""
    check_sliding_window(sliding_window)
    check_softcap(softcap)
    req, qsl, seq_lens, table, block_size, tree = p
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    if q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"paged_attention: q.stride()={q.stride()}, k_cache.stride()="
                         f"{k_cache.stride()}, v_cache.stride()={v_cache.stride()}: need unit "
                         "last strides and the same cache layout")
    if sinks is not None and (sinks.shape != (hq,) or sinks.stride(0) != 1):
        raise ValueError(f"paged_attention: sinks of shape {tuple(sinks.shape)}: need [{hq}], "
                         "contiguous")
    out = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    acc = tl.float64 if k_cache.dtype == torch.float64 else tl.float32
    _paged_attention_kernel[(n, hkv)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0),
        k_cache.stride(1), out, out.stride(0), out.stride(1), req, qsl, seq_lens, table,
        table.stride(0), d ** -0.5 if scale is None else scale, sliding_window or 0,
        float(softcap or 0), q if sinks is None else sinks, *(tree or (req, req, req)),
        HAS_SINKS=sinks is not None, HAS_TREE=tree is not None,
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_G=triton.next_power_of_2(hq // hkv), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_N=KEYS_PER_ITERATION, ACC=acc)
    return out
