"""Attention metadata, per-model paged KV cache tensors and paged attention.

Slot of a token at position ``pos`` of request ``r``:
``block_table[r, pos // block_size] * block_size + pos % block_size``; slot ``-1`` means
"do not write" (padding rows, positions past ``max_model_len``). Writes to ``-1`` go to one
trash slot at the end of the flat cache, so no boolean masking (and no host sync) is needed.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where the N query tokens of one forward live and what each may attend to."""

    slot_mapping: torch.Tensor  # [N] int64, -1 = don't write
    query_start_loc: torch.Tensor  # [B+1] int32, exclusive cumsum of query tokens per request
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_seq_len: int  # host upper bound on seq_lens (shapes the gather; never read from device)

    @classmethod
    def dummy(cls, num_tokens: int, device) -> "AttentionMetadata":
        """An idle rank's layout: one request of num_tokens padding tokens, every write to -1."""
        return cls(slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
                   query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
                   seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
                   block_table=torch.zeros(1, 1, dtype=torch.int32, device=device),
                   max_seq_len=num_tokens)

    def request_of_token(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 request index of each token; tokens past the last request map to it."""
        tok = torch.arange(num_tokens, device=self.query_start_loc.device, dtype=torch.int32)
        idx = torch.searchsorted(self.query_start_loc[1:], tok, right=True)
        return idx.clamp_(max=self.seq_lens.shape[0] - 1)


class KVCache:
    """K/V tensors of one model: [num_layers, num_blocks * block_size + 1 (trash), Hkv, D]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        num_slots = num_blocks * block_size + 1
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.trash_slot = num_slots - 1

    def bind(self, meta: AttentionMetadata) -> "PagedKV":
        return PagedKV(self, meta)


class PagedKV:
    """The ``kv`` object models call: ``attend(layer_idx, q, k, v)`` writes then attends."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        self.cache = cache
        self.meta = meta
        self._prepared: tuple[torch.Tensor, ...] | None = None

    def _prepare(self, num_tokens: int) -> tuple[torch.Tensor, ...]:
        """Per-forward gather indices, shared by all layers."""
        meta, bs = self.meta, self.cache.block_size
        device = meta.seq_lens.device
        write_slots = torch.where(meta.slot_mapping < 0, self.cache.trash_slot, meta.slot_mapping)
        req = self.meta.request_of_token(num_tokens)
        # keys visible to token i of request r: seq_len[r] - (tokens of r after i)
        q_end = meta.query_start_loc[1:].to(torch.int64)[req]
        tok = torch.arange(num_tokens, device=device)
        visible = (meta.seq_lens.to(torch.int64)[req] - (q_end - 1 - tok)).clamp_(min=1)
        key_pos = torch.arange(meta.max_seq_len, device=device)
        block_idx = (key_pos // bs).clamp(max=meta.block_table.shape[1] - 1)
        key_slots = meta.block_table.to(torch.int64)[:, block_idx] * bs + key_pos % bs  # [B, L]
        mask = key_pos[None, :] < visible[:, None]  # [N, L]
        return write_slots, req, key_slots, mask

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (RoPE applied) -> [N, Hq, D]."""
        n, hq, d = q.shape
        if self._prepared is None:
            self._prepared = self._prepare(n)
        write_slots, req, key_slots, mask = self._prepared
        k_cache, v_cache = self.cache.k[layer_idx], self.cache.v[layer_idx]
        k_cache.index_copy_(0, write_slots, k.to(k_cache.dtype))
        v_cache.index_copy_(0, write_slots, v.to(v_cache.dtype))
        hkv = k_cache.shape[1]
        keys = k_cache[key_slots][req]  # [N, L, Hkv, D]
        values = v_cache[key_slots][req]
        # [N, Hkv, G, D] x [N, Hkv, D, L] -> one query row per (token, head)
        qg = q.view(n, hkv, hq // hkv, d)
        out = F.scaled_dot_product_attention(
            qg, keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3),
            attn_mask=mask[:, None, None, :],
        )
        return out.reshape(n, hq, d)
