"""Latent (MLA) paged attention in pure torch: gather each request's latent rows up to a static
bound, then SDPA. The CPU path and the oracle of ``triton_mla_attention.py``.

    q      [N, H, D]   absorbed queries ``[W_UK^T q_nope, q_pe]`` (D = L + R), any float dtype
    cache  [S, 1, D]   one layer's latent rows ``[c, k_pe]`` (S = slots + 1 trash slot)
    -> out [N, H, V]   ``softmax(scale * q . rows) @ rows[:, :V]`` (V = ``value_dim`` = L)

Every head reads the same rows (one latent "kv head"); V is a prefix of the K row, so the
cache is read once for both. Which rows token ``i`` sees, and the plan, are exactly those of
``paged_attention_torch`` (``visible[i]`` keys of its request, causal; no window): the plan
``plan_paged_attention`` builds for the GQA layers is reused unchanged.

Worked example (one token, one head, D = 3, V = 2, scale 1, two visible rows [1, 0, 0] and
[0, 1, 0], q = [ln 3, 0, 0]): scores [ln 3, 0] -> p = [3/4, 1/4] -> out = [3/4, 1/4].
"""

import torch
import torch.nn.functional as F

from specdec.kernels.paged_attention_torch import (PagedPlan, SplitPlan, gather_keys, rows_of,
                                                   tokens_of)


def check_latent(q: torch.Tensor, cache: torch.Tensor, value_dim: int) -> None:
    """Raise ValueError unless q [N, H, D] and cache [S, 1, D] agree and 0 < value_dim <= D."""
    if q.dim() != 3 or cache.dim() != 3 or cache.shape[1] != 1 or q.shape[2] != cache.shape[2]:
        raise ValueError(f"mla_attention: q {tuple(q.shape)} must be [N, H, D] and the cache "
                         f"{tuple(cache.shape)} [S, 1, D]")
    if not 0 < value_dim <= q.shape[2]:
        raise ValueError(f"mla_attention: value_dim={value_dim} must be in [1, {q.shape[2]}]")


def mla_attention(q: torch.Tensor, cache: torch.Tensor, p: PagedPlan | SplitPlan, *,
                  value_dim: int, scale: float) -> torch.Tensor:
    """q [N, H, D], cache [S, 1, D] -> [N, H, value_dim] in q's dtype (module docstring)."""
    if isinstance(p, SplitPlan):  # each group in its own rows
        n = p.num_tokens
        return torch.cat([mla_attention(q[:n], cache, p.head, value_dim=value_dim, scale=scale),
                          mla_attention(q[n:], cache, p.tail, value_dim=value_dim, scale=scale)])
    check_latent(q, cache, value_dim)
    rows, t, length = p.key_mask.shape
    h = q.shape[1]
    keys = gather_keys(cache, p).transpose(1, 2)  # [R, 1, L, D]
    # every head and query row of a request against its one latent row set
    queries = rows_of(q, p).reshape(rows, 1, t * h, q.shape[2])
    mask = p.key_mask[:, None, :, None, :].expand(rows, 1, t, h, length)
    out = F.scaled_dot_product_attention(queries, keys, keys[..., :value_dim],
                                         attn_mask=mask.reshape(rows, 1, t * h, length),
                                         scale=scale)
    return tokens_of(out.view(rows, t, h, value_dim), p)
