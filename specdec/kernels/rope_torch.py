"""Rotary embedding in pure torch: the CPU path and the oracle of ``triton_rope.py``.

``apply_rope(x, cos, sin, interleaved)`` rotates the first R = cos.shape[-1] channels of x:
``x[:R] * cos + partner(x[:R]) * sin`` with ``sin`` already carrying the rotation's sign (see
``specdec.models.layers.rotary.Rope``); channels R.. pass through. partner swaps the halves
(``[x1, x2] -> [x2, x1]``, neox / rotate_half layout) or, when ``interleaved``, the pairs
(2j, 2j+1) (GPT-J layout). x [..., H, D] (may be a strided view), cos/sin broadcastable to
[..., 1, R], R even and <= D -> a new tensor like x.
Example (R=2, D=3): x = [1, 0, 5], cos = [c, c], sin = [-s, s] -> [c, s, 5].

``rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, num_q_heads)``: the attention layer's
rotary and cache write in one call (the oracle of ``triton_rope.rope_write_kv``).
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


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  num_q_heads: int) -> torch.Tensor:
    """qkv [N, Hq + 2 Hkv, D] (q, k, v heads of one projection), cos/sin [N, 1, D], slots [N]
    (cache rows, each >= 0) -> rotated q [N, Hq, D]; rotated k and v written to
    ``k_cache[slots]`` / ``v_cache[slots]`` ([S, Hkv, D] each)."""
    hkv = (qkv.shape[1] - num_q_heads) // 2
    qk = apply_rope(qkv[:, :num_q_heads + hkv], cos, sin)
    k_cache.index_copy_(0, slots, qk[:, num_q_heads:])
    v_cache.index_copy_(0, slots, qkv[:, num_q_heads + hkv:])
    return qk[:, :num_q_heads]
