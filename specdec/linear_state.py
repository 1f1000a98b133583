"""Recurrent state of linear-attention layers (gated DeltaNet), kept per request in slots that
speculative decoding can roll back without a copy.

Each request row owns ``S = 1 + K`` slots per layer (plus one trash row for padding
requests). A step that feeds request r ``n`` tokens of which the last ``d`` are drafts writes
the state after its token ``j`` into slot ``j - (n - 1 - d)`` when that is >= 0: a decode
(``n = 1 + d``) fills slots 0..d, a prefill chunk (``d = 0``) only slot 0 with its final
state; every other token writes to the trash row. After verification the row's *current*
slot becomes ``valid_count - 1`` (0 for a discarded prefill chunk) -- the state after the last
accepted token -- computed on the device from the sampled ids, so no host sync. The next step
reads that slot; a request whose step starts at position 0 starts from zeros instead.

Example (K = 2): step 1 verifies [t, d1, d2] and writes slots 0, 1, 2; d1 is accepted and d2
rejected -> sampled [d1, x, -1], valid 2 -> current slot 1 (state after t, d1); step 2 reads
slot 1 and overwrites slots 0..2.

Prefix caching (``snapshots`` > 0): a cached block is usable only with the state after its
last token. Each step also *stages* each request's state after the last block boundary its
tokens cross (position ``seq_len // block_size * block_size - 1``, when this step computes it)
in the row's staging slot; the scheduler then ``save``s it into a snapshot for that block's
entry once the position is known to be accepted, before the row runs again, and a hit
``restore``s a snapshot into the request's row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec import kernels


@dataclass(frozen=True)
class LinearStateSpec:
    """What one gated-DeltaNet layer keeps per request slot (float32): the last
    ``conv_kernel - 1`` inputs of its causal conv (``conv_dim`` channels) and the recurrent
    state ``[num_heads, key_dim, value_dim]``. Nothing per token (``bytes_per_token`` 0).

    E.g. transformers' default Qwen3.5 text config (16 key / 32 value heads of 128, kernel 4):
    conv_dim 8192 -> (3 * 8192 + 32 * 128 * 128) * 4 = 2.2 MB per slot per layer."""

    conv_dim: int
    conv_kernel: int
    num_heads: int
    key_dim: int
    value_dim: int

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return 0

    def bytes_per_slot(self) -> int:
        values = (self.conv_kernel - 1) * self.conv_dim + \
            self.num_heads * self.key_dim * self.value_dim
        return 4 * values


def has_linear_attention(model) -> bool:
    """Whether a layer of ``model`` keeps a recurrent state (Qwen3.5's gated DeltaNet)."""
    return any(isinstance(spec, LinearStateSpec) for spec in model.kv_cache_spec())


class LayerState(NamedTuple):
    """One linear layer's tensors in a ``StateCache``: conv [R * S, kernel - 1, C] and ssm
    [R * S, Hv, Dk, Dv] slots, and with snapshots the staged states stage_conv / stage_ssm
    [R, ...] (else None)."""

    conv: torch.Tensor
    ssm: torch.Tensor
    stage_conv: torch.Tensor | None
    stage_ssm: torch.Tensor | None


class StateLayout(NamedTuple):
    """One forward's map between the flat tokens and per-request rows, shared by every linear
    layer: token_index [B, T] int64 (flat token of request r's j-th token; clamped),
    flat_to_bt [N] int64 (index into B * T of each flat token), read [B] int64 (flat slot the
    request starts from), fresh [B] bool (starts at position 0: zero state), write [B, T]
    int64 (flat slot the state after token j goes to; the trash slot when none), valid [B, T]
    bool (j is one of the request's tokens), last_write [B] int64 (write at its last token),
    num_slots (S, host int: a request writes per-token states for at most its first S
    tokens); with snapshots, stage_index [B] int64 (j whose state is staged, -1: none) and
    stage_row [B] int64 (the staging row it goes to: the trash row when none), else None."""

    token_index: torch.Tensor
    flat_to_bt: torch.Tensor
    read: torch.Tensor
    fresh: torch.Tensor
    write: torch.Tensor
    valid: torch.Tensor
    last_write: torch.Tensor
    num_slots: int
    stage_index: torch.Tensor | None = None
    stage_row: torch.Tensor | None = None


class StateCache:
    """Per-layer state tensors for the ``LinearStateSpec`` layers of a model.

    ``conv[i]`` [rows * S, conv_kernel - 1, conv_dim] and ``ssm[i]`` [rows * S, Hv, Dk, Dv]
    float32 (flat slot = row * S + slot); the last row is the trash row.
    ``current`` [rows] int64: each row's slot to start the next step from.
    With ``snapshots`` > 0 (prefix caching; ``block_size``: the KV cache's), per layer
    ``stage_conv[i]`` / ``stage_ssm[i]`` [rows, ...] (each row's staged state, the module
    docstring) and ``snap_conv[i]`` / ``snap_ssm[i]`` [snapshots, ...] (the block allocator
    says which snapshot holds which prefix)."""

    def __init__(self, specs: list, num_rows: int, num_slots: int, device,
                 snapshots: int = 0, block_size: int = 0):
        self.num_rows, self.num_slots = num_rows, num_slots
        self.snapshots, self.block_size = snapshots, block_size
        linear = [(i, s) for i, s in enumerate(specs) if isinstance(s, LinearStateSpec)]

        def zeros(size: int) -> tuple[dict, dict]:
            """Each linear layer's (conv, ssm) states of ``size`` slots."""
            return ({i: torch.zeros(size, s.conv_kernel - 1, s.conv_dim, device=device)
                     for i, s in linear},
                    {i: torch.zeros(size, s.num_heads, s.key_dim, s.value_dim, device=device)
                     for i, s in linear})
        self.conv, self.ssm = zeros(num_rows * num_slots)
        self.stage_conv, self.stage_ssm = zeros(num_rows) if snapshots else ({}, {})
        self.snap_conv, self.snap_ssm = zeros(snapshots) if snapshots else ({}, {})
        self.current = torch.zeros(num_rows, dtype=torch.int64, device=device)

    def layer(self, i: int) -> LayerState:
        return LayerState(self.conv[i], self.ssm[i], self.stage_conv.get(i),
                          self.stage_ssm.get(i))

    def save(self, row: int, snapshot: int) -> None:
        """Snapshot ``snapshot`` := row ``row``'s staged state (its last step's, read before
        the row runs again)."""
        for i in self.conv:
            self.snap_conv[i][snapshot].copy_(self.stage_conv[i][row])
            self.snap_ssm[i][snapshot].copy_(self.stage_ssm[i][row])

    def restore(self, snapshot: int, row: int) -> None:
        """Row ``row`` starts its next step from snapshot ``snapshot`` (copied to its slot 0,
        made current): a request whose prompt's prefix the cache held."""
        for i in self.conv:
            self.conv[i][row * self.num_slots].copy_(self.snap_conv[i][snapshot])
            self.ssm[i][row * self.num_slots].copy_(self.snap_ssm[i][snapshot])
        self.current[row] = 0

    @property
    def trash_row(self) -> int:
        return self.num_rows - 1

    def layout(self, meta, num_tokens: int) -> StateLayout:
        """The layout of one forward from its ``AttentionMetadata`` (device ops only):
        ``meta.rows`` [B] (None: every request on the trash row), ``meta.num_draft_tokens``
        [B] (None: no drafts) and ``meta.max_query_len`` (None: the token count).

        Example (rows 0, 1 + trash row 2, S = 3, current = [1, 0, 0]): request A on row 0
        verifies [t, d1, d2] (seq_len 10), request B on row 1 is a fresh 2-token prefill, a
        padding request holds 1 token: query_start_loc [0, 3, 5, 6], seq_lens [10, 2, 1],
        drafts [2, 0, 0], max_query_len 3 -> token_index [[0, 1, 2], [3, 4, 5], [5, 5, 5]],
        flat_to_bt [0, 1, 2, 3, 4, 6], read [1, 3, 6], fresh [F, T, T],
        write [[0, 1, 2], [6, 3, 6], [6, 6, 6]] (6 = the trash row's slot 0),
        valid [[T, T, T], [T, T, F], [T, F, F]], last_write [2, 3, 6]; with snapshots and
        block_size 4: A's tokens are positions 7..9, so the boundary 8 is crossed after its
        token 0: stage_index [0, -1, -1], stage_row [0, 2, 2].
        """
        qsl = meta.query_start_loc.long()
        b = qsl.shape[0] - 1
        device = qsl.device
        t = meta.max_query_len or num_tokens
        starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
        j = torch.arange(t, device=device)
        token_index = (starts[:, None] + j).clamp(max=num_tokens - 1)
        req = kernels.token_requests(meta.query_start_loc, num_tokens)
        local = (torch.arange(num_tokens, device=device) - starts[req]).clamp(0, t - 1)
        flat_to_bt = req * t + local
        rows = (torch.full((b,), self.trash_row, dtype=torch.int64, device=device)
                if meta.rows is None else meta.rows.long())
        drafts = (torch.zeros(b, dtype=torch.int64, device=device)
                  if meta.num_draft_tokens is None else meta.num_draft_tokens.long())
        read = rows * self.num_slots + self.current[rows]
        fresh = meta.seq_lens.long() == lens  # nothing computed before this step
        slot = j - (lens - 1 - drafts)[:, None]  # [B, T]
        valid = j < lens[:, None]
        keep = (slot >= 0) & valid & (slot < self.num_slots)
        trash = self.trash_row * self.num_slots
        write = torch.where(keep, rows[:, None] * self.num_slots + slot.clamp(min=0), trash)
        last_write = write.gather(1, (lens - 1).clamp(min=0)[:, None])[:, 0]
        stage_index = stage_row = None
        if self.snapshots:  # the state after the last block boundary the tokens cross
            end = meta.seq_lens.long()
            boundary = end // self.block_size * self.block_size
            stage_index = torch.where(boundary > end - lens, boundary - 1 - (end - lens), -1)
            stage_row = torch.where(stage_index >= 0, rows, self.trash_row)
        return StateLayout(token_index, flat_to_bt, read, fresh, write, valid, last_write,
                           self.num_slots, stage_index, stage_row)

    def accept(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        """After verification: row r's current slot = (valid entries of sampled[r]) - 1, at
        least 0 (a discarded prefill chunk's state is its slot 0). rows [B], sampled [B, K+1]
        int32 with -1 placeholders (valid entries form a prefix).

        Example: rows [0, 1, 2], sampled [[11, 12, -1], [21, -1, -1], [-1, -1, -1]] ->
        current[:3] = [1, 0, 0].
        """
        valid = (sampled >= 0).sum(1)
        self.current[rows.long()] = (valid - 1).clamp(min=0)
