"""Grouped-query attention: one qkv matmul, optional q/k RMSNorm, rotary, the paged cache.

Two modes (the contract the engine relies on):
- ``kv=None``: x is batched ``[B, T, in]``, attention is dense causal SDPA (training, reference),
  limited to the last ``sliding_window`` keys when the layer has one.
- ``kv`` given: x is flat ``[N, in]``; the layer calls ``kv.attend(layer_idx, q [N, Hq, D],
  k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D]`` with rotary already applied; the cache knows
  the layer's window, scale and soft cap from ``kv_cache_spec()``.

Layer options (Gemma): ``scale`` (``query_pre_attn_scalar ** -0.5`` instead of ``D ** -0.5``)
and ``softcap`` (scores ``c * tanh(s / c)`` before the softmax, ``attn_logit_softcapping``);
(gpt-oss) ``sinks``: a learned logit per query head, ``self_attn.sinks [Hq]``, that joins each
softmax with no value (passed to ``kv.attend``), and ``o_bias`` (a bias on ``o_proj``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention import KVCacheSpec, PagedKV
from specdec.kernels.paged_attention_torch import masked_attention
from specdec.models.layers.linear import MergedLinear, save_merged_as_parts
from specdec.models.layers.norm import RMSNorm

QK_NORMS = (None, "head", "full")


class Attention(nn.Module):
    """``qkv_proj`` (checkpoint names q_proj/k_proj/v_proj, or ``qkv_proj`` itself with
    ``fused_checkpoint``: Phi-3), ``o_proj``; ``qk_norm``: None, ``"head"`` (Qwen3:
    ``q_norm``/``k_norm`` of width D on each head) or ``"full"`` (MiniMax-M2: of width Hq*D
    and Hkv*D over the whole projection), applied before rotary, of class ``norm`` (Gemma-3:
    ``OffsetRMSNorm``); ``sliding_window``, ``scale``, ``softcap``, ``sinks``, ``o_bias``: the
    module docstring."""

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, *, in_features: int | None = None, qkv_bias: bool = False,
                 qk_norm: str | None = None, eps: float = 1e-6,
                 sliding_window: int | None = None, scale: float | None = None,
                 softcap: float | None = None, norm: type[nn.Module] = RMSNorm,
                 fused_checkpoint: bool = False, sinks: bool = False, o_bias: bool = False):
        super().__init__()
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={qk_norm!r}: allowed {QK_NORMS}")
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.head_dim = num_heads, num_kv_heads, head_dim
        self.sliding_window, self.scale, self.softcap = sliding_window, scale, softcap
        self.qk_norm = qk_norm
        self.fused_checkpoint = fused_checkpoint
        d = head_dim
        self.qkv_proj = MergedLinear(in_features or hidden_size,
                                     {"q_proj": num_heads * d, "k_proj": num_kv_heads * d,
                                      "v_proj": num_kv_heads * d}, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * d, hidden_size, bias=o_bias)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        if qk_norm is not None:
            q_width, k_width = (d, d) if qk_norm == "head" else (num_heads * d, num_kv_heads * d)
            self.q_norm = norm(q_width, eps)
            self.k_norm = norm(k_width, eps)
        if not fused_checkpoint:
            save_merged_as_parts(self)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.n_kv, self.head_dim, self.sliding_window, scale=self.scale,
                           logit_softcap=self.softcap, sinks=self.sinks is not None)

    def forward(self, x: torch.Tensor, rope, kv=None) -> torch.Tensor:
        """x: [B, T, in] with kv=None, else [N, in]; rope: a ``layers.rotary.Rope`` for the
        same leading dims. -> [..., hidden_size]."""
        hq, hkv, d = self.n_heads, self.n_kv, self.head_dim
        qkv = self.qkv_proj(x)  # tensor parallel with SP: x holds N/T tokens, qkv all N
        lead = qkv.shape[:-1]
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        if self.qk_norm is None:  # one rotary pass over q and k together
            qkv = qkv.view(*lead, hq + 2 * hkv, d)
            if isinstance(kv, PagedKV) and kv.fuses_rope_write(rope, d):
                # rotary and the K/V write in one kernel
                out = kv.attend_qkv(self.layer_idx, qkv, hq, rope, **sinks)
                return self.o_proj(out.reshape(*lead, hq * d))
            qk = rope.apply(qkv[..., :hq + hkv, :])
            q, k, v = qk[..., :hq, :], qk[..., hq:, :], qkv[..., hq + hkv:, :]
        else:
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            if self.qk_norm == "full":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.view(*lead, hq, d), k.view(*lead, hkv, d), v.view(*lead, hkv, d)
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = rope.apply(q), rope.apply(k)
        if kv is not None:
            out = kv.attend(self.layer_idx, q, k, v, **sinks)
        else:
            out = self.dense(q, k, v)
        return self.o_proj(out.reshape(*lead, hq * d))

    def dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over [B, T, H, D] (positions 0..T-1), windowed, scaled, capped and
        sunk as the layer is."""
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [B, H, T, D]
        if self.sliding_window is None and self.softcap is None and self.sinks is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 enable_gqa=self.n_heads != self.n_kv)
        else:
            i = torch.arange(q.shape[-2], device=q.device)
            lag = i[:, None] - i[None, :]  # query position - key position
            mask = lag >= 0
            if self.sliding_window is not None:
                mask &= lag < self.sliding_window
            sinks = None if self.sinks is None else self.sinks.view(-1, 1, 1)
            out = masked_attention(q, k, v, mask, scale=self.scale, softcap=self.softcap,
                                   sinks=sinks)
        return out.transpose(-3, -2)
