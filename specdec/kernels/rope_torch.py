"""Rotary embedding in pure torch: the CPU path and the oracle of ``triton_rope.py``.

``apply_rope(x, cos, sin, interleaved)`` rotates the first R = cos.shape[-1] channels of x:
``x[:R] * cos + partner(x[:R]) * sin`` with ``sin`` already carrying the rotation's sign (see
``specdec.models.layers.rotary.Rope``); channels R.. pass through. partner swaps the halves
(``[x1, x2] -> [x2, x1]``, neox / rotate_half layout) or, when ``interleaved``, the pairs
(2j, 2j+1) (GPT-J layout). x [..., H, D] (may be a strided view), cos/sin broadcastable to
[..., 1, R], R even and <= D -> a new tensor like x.
Example (R=2, D=3): x = [1, 0, 5], cos = [c, c], sin = [-s, s] -> [c, s, 5].
"""

import torch


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> torch.Tensor:
    r = cos.shape[-1]
    rot = x[..., :r]
    if interleaved:
        # reshape, not unflatten: dynamo cannot trace Tensor.unflatten under a TorchFunctionMode
        partner = rot.reshape(*rot.shape[:-1], r // 2, 2).flip(-1).flatten(-2)
    else:
        partner = rot.roll(r // 2, dims=-1)
    out = torch.addcmul(rot * cos, partner, sin)
    return out if r == x.shape[-1] else torch.cat((out, x[..., r:]), dim=-1)
