"""The SwiGLU MLP (also each MoE expert)."""

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.layers.linear import MergedLinear, save_merged_as_parts


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, [..., H] -> [..., H].

    gate and up are one ``gate_up_proj`` matmul (checkpoint names gate_proj/up_proj).
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        h, i = hidden_size, intermediate_size
        self.gate_up_proj = MergedLinear(h, {"gate_proj": i, "up_proj": i}, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        save_merged_as_parts(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
