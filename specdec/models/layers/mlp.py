"""The gated MLP: SwiGLU (also each MoE expert), Gemma's GeGLU or gpt-oss's clamped SwiGLU."""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.layers.linear import MergedLinear, save_merged_as_parts

# config's hidden_act / hidden_activation -> the function (transformers' ACT2FN names)
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class MLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, [..., H] -> [..., H]: SwiGLU with ``act`` silu, GeGLU
    (Gemma) with gelu_pytorch_tanh.

    gate and up are one ``gate_up_proj`` matmul (checkpoint names gate_proj/up_proj, or
    ``gate_up_proj`` itself with ``fused_checkpoint``: Phi-3). ``bias``: gate, up and down
    carry biases (gpt-oss's experts). ``clamped_swiglu`` = (alpha, limit) (gpt-oss, in place of
    ``act``): ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
    ``down((u + 1) * g * sigmoid(alpha * g))``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu",
                 fused_checkpoint: bool = False, bias: bool = False,
                 clamped_swiglu: tuple[float, float] | None = None):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"act={act!r}: allowed {sorted(ACTIVATIONS)}")
        h, i = hidden_size, intermediate_size
        self.act = ACTIVATIONS[act]
        self.fused_checkpoint = fused_checkpoint
        self.clamped_swiglu = clamped_swiglu
        self.gate_up_proj = MergedLinear(h, {"gate_proj": i, "up_proj": i}, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        if not fused_checkpoint:
            save_merged_as_parts(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        if self.clamped_swiglu is None:
            return self.down_proj(self.act(gate) * up)
        alpha, limit = self.clamped_swiglu
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return self.down_proj((up + 1) * gate * torch.sigmoid(gate * alpha))
