"""``kv`` objects for the model attention contract, used by training and the offline estimate.

Both hold a batch of B equal-length rows; tokens arrive flat as ``[N] = [B * n]`` (row-major).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _rows(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B * n, H, D] -> [B, H, n, D]."""
    return x.view(batch, -1, *x.shape[1:]).transpose(1, 2)


def _attend(q, k, v, mask):
    """q [B, Hq, n, D], k/v [B, Hkv, L, D], mask [n, L] bool -> flat [B * n, Hq, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(-1, q.shape[1], q.shape[3])


class CacheKV:
    """Growing dense cache for batched generation: each call appends ``n`` tokens per row at the
    next positions and attends causally to everything cached so far."""

    def __init__(self, batch: int):
        self.batch = batch
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer_idx, q, k, v):
        b = self.batch
        q, k, v = _rows(q, b), _rows(k, b), _rows(v, b)
        if layer_idx in self.k:
            k = torch.cat((self.k[layer_idx], k), dim=2)
            v = torch.cat((self.v[layer_idx], v), dim=2)
        self.k[layer_idx], self.v[layer_idx] = k, v
        n, total = q.shape[2], k.shape[2]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(total - n)
        return _attend(q, k, v, mask)


class UnrolledKV:
    """Draft-chain attention for all T slots of B rows at once (EAGLE-3 "training-time test").

    Call s (s = 1, 2, ...) is draft step s for every slot i. Its query at slot i sees the step-1
    keys of slots j <= i (the draft cache the engine would hold, written from the target's
    hidden states) plus the keys of steps 2..s at slot i itself (the chain's own entries).
    Example, T = 2, step 2: mask = [[1, 0, 1, 0], [1, 1, 0, 1]] over [step-1 keys | step-2 keys].
    """

    def __init__(self, batch: int, seqlen: int):
        self.batch, self.seqlen = batch, seqlen
        self.k: dict[int, list[torch.Tensor]] = {}
        self.v: dict[int, list[torch.Tensor]] = {}

    def attend(self, layer_idx, q, k, v):
        t = self.seqlen
        q, k, v = (_rows(x, self.batch) for x in (q, k, v))
        ks, vs = self.k.setdefault(layer_idx, []), self.v.setdefault(layer_idx, [])
        ks.append(k)
        vs.append(v)
        eye = torch.eye(t, dtype=torch.bool, device=q.device)
        mask = torch.cat([torch.ones_like(eye).tril()] + [eye] * (len(ks) - 1), dim=1)
        return _attend(q, torch.cat(ks, dim=2), torch.cat(vs, dim=2), mask)
