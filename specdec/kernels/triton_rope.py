"""Rotary embedding as one Triton kernel (instead of mul + roll + addcmul (+ cat)): the same
contract as ``rope_torch.apply_rope`` (the oracle; compared under ``TRITON_INTERPRET=1`` in
tests/test_rope.py), for the flat layout of the paged forward: x [N, H, D] (rows and heads
strided, unit last stride, e.g. the q and k heads of one qkv output), cos/sin [N, 1, R]
contiguous, R even and <= D (partial rotary: channels R.. are copied). Other layouts (the dense
[B, T, H, D] path) and autograd take the torch formula.

One program per token: all H heads, products in float32 (float64 for float64), cast back.

``rope_write_kv``: the attention layer's q/k rotary and its K/V cache write as one kernel (the
contract of ``rope_torch.rope_write_kv``; full, non-interleaved rotary): rotated q goes to a new
[N, Hq, D], rotated k and v straight to their cache rows (no rotated-k tensor, no
``index_copy_`` launches); the attention layer takes it wherever Triton runs
(``specdec.attention.PagedKV.attend_qkv``; first run on an H100 on 2026-11-27).
"""

import torch
import triton
import triton.language as tl

from specdec.kernels import rope_torch


@triton.jit
def _rope_kernel(x_ptr, x_stride_t, x_stride_h, cos_ptr, sin_ptr, out_ptr,
                 HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROT_DIM: tl.constexpr,
                 INTERLEAVED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 ACC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    rotated = d < ROT_DIM
    mask = (h[:, None] < HEADS) & (d[None, :] < HEAD_DIM)
    rows = x_ptr + t * x_stride_t + h[:, None] * x_stride_h
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(ACC)
    if INTERLEAVED:
        partner = d ^ 1  # (2j, 2j+1)
    else:
        partner = (d + ROT_DIM // 2) % ROT_DIM  # (j, j + R/2)
    swapped = tl.load(rows + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(ACC)
    cos = tl.load(cos_ptr + t * ROT_DIM + d, mask=rotated, other=0.0).to(ACC)
    sin = tl.load(sin_ptr + t * ROT_DIM + d, mask=rotated, other=0.0).to(ACC)
    out = tl.where(rotated[None, :], x * cos[None, :] + swapped * sin[None, :], x)
    tl.store(out_ptr + t * HEADS * HEAD_DIM + h[:, None] * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    """x [N, H, D], cos/sin [N, 1, R] -> new contiguous [N, H, D] in x's dtype."""
    n, heads, d = x.shape if x.dim() == 3 else (0, 0, 0)
    r = cos.shape[-1]
    flat = (x.dim() == 3 and cos.shape == sin.shape == (n, 1, r) and r <= d and r % 2 == 0
            and cos.is_contiguous() and sin.is_contiguous() and x.stride(-1) == 1)
    grad = torch.is_grad_enabled() and (x.requires_grad or cos.requires_grad)
    if not flat or grad:
        return rope_torch.apply_rope(x, cos, sin, interleaved)
    out = torch.empty((n, heads, d), dtype=x.dtype, device=x.device)
    if n:
        acc = tl.float64 if x.dtype == torch.float64 else tl.float32
        _rope_kernel[(n,)](x, x.stride(0), x.stride(1), cos, sin, out, HEADS=heads, HEAD_DIM=d,
                           ROT_DIM=r, INTERLEAVED=interleaved,
                           BLOCK_H=triton.next_power_of_2(heads),
                           BLOCK_D=triton.next_power_of_2(d), ACC=acc)
    return out


@triton.jit
def _rotate_heads(src, dst, heads, cos, sin, HEAD_DIM: tl.constexpr, ROTATE: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """``heads`` contiguous heads of HEAD_DIM from ``src`` to ``dst``, rotated (neox pairs)
    when ROTATE."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < heads) & (d[None, :] < HEAD_DIM)
    rows = src + h[:, None] * HEAD_DIM
    x = tl.load(rows + d[None, :], mask=mask, other=0.0).to(ACC)
    if ROTATE:
        partner = (d + HEAD_DIM // 2) % HEAD_DIM  # (j, j + D/2)
        swapped = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(ACC)
        x = x * cos[None, :] + swapped * sin[None, :]
    tl.store(dst + h[:, None] * HEAD_DIM + d[None, :], x.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(qkv_ptr, qkv_stride_t, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_ptr,
                          v_ptr, cache_stride, HQ: tl.constexpr, HKV: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + t * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0).to(ACC)
    sin = tl.load(sin_ptr + t * HEAD_DIM + d, mask=d < HEAD_DIM, other=0.0).to(ACC)
    row = qkv_ptr + t * qkv_stride_t
    _rotate_heads(row, q_ptr + t * HQ * HEAD_DIM, HQ, cos, sin, HEAD_DIM, True, BLOCK_H,
                  BLOCK_D, ACC)
    _rotate_heads(row + HQ * HEAD_DIM, k_ptr + slot * cache_stride, HKV, cos, sin, HEAD_DIM,
                  True, BLOCK_H, BLOCK_D, ACC)
    _rotate_heads(row + (HQ + HKV) * HEAD_DIM, v_ptr + slot * cache_stride, HKV, cos, sin,
                  HEAD_DIM, False, BLOCK_H, BLOCK_D, ACC)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  num_q_heads: int) -> torch.Tensor:
    """See ``rope_torch.rope_write_kv``; qkv rows strided (unit last two strides), cos/sin
    [N, 1, D] contiguous, caches [S, Hkv, D] contiguous; other layouts take the torch formula."""
    n, heads, d = qkv.shape
    hkv = (heads - num_q_heads) // 2
    fits = (cos.shape == sin.shape == (n, 1, d) and d % 2 == 0 and cos.is_contiguous()
            and sin.is_contiguous() and qkv.stride(2) == 1 and qkv.stride(1) == d
            and k_cache.is_contiguous() and v_cache.stride() == k_cache.stride()
            and k_cache.shape[1:] == (hkv, d))
    if not fits:
        return rope_torch.rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, num_q_heads)
    q = torch.empty((n, num_q_heads, d), dtype=qkv.dtype, device=qkv.device)
    if n:
        acc = tl.float64 if qkv.dtype == torch.float64 else tl.float32
        _rope_write_kv_kernel[(n,)](
            qkv, qkv.stride(0), cos, sin, slots, q, k_cache, v_cache, k_cache.stride(0),
            HQ=num_q_heads, HKV=hkv, HEAD_DIM=d,
            BLOCK_H=triton.next_power_of_2(max(num_q_heads, hkv)),
            BLOCK_D=triton.next_power_of_2(d), ACC=acc)
    return q
