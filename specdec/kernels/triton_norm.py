"""Residual add + RMSNorm as one Triton kernel (one launch instead of two, one read of each
input): the same contract as ``norm_torch.add_rms_norm`` (the oracle; compared under
``TRITON_INTERPRET=1`` in tests/test_norm.py); ``rms_norm`` is the same kernel without the
add (``norm_torch.rms_norm``).

One program per row: ``h = x + residual`` rounded to the model dtype (stored, and what the
statistics see, exactly as the two-kernel torch path), then ``h * rsqrt(mean(h^2) + eps) *
weight`` in float32 (float64 for float64 inputs), cast back. Inference only: with autograd
recording, the torch formula runs instead (this kernel has no backward).
"""

import torch
import triton
import triton.language as tl

from specdec.kernels import norm_torch


@triton.jit
def _add(a, b):  # local combiner: tl.sum does not switch to the interpreter after import
    return a + b


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, h_ptr, out_ptr, x_stride, res_stride, eps,
                         HIDDEN: tl.constexpr, BLOCK: tl.constexpr, ACC: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    live = c < HIDDEN
    x = tl.load(x_ptr + row * x_stride + c, mask=live, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * res_stride + c, mask=live, other=0.0)
        h = (x.to(ACC) + res.to(ACC)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * HIDDEN + c, h, mask=live)
    else:  # RMSNorm alone: the row as it is
        h = x
    h = h.to(ACC)
    inv_rms = 1.0 / tl.sqrt(tl.reduce(h * h, 0, _add) / HIDDEN + eps)
    w = tl.load(w_ptr + c, mask=live, other=0.0).to(ACC)
    tl.store(out_ptr + row * HIDDEN + c, (h * inv_rms * w).to(out_ptr.dtype.element_ty),
             mask=live)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [..., H] (same dtype, rows with unit last stride), weight [H] ->
    (h, normed), both new contiguous [..., H] in x's dtype."""
    if torch.is_grad_enabled() and (x.requires_grad or residual.requires_grad
                                    or weight.requires_grad):
        return norm_torch.add_rms_norm(x, residual, weight, eps)
    hidden = x.shape[-1]
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty_like(h)
    if h.numel() == 0:
        return h, out
    x2, res2 = x.reshape(-1, hidden), residual.reshape(-1, hidden)
    if residual.shape != x.shape or hidden > 1 and (x2.stride(-1) != 1 or res2.stride(-1) != 1):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} stride {x.stride()}, residual "
                         f"{tuple(residual.shape)} stride {residual.stride()}: need equal "
                         "shapes and unit last strides")
    _launch(x2, res2, weight, h, out, eps, has_residual=True)
    return h, out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> normed, a new contiguous [..., H] in x's dtype (the same
    kernel without the add: ``norm_torch.rms_norm``'s contract)."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return norm_torch.rms_norm(x, weight, eps)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, hidden)
    if hidden > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    _launch(x2, x2, weight, out, out, eps, has_residual=False)
    return out


def _launch(x2: torch.Tensor, res2: torch.Tensor, weight: torch.Tensor, h: torch.Tensor,
            out: torch.Tensor, eps: float, *, has_residual: bool) -> None:
    """One program per row of x2 [R, H] (res2 and h unread / unwritten without a residual)."""
    hidden = x2.shape[1]
    acc = tl.float64 if x2.dtype == torch.float64 else tl.float32
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, res2, weight, h, out, x2.stride(0), res2.stride(0), eps, HIDDEN=hidden,
        BLOCK=triton.next_power_of_2(hidden), ACC=acc, HAS_RESIDUAL=has_residual)
