"""Multi-head latent attention (MLA, DeepSeek-V2/V3) with HF parameter names.

Projections (H heads, latent rank L = ``kv_lora_rank``, rope dim R = ``qk_rope_head_dim``,
Dn = ``qk_nope_head_dim``, Dv = ``v_head_dim``):
- queries: ``q_proj`` [H*(Dn+R), hidden], or with ``q_lora_rank`` Q:
  ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` ([Q, hidden], norm [Q], [H*(Dn+R), Q]);
- keys/values: ``kv_a_proj_with_mqa(x)`` [L+R, hidden] -> ``c`` (first L, then
  ``kv_a_layernorm``) and ``k_pe`` (last R, one rope "head" shared by every head);
  ``kv_b_proj`` [H*(Dn+Dv), L] expands ``c`` into each head's ``k_nope`` (Dn) then ``v`` (Dv);
- rotary on the R rope channels of q and k_pe only; ``o_proj`` [hidden, H*Dv].

Two modes (the contract of ``layers.attention``):
- ``kv=None`` (batched [B, T, hidden]): expanded, dense causal SDPA over
  ``k = [k_nope, k_pe]``, ``v``, with softmax scale ``scale``.
- ``kv`` given (flat [N, hidden]): the absorbed form over the latent cache. The cache keeps
  ONE row per token, ``[c, k_pe]`` (L+R values: ``KVCacheSpec(1, L+R, value_dim=L)``); with
  ``W_UK``/``W_UV`` the per-head [Dn, L]/[Dv, L] blocks of ``kv_b_proj``,
  ``q_nope . k_nope = (W_UK^T q_nope) . c``, so each head queries the rows with
  ``[W_UK^T q_nope, q_pe]`` (L+R), averages the rows' first L columns (``c``) and maps the
  result through ``W_UV``. Prefill and decode both take this path (one kernel).

Example (H=4, L=32, R=16, Dn=32, Dv=24): the cache holds 48 values per token per layer where a
GQA layer with 4 kv heads of head dim 48 keeps 2*4*48 = 384.

Tensor parallelism (``layers.parallel``, as vLLM splits MLA): each rank keeps H/T heads --
its rows of ``q_proj`` / ``q_b_proj`` and ``kv_b_proj``, its columns of ``o_proj`` (whose
partial outputs are summed) -- while ``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms,
and so the latent cache row of every token, are replicated: the latent is shared by every
head, so splitting it would cost a collective inside attention for a cache of L+R values.
``tp`` (set by the sharding): under sequence parallelism the layer gathers its N/T tokens once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.attention import KVCacheSpec
from specdec.models.layers.norm import RMSNorm


class MLAttention(nn.Module):
    """MLA of one layer; ``scale``: the softmax scale (``(Dn+R) ** -0.5``, times YaRN's
    ``mscale(factor, mscale_all_dim) ** 2`` for DeepSeek-V3)."""

    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, *,
                 q_lora_rank: int | None, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, scale: float, eps: float = 1e-6):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_lora_rank, eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim,
                                            bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)
        self.tp = None  # a TPContext once sharded (``layers.parallel``)

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent row per token: ``[c (L), k_pe (R)]``, V = its first L columns."""
        return KVCacheSpec(1, self.kv_lora_rank + self.rope_dim, value_dim=self.kv_lora_rank)

    def forward(self, x: torch.Tensor, rope, kv=None) -> torch.Tensor:
        """x: [B, T, hidden] with kv=None, else [N, hidden]; rope: a ``layers.rotary.Rope``
        of R channels for the same leading dims. -> [..., hidden]."""
        if self.tp is not None:
            x = self.tp.gather(x)  # sequence parallelism: every token, once
        lead, h = x.shape[:-1], self.n_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(*lead, h, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = rope.apply(q_pe), rope.apply(k_pe.unsqueeze(-2))  # [..., H|1, R]
        if kv is None:
            out = self.dense(q_nope, q_pe, c, k_pe)
        else:
            out = self.absorbed(q_nope, q_pe, c, k_pe[..., 0, :], kv)
        return self.o_proj(out.reshape(*lead, h * self.v_dim))

    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``kv_b_proj`` split per head: W_UK [H, Dn, L], W_UV [H, Dv, L]."""
        w = self.kv_b_proj.weight.view(self.n_heads, self.nope + self.v_dim, self.kv_lora_rank)
        return w[:, :self.nope], w[:, self.nope:]

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
                 k_pe: torch.Tensor, kv) -> torch.Tensor:
        """q_nope [N, H, Dn], q_pe [N, H, R], c [N, L], k_pe [N, R] -> [N, H, Dv]."""
        w_uk, w_uv = self._w_kv()
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        out = kv.attend_latent(self.layer_idx, torch.cat([q_latent, q_pe], dim=-1),
                               torch.cat([c, k_pe], dim=-1), self.scale)  # [N, H, L]
        return torch.einsum("nhl,hvl->nhv", out, w_uv)

    def dense(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
              k_pe: torch.Tensor) -> torch.Tensor:
        """Expanded causal SDPA: q_nope [B, T, H, Dn], q_pe [B, T, H, R], c [B, T, L],
        k_pe [B, T, 1, R] -> [B, T, H, Dv]."""
        h = self.n_heads
        kv = self.kv_b_proj(c).view(*c.shape[:-1], h, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(*k_pe.shape[:-2], h, self.rope_dim)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [B, H, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(-3, -2)
