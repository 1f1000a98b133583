"""RMSNorm as HF computes it."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """HF RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``, statistics in float32, output in x's dtype.

    ``F.rms_norm``: one fused kernel on CUDA; x [..., dim] -> [..., dim].
    Example: x = [3, 4], w = [1, 2], eps -> 0: rms = sqrt(12.5) -> [0.8485, 2.2627].
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
