"""Rotary embedding in pure torch: the CPU path and the oracle of ``triton_rope.py``.

``apply_rope(x, cos, sin) = x * cos + swap_halves(x) * sin`` where ``swap_halves([x1, x2]) =
[x2, x1]`` and ``sin`` already carries rotate_half's sign (``[-sin, sin]``, see
``specdec.models.llama.Rope``). x [..., H, D] (may be a strided view), cos/sin broadcastable
to it ([..., 1, D]) -> a new tensor like x. Example (D=2): x = [1, 0], cos = [c, c],
sin = [-s, s] -> [1*c + 0*(-s), 0*c + 1*s] = [c, s].
"""

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)
