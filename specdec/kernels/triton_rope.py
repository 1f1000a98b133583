"""Rotary embedding as one Triton kernel (instead of mul + roll + addcmul (+ cat)): the same
contract as ``rope_torch.apply_rope`` (the oracle; compared under ``TRITON_INTERPRET=1`` in
tests/test_rope.py), for the flat layout of the paged forward: x [N, H, D] (rows and heads
strided, unit last stride, e.g. the q and k heads of one qkv output), cos/sin [N, 1, R]
contiguous, R even and <= D (partial rotary: channels R.. are copied). Other layouts (the dense
[B, T, H, D] path) and autograd take the torch formula.

One program per token: all H heads, products in float32 (float64 for float64), cast back.
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
