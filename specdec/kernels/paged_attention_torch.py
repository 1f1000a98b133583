"""Paged attention in pure torch: gather each request's keys up to a static bound, then SDPA.

The CPU path and the oracle of the Triton kernel (``triton_paged_attention.py``). Both take a
per-forward plan (shared by every layer) and one layer's cache:

    q        [N, Hq, D]   queries (RoPE applied), any float dtype; rows may be strided
    k_cache  [S, Hkv, D]  one layer's flat cache (S = num_blocks * block_size + 1 trash slot)
    v_cache  [S, Hkv, D]
    -> out   [N, Hq, D]   q's dtype

Token ``i`` of request ``r`` (``r = req[i]``, tokens past the last request map to it) sees the
first ``visible[i]`` keys of ``r``, where, with ``q_end = query_start_loc[r + 1]``,

    visible[i] = clamp(seq_len[r] - (q_end - 1 - i), 1, seq_len[r])   (at least 1 key)

i.e. everything before the chunk plus the chunk's tokens up to and including ``i`` (causal).
The token's own position is ``visible[i] - 1``. With a sliding window ``W`` (Mistral v0.1:
key ``j`` is seen by the query at position ``p`` iff ``p - W < j <= p``, transformers'
``kv_idx > q_idx - sliding_window``) it sees key positions

    max(0, visible[i] - W) <= j < visible[i]                          (at most W keys)

and without one (``W = None``) positions ``0 <= j < visible[i]``. Key position ``j`` of ``r``
lives in slot ``block_table[r, j // bs] * bs + j % bs``. Scores are scaled by ``scale``
(default ``D ** -0.5``).

Worked example: query_start_loc = [0, 3, 4], seq_lens = [5, 9] (request 0: a 3-token chunk
after 2 cached tokens; request 1: one decode token), N = 5 (token 4 is padding)
-> req = [0, 0, 0, 1, 1], visible = [3, 4, 5, 9, 9] (the padding token is clamped to 9);
with W = 4 the windows start at max(0, visible - 4) = [0, 0, 1, 5, 5]: token 2 (position 4)
sees keys 1..4, token 3 (position 8) sees keys 5..8.

``bound`` (the gather length L) is any host int >= max(seq_lens): keys outside the
token's range are masked out, so the result does not depend on it. Shapes depend only on N, B,
the block table's width and ``bound``; nothing is read back to the host. The window and scale
are per call (layers may differ), not part of the plan.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PagedPlan(NamedTuple):
    """Per-forward indices, built once and reused by every layer."""

    req: torch.Tensor  # [N] int64, request of each token
    visible: torch.Tensor  # [N] int64, keys each token sees (>= 1)
    key_slots: torch.Tensor  # [N * L] int64, slot of key position j of token i's request at
    #                          i * L + j (one flat index: each layer gathers K and V once)
    key_mask: torch.Tensor  # [N, L] bool, key position < visible


def token_requests(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[N] int64 request of each token; tokens past the last request map to it.

    Example: query_start_loc = [0, 3, 3, 4], N = 6 -> [0, 0, 0, 2, 2, 2] (request 1 is empty).
    """
    tok = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    # = searchsorted(query_start_loc[1:], tok, right=True), as a count: inductor's CUDA
    # lowering of searchsorted rejects a sliced boundary tensor (graph_mode="torchair")
    idx = (query_start_loc[None, 1:] <= tok[:, None]).sum(dim=1)
    return idx.clamp_(max=query_start_loc.shape[0] - 2)


def visible_keys(req: torch.Tensor, query_start_loc: torch.Tensor,
                 seq_lens: torch.Tensor) -> torch.Tensor:
    """[N] int64 keys seen by each token (module formula; example in the module docstring)."""
    tok = torch.arange(req.shape[0], device=req.device)
    seq_len = seq_lens.to(torch.int64)[req]
    q_end = query_start_loc.to(torch.int64)[req + 1]
    return torch.minimum(seq_len - (q_end - 1 - tok), seq_len).clamp_(min=1)


def check_sliding_window(sliding_window) -> None:
    """Raise ValueError unless ``sliding_window`` is None or an int >= 1."""
    if sliding_window is not None and (not isinstance(sliding_window, int)
                                       or isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 1")


def plan_paged_attention(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor,
         num_tokens: int, bound: int, block_size: int) -> PagedPlan:
    """query_start_loc [B+1] int32, seq_lens [B] int32, block_table [B, M] int32 -> PagedPlan."""
    device = seq_lens.device
    req = token_requests(query_start_loc, num_tokens)
    visible = visible_keys(req, query_start_loc, seq_lens)
    key_pos = torch.arange(bound, device=device)
    block_idx = (key_pos // block_size).clamp_(max=block_table.shape[1] - 1)
    key_slots = block_table.to(torch.int64)[:, block_idx] * block_size + key_pos % block_size
    # (a block table's unused entries may be -1: their keys are masked, read slot 0 instead)
    return PagedPlan(req, visible, key_slots[req].flatten().clamp_(min=0),
                     key_pos[None, :] < visible[:, None])


def gather_keys(cache: torch.Tensor, p: PagedPlan) -> torch.Tensor:
    """cache [S, H, D] -> [N, L, H, D]: each token's request's key positions 0..L-1 (one
    index_select: a 2-D advanced index, or a gather per request then per token, costs several
    times more on CPU)."""
    n, length = p.key_mask.shape
    return cache.index_select(0, p.key_slots).view(n, length, *cache.shape[1:])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    p: PagedPlan, *, sliding_window: int | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """q [N, Hq, D], k_cache/v_cache [S, Hkv, D] -> [N, Hq, D] (module docstring).

    ``sliding_window`` W (None: full causal) drops the keys before ``visible - W`` with an
    [N, L] mask built per call; ``scale`` None is ``D ** -0.5``."""
    check_sliding_window(sliding_window)
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    mask = p.key_mask
    if sliding_window is not None:
        key_pos = torch.arange(mask.shape[1], device=mask.device)
        mask = mask & (key_pos[None, :] >= (p.visible - sliding_window)[:, None])
    keys = gather_keys(k_cache, p)  # [N, L, Hkv, D]
    values = gather_keys(v_cache, p)
    # [N, Hkv, G, D] x [N, Hkv, D, L]: one query row per (token, head)
    out = F.scaled_dot_product_attention(
        q.view(n, hkv, hq // hkv, d), keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3),
        attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(n, hq, d)
