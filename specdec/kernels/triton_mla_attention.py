"""Latent (MLA) paged attention as one Triton kernel: each token reads only its own request's
visible latent rows ``[0, visible)`` (``visible`` read on the device), once, for K and V.

Same contract and formulas as the torch path (``mla_attention_torch.py``, the oracle;
``tests/test_mla_attention.py`` compares them under ``TRITON_INTERPRET=1``) and the plan of
``triton_paged_attention.plan_paged_attention`` (``TritonPlan``). One program per (token,
block of ``BLOCK_H`` heads): it loads those heads' absorbed queries once, split into the
latent part ``[BLOCK_H, V]`` and the rope part ``[BLOCK_H, D - V]``, then walks the rows
``BLOCK_N`` at a time; each row is loaded as ``c`` (its first V columns, which are also the
value) and ``k_pe`` (the rest), scores are ``q_lat . c + q_pe . k_pe`` (two ``tl.dot``), and an
online softmax (running max ``m``, sum ``l``, accumulator ``acc [BLOCK_H, V]``) accumulates
``p @ c`` in float32 (float64 for a float64 cache). E.g. DeepSeek-V3 (V = 512, D = 576, 128
heads): grid (N, 8) with BLOCK_H = 16; a decode token at position 999 reads its 1000 rows
(1.1 MB in bf16) once per head block, never the rest of the cache.

Worked example of the online softmax (one head, scores [1, 3] then [2]): after block 1
m = 3, l = e^(1-3) + 1; block 2: m' = 3, alpha = 1, l' = l + e^(2-3); out = acc / l'.
Padding tokens (past the last request) attend like the last request's last token.
"""

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specdec.kernels.mla_attention_torch import check_latent

if TYPE_CHECKING:  # not imported at run time: loading this module must not load that one
    from specdec.kernels.triton_paged_attention import TritonPlan

ROWS_PER_ITERATION = 16  # BLOCK_N (tl.dot needs >= 16)
HEADS_PER_PROGRAM = 16  # BLOCK_H (tl.dot needs >= 16; fewer heads are masked)


# Local combiners, not tl.sum / tl.max (see triton_padded.py: triton's own @jit helpers do
# not switch to the interpreter after import).
@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit
def _mla_attention_kernel(q_ptr, q_stride_t, q_stride_h, c_ptr, c_stride_s, out_ptr,
                          out_stride_t, out_stride_h, req_ptr, qsl_ptr, seq_lens_ptr,
                          table_ptr, table_stride, scale, node_ptr, ancestors_ptr,
                          HAS_TREE: tl.constexpr, HEADS: tl.constexpr, LATENT: tl.constexpr,
                          ROPE: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_N: tl.constexpr, ACC: tl.constexpr, DOT: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # token
    hb = tl.program_id(1)  # head block
    r = tl.load(req_ptr + i).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + r).to(tl.int64)
    q_end = tl.load(qsl_ptr + r + 1).to(tl.int64)
    visible = tl.maximum(tl.minimum(seq_len - (q_end - 1 - i), seq_len), 1)
    if HAS_TREE:  # a draft-tree node: its request's prefix and its ancestors
        ancestors = tl.load(ancestors_ptr + i)
        tree_start = visible - 1 - tl.load(node_ptr + i)

    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    lat = tl.arange(0, BLOCK_L)
    rot = tl.arange(0, BLOCK_R)
    h_live = heads < HEADS
    lat_live = lat < LATENT
    rot_live = rot < ROPE
    q_row = q_ptr + i * q_stride_t + heads[:, None] * q_stride_h
    q_lat = tl.load(q_row + lat[None, :], mask=h_live[:, None] & lat_live[None, :],
                    other=0.0).to(DOT)  # [BLOCK_H, BLOCK_L]
    q_pe = tl.load(q_row + LATENT + rot[None, :], mask=h_live[:, None] & rot_live[None, :],
                   other=0.0).to(DOT)  # [BLOCK_H, BLOCK_R]
    m = tl.full([BLOCK_H], float("-inf"), ACC)
    l = tl.full([BLOCK_H], 0.0, ACC)
    acc = tl.full([BLOCK_H, BLOCK_L], 0.0, ACC)
    n = tl.arange(0, BLOCK_N)
    # a while loop over a loaded bound (see triton_paged_attention.py)
    start = visible * 0
    while start < visible:
        pos = start + n
        live = pos < visible
        if HAS_TREE:
            rel = tl.minimum(tl.maximum(pos - tree_start, 0), 62)
            live = live & ((pos < tree_start) | (((ancestors >> rel) & 1) == 1))
        block = tl.load(table_ptr + r * table_stride + pos // BLOCK_SIZE, mask=live,
                        other=0).to(tl.int64)
        row = c_ptr + (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * c_stride_s
        c = tl.load(row + lat[None, :], mask=live[:, None] & lat_live[None, :],
                    other=0.0).to(DOT)  # [BLOCK_N, BLOCK_L]: keys' latent part and values
        k_pe = tl.load(row + LATENT + rot[None, :], mask=live[:, None] & rot_live[None, :],
                       other=0.0).to(DOT)  # [BLOCK_N, BLOCK_R]
        s = (tl.dot(q_lat, tl.trans(c), out_dtype=ACC, input_precision="ieee")
             + tl.dot(q_pe, tl.trans(k_pe), out_dtype=ACC, input_precision="ieee")) * scale
        s = tl.where(live[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m, tl.reduce(s, 1, _max))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.reduce(p, 1, _add)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), c, out_dtype=ACC,
                                            input_precision="ieee")
        m = m_new
        start += BLOCK_N
    out = acc / l[:, None]
    tl.store(out_ptr + i * out_stride_t + heads[:, None] * out_stride_h + lat[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_live[:, None] & lat_live[None, :])


_DOT_TYPES = {torch.float64: tl.float64, torch.float32: tl.float32,
              torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def mla_attention(q: torch.Tensor, cache: torch.Tensor, p: "TritonPlan", *, value_dim: int,
                  scale: float) -> torch.Tensor:
    """q [N, H, D] (unit last stride), cache [S, 1, D] (unit last stride) -> [N, H, value_dim]
    in q's dtype; same contract as ``mla_attention_torch.mla_attention``. O(1) host checks."""
    check_latent(q, cache, value_dim)
    req, qsl, seq_lens, table, block_size, tree = p
    n, h, d = q.shape
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError(f"mla_attention: q.stride()={q.stride()}, cache.stride()="
                         f"{cache.stride()}: need unit last strides")
    out = torch.empty((n, h, value_dim), dtype=q.dtype, device=q.device)
    if n == 0:
        return out
    acc = tl.float64 if cache.dtype == torch.float64 else tl.float32
    rope = d - value_dim
    _mla_attention_kernel[(n, triton.cdiv(h, HEADS_PER_PROGRAM))](
        q, q.stride(0), q.stride(1), cache, cache.stride(0), out, out.stride(0),
        out.stride(1), req, qsl, seq_lens, table, table.stride(0), scale,
        # (MLA has no window: a node's depth is not read)
        *((tree.node, tree.ancestors) if tree is not None else (req, req)),
        HAS_TREE=tree is not None, HEADS=h, LATENT=value_dim, ROPE=rope, BLOCK_SIZE=block_size,
        BLOCK_H=HEADS_PER_PROGRAM, BLOCK_L=max(16, triton.next_power_of_2(value_dim)),
        BLOCK_R=max(16, triton.next_power_of_2(max(rope, 1))), BLOCK_N=ROWS_PER_ITERATION,
        ACC=acc, DOT=_DOT_TYPES[cache.dtype])
    return out
