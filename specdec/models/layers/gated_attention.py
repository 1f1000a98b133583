"""Gated full attention (Qwen3.5 / Qwen3-Next ``self_attn``): GQA whose ``q_proj`` gives per
head ``[q | gate]`` (2 D columns), per-head zero-centred ``q_norm``/``k_norm`` (``x * (1 + w)``)
before (partial) rotary, and the output scaled by ``sigmoid(gate)`` before ``o_proj``.

Same two modes as ``layers.attention``: ``kv=None`` dense causal SDPA over [B, T, H];
``kv`` given: flat [N, H] through ``kv.attend`` (the paged cache of layer ``layer_idx``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention import KVCacheSpec
from specdec.models.layers.linear import MergedLinear, save_merged_as_parts
from specdec.models.layers.norm import OffsetRMSNorm


class GatedAttention(nn.Module):
    """``qkv_proj`` (checkpoint names q_proj [2 Hq D], k_proj, v_proj), ``o_proj``,
    ``q_norm``/``k_norm`` [D]."""

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        d = head_dim
        self.qkv_proj = MergedLinear(hidden_size, {"q_proj": 2 * num_heads * d,
                                                   "k_proj": num_kv_heads * d,
                                                   "v_proj": num_kv_heads * d}, bias=False)
        self.o_proj = nn.Linear(num_heads * d, hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(d, eps)
        self.k_norm = OffsetRMSNorm(d, eps)
        save_merged_as_parts(self)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.n_kv, self.head_dim)

    def forward(self, x: torch.Tensor, rope, kv=None) -> torch.Tensor:
        """x [B, T, H] (kv=None) or [N, H]; rope: a ``layers.rotary.Rope`` for the same
        leading dims -> same shape as x."""
        lead, hq, hkv, d = x.shape[:-1], self.n_heads, self.n_kv, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * hq * d, hkv * d, hkv * d], dim=-1)
        q, gate = qg.view(*lead, hq, 2 * d).chunk(2, dim=-1)
        q = rope.apply(self.q_norm(q))
        k = rope.apply(self.k_norm(k.view(*lead, hkv, d)))
        v = v.view(*lead, hkv, d)
        if kv is not None:
            out = kv.attend(self.layer_idx, q, k, v)
        else:
            q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [B, H, T, D]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=hq != hkv).transpose(-3, -2)
        out = out.reshape(*lead, hq * d) * torch.sigmoid(gate.reshape(*lead, hq * d))
        return self.o_proj(out)
