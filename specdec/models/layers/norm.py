"""RMSNorm as HF computes it."""

import torch
import torch.nn.functional as F
from torch import nn

from specdec import kernels


class RMSNorm(nn.Module):
    """HF RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``, statistics in float32, output in x's dtype.

    x [..., dim] -> [..., dim] through ``kernels.rms_norm``: where Triton runs the fused add +
    norm kernel without the add (as every decoder layer's norms), elsewhere ``F.rms_norm``.
    Example: x = [3, 4], w = [1, 2], eps -> 0: rms = sqrt(12.5) -> [0.8485, 2.2627].
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class OffsetRMSNorm(nn.Module):
    """Gemma / Qwen3.5 RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + w)`` in float32, output in
    x's dtype; ``w`` is stored zero-centred (a checkpoint's 0 means scale 1).

    Example: x = [3, 4], w = [0, 1], eps -> 0: [0.8485, 2.2627] (RMSNorm's example, w + 1).
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The gated DeltaNet's output norm: ``w * rmsnorm(x) * silu(z)`` (norm in float32, cast
    to x's dtype before the plain ``w`` scale, the gate in float32), x, z [..., dim].

    Example: x = [3, 4], w = 1: z = [0, 0] -> [0, 0] (silu(0) = 0); z = [30, 30] ->
    [0.8485, 1.1314] * 30.
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)
