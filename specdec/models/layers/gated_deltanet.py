"""Gated DeltaNet linear attention (Qwen3.5 / Qwen3-Next ``linear_attn``), in torch.

Per token (one request; heads independent; float32):

    qkv  = silu(causal depthwise conv1d(in_proj_qkv(x)))        kernel ``conv_kernel``
    q, k = l2norm(q), l2norm(k) (per head; q, k heads repeated to the Hv value heads);
    q   *= Dk ** -0.5
    beta = sigmoid(in_proj_b(x));  g = -exp(A_log) * softplus(in_proj_a(x) + dt_bias)
    S    = S * exp(g);  S += k (x) beta * (v - k^T S);  o = q^T S        S: [Hv, Dk, Dv]
    out  = out_proj(w * rmsnorm(o) * silu(in_proj_z(x)))

With the paged cache (``kv`` given) the flat tokens are gathered into [requests,
max_query_len] through the ``StateLayout`` of ``specdec.linear_state``: each request starts
from its current state slot (zeros at position 0). Its first S = 1 + K tokens run token by
token (``gated_delta_scan``, vectorised over the requests), each state going to the slot the
layout names (speculative decoding's rollback: a decode step is only these); the rest of a
prefill chunk runs in chunks of ``CHUNK`` tokens (``gated_delta_chunked``) and its final state
goes to the request's last slot. Padding positions get beta = 0 and g = 0, so they leave the
state as it is. Without ``kv`` the batch [B, T] starts from zeros and runs in chunks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdec.linear_state import LinearStateSpec
from specdec.models.layers.linear import MergedLinear, save_merged_as_parts
from specdec.models.layers.norm import GatedRMSNorm


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim. Example: [3, 4] -> [0.6, 0.8]."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


CHUNK = 64  # tokens per chunk of the chunked form


def gated_delta_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, on_state=None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over T tokens of B sequences, token by token, float32.

    q, k [B, T, H, Dk] (normalised, q scaled), v [B, T, H, Dv], g, beta [B, T, H], state
    [B, H, Dk, Dv] (the state before token 0; not modified). ``on_state(j, S)`` sees the
    state after token j. -> (o [B, T, H, Dv], the state after the last token).

    Example (B = T = H = Dk = Dv = 1): state 0, k = q = 1, v = 2, beta = 0.5, g = 0 ->
    S = 0.5 * (2 - 0) = 1, o = 1.
    """
    outs = []
    for j in range(q.shape[1]):
        state = state * g[:, j].exp()[..., None, None]
        k_j = k[:, j]
        predicted = (state * k_j[..., None]).sum(-2)  # k^T S: [B, H, Dv]
        delta = (v[:, j] - predicted) * beta[:, j][..., None]
        state = state + k_j[..., None] * delta[..., None, :]
        outs.append((state * q[:, j][..., None]).sum(-2))
        if on_state is not None:
            on_state(j, state)
    return torch.stack(outs, 1), state


def gated_delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK,
                        at: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """``gated_delta_scan`` (same arguments, no per-token states) a chunk of C tokens at a
    time. Within a chunk, with c_i the cumulative sum of g up to token i, S0 the state before
    it, and the rows of K, Q, V its tokens' vectors, the per-token updates
    u_i = beta_i (v_i - k_i . S before token i) solve the unit lower-triangular system

        (I + A) U = beta V - beta e^c K S0,   A[i, j] = beta_i e^(c_i - c_j) k_i . k_j  (j < i)

    and then o = e^c Q S0 + (Q K^T * e^(c_i - c_j), j <= i) U, and the state after token i is
    e^(c_i) S0 + (e^(c_i - c_j) K, j <= i)^T U (after the chunk: i = C).
    -> (o [B, T, H, Dv], the state after the last token); ``at`` [B] int64 given: and the
    state after each sequence's token ``at[b]`` (``state`` where that is not in 0..T-1).
    """
    outs, state_at = [], state
    for lo in range(0, q.shape[1], chunk):
        qc, kc, vc = (x[:, lo:lo + chunk].transpose(1, 2) for x in (q, k, v))  # [B, H, C, D]
        gc, bc = (x[:, lo:lo + chunk].transpose(1, 2) for x in (g, beta))  # [B, H, C]
        c = gc.cumsum(-1)
        n = c.shape[-1]
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (c[..., :, None] - c[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        a = bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay  # its strict lower part
        rhs = torch.cat([bc[..., None] * vc, (bc * c.exp())[..., None] * kc], -1)
        solved = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
        u = solved[..., :vc.shape[-1]] - solved[..., vc.shape[-1]:] @ state
        outs.append((c.exp()[..., None] * qc @ state
                     + (qc @ kc.transpose(-1, -2) * decay) @ u).transpose(1, 2))
        if at is not None:  # the state after token at[b], for the sequences it falls in
            i = (at - lo).clamp(0, n - 1)[:, None, None]  # [B, 1, 1]
            c_i = c.gather(-1, i.expand(-1, c.shape[1], 1))  # [B, H, 1]
            w = (c_i - c).masked_fill(torch.arange(n, device=q.device) > i, float("-inf"))
            here = c_i.exp()[..., None] * state + (w.exp()[..., None] * kc).transpose(-1, -2) @ u
            inside = ((at >= lo) & (at < lo + n))[:, None, None, None]
            state_at = torch.where(inside, here, state_at)
        last = c[..., -1:]
        state = last.exp()[..., None] * state + \
            ((last - c).exp()[..., None] * kc).transpose(-1, -2) @ u
    return (torch.cat(outs, 1), state) + (() if at is None else (state_at,))


class GatedDeltaNet(nn.Module):
    """HF names: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (Qwen3.5) or,
    ``fused``, ``in_proj_qkvz`` and ``in_proj_ba`` (Qwen3-Next: per key head g the rows
    ``[q_g (Dk), k_g (Dk), v (r Dv), z (r Dv)]`` and ``[b (r), a (r)]`` of its r = Hv / Hk value
    heads); one merged matmul here either way. ``conv1d.weight [C, 1, kernel]`` (channels
    [q | k | v]), ``dt_bias``, ``A_log`` [Hv], ``norm.weight`` [Dv], ``out_proj``.
    ``layer_idx``: the cache layer holding its state."""

    def __init__(self, layer_idx: int, hidden_size: int, num_k_heads: int, num_v_heads: int,
                 key_dim: int, value_dim: int, conv_kernel: int, eps: float,
                 fused: bool = False):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads}: must be a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        self.layer_idx = layer_idx
        self.hk, self.hv, self.dk, self.dv = num_k_heads, num_v_heads, key_dim, value_dim
        self.conv_kernel = conv_kernel
        self.conv_dim = 2 * num_k_heads * key_dim + num_v_heads * value_dim
        self.fused = fused
        parts = ({"in_proj_qkvz": self.conv_dim + num_v_heads * value_dim,
                  "in_proj_ba": 2 * num_v_heads} if fused else
                 {"in_proj_qkv": self.conv_dim, "in_proj_z": num_v_heads * value_dim,
                  "in_proj_b": num_v_heads, "in_proj_a": num_v_heads})
        self.in_proj = MergedLinear(hidden_size, parts, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel,
                                groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(value_dim, eps)
        self.out_proj = nn.Linear(num_v_heads * value_dim, hidden_size, bias=False)
        save_merged_as_parts(self)

    def kv_cache_spec(self) -> LinearStateSpec:
        return LinearStateSpec(self.conv_dim, self.conv_kernel, self.hv, self.dk, self.dv)

    def forward(self, x: torch.Tensor, kv=None) -> torch.Tensor:
        """x [B, T, H] (kv=None: each row a sequence from position 0) or [N, H] (kv given)
        -> same shape."""
        hv, dv = self.hv, self.dv
        qkv, z, b, a = self._projections(self.in_proj(x))
        if kv is None:
            o = self._mix(qkv, b, a, None, None)
        else:
            state, lay = kv.linear_state(self.layer_idx, x.shape[0])
            bt = lay.token_index
            o = self._mix(qkv[bt], b[bt], a[bt], state, lay)
            o = o.flatten(0, 1)[lay.flat_to_bt]
        o = self.norm(o.to(x.dtype), z.reshape(*z.shape[:-1], hv, dv))
        return self.out_proj(o.flatten(-2))

    def _projections(self, proj: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """in_proj's output [..., P] -> qkv [..., C] (channels [q | k | v]), z [..., Hv Dv],
        b, a [..., Hv], from either checkpoint layout."""
        hk, hv, dk, dv = self.hk, self.hv, self.dk, self.dv
        if not self.fused:
            return proj.split([self.conv_dim, hv * dv, hv, hv], dim=-1)
        lead, r = proj.shape[:-1], hv // hk
        qkvz, ba = proj.split([self.conv_dim + hv * dv, 2 * hv], dim=-1)
        q, k, v, z = qkvz.reshape(*lead, hk, 2 * dk + 2 * r * dv).split(
            [dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.reshape(*lead, hk, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([t.reshape(*lead, -1) for t in (q, k, v)], dim=-1)
        return qkv, z.reshape(*lead, hv * dv), b.reshape(*lead, hv), a.reshape(*lead, hv)

    def _mix(self, qkv, b, a, cache, lay) -> torch.Tensor:
        """qkv [B, T, C], b/a [B, T, Hv] -> o [B, T, Hv, Dv] float32; with a layout, reads
        and writes ``cache`` (the layer's ``LayerState``: its slots, and the staged states
        when the layout stages), else starts from zeros."""
        bsz, _, c = qkv.shape
        km1 = self.conv_kernel - 1
        if lay is None:
            conv_in = qkv.new_zeros(bsz, km1, c)
            state = qkv.new_zeros(bsz, self.hv, self.dk, self.dv, dtype=torch.float32)
        else:
            keep = ~lay.fresh
            conv_in = (cache.conv[lay.read] * keep[:, None, None]).to(qkv.dtype)
            state = cache.ssm[lay.read] * keep[:, None, None, None]
        seq = torch.cat([conv_in, qkv], 1)  # [B, km1 + T, C]
        if lay is not None:  # the window after token j: inputs j+1 .. j+km1 of seq
            windows = seq.unfold(1, km1, 1)[:, 1:].transpose(-1, -2)  # [B, T, km1, C]
            cache.conv.index_copy_(0, lay.write.flatten(), windows.reshape(-1, km1, c).float())
            if lay.stage_index is not None:
                rows = torch.arange(bsz, device=qkv.device)
                cache.stage_conv.index_copy_(
                    0, lay.stage_row, windows[rows, lay.stage_index.clamp(min=0)].float())
        mixed = F.silu(F.conv1d(seq.transpose(1, 2), self.conv1d.weight, groups=c))
        mixed = mixed.transpose(1, 2).float()  # [B, T, C]
        hk, dk = self.hk, self.dk
        q, k, v = mixed.split([hk * dk, hk * dk, self.hv * self.dv], -1)
        lead = mixed.shape[:-1]
        q, k = l2norm(q.reshape(*lead, hk, dk)), l2norm(k.reshape(*lead, hk, dk))
        if self.hv != hk:
            q = q.repeat_interleave(self.hv // hk, dim=2)
            k = k.repeat_interleave(self.hv // hk, dim=2)
        q = q * dk ** -0.5
        v = v.reshape(*lead, self.hv, self.dv)
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if lay is None:
            return gated_delta_chunked(q, k, v, g, beta, state)[0]
        valid = lay.valid[..., None]  # padding positions keep the state as it is
        beta, g = beta * valid, g * valid
        s = lay.num_slots  # the tokens whose states may fill a slot: one by one
        stage, staged = lay.stage_index, state

        def on_state(j, st):
            nonlocal staged
            cache.ssm.index_copy_(0, lay.write[:, j], st)
            if stage is not None:
                staged = torch.where((stage == j)[:, None, None, None], st, staged)

        head = (q[:, :s], k[:, :s], v[:, :s], g[:, :s], beta[:, :s])
        o, state = gated_delta_scan(*head, state, on_state)
        if q.shape[1] > s:
            rest, state, *at = gated_delta_chunked(
                q[:, s:], k[:, s:], v[:, s:], g[:, s:], beta[:, s:], state,
                at=None if stage is None else stage - s)
            cache.ssm.index_copy_(0, lay.last_write, state)
            if at:
                staged = torch.where((stage >= s)[:, None, None, None], at[0], staged)
            o = torch.cat([o, rest], 1)
        if stage is not None:
            cache.stage_ssm.index_copy_(0, lay.stage_row, staged)
        return o
