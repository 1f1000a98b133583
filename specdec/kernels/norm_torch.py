"""Residual add + RMSNorm in pure torch: the CPU path and the oracle of ``triton_norm.py``.

``add_rms_norm(x, residual, weight, eps) -> (h, normed)`` with ``h = x + residual`` (in x's
dtype) and ``normed = rms_norm(h) * weight`` (statistics in float32, as ``F.rms_norm``).
x, residual [..., H] same dtype; weight [H]. Example: x = [1, 2], residual = [2, 2],
weight = [1, 1], eps -> 0: h = [3, 4], normed = h / sqrt(12.5) = [0.8485, 1.1314].
"""

import torch
import torch.nn.functional as F


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = x + residual
    return h, rms_norm(h, weight, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> ``x / sqrt(mean(x^2) + eps) * weight`` in x's dtype
    (``F.rms_norm``: statistics and the weight product in float32)."""
    return F.rms_norm(x, weight.shape, weight, eps)
