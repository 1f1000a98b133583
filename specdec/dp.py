"""Data-parallel coordination: one packed int32 all-reduce of one fixed shape per call.

Every DP collective on the CPU group goes through :func:`sync_batch_across_dp`, so a second
tensor shape on the same group within a step (upstream's gloo ``8 vs 4`` crash) cannot be built.
The packed tensor is ``[2, dp_size]`` int32: row 0 holds each rank's token count in its own
column, row 1 each rank's graph flag (1 = can run a captured graph). After a SUM all-reduce:
``max(row 0)`` is the padded count every rank runs, ``min(row 1)`` the synced mode.

Worked example (dp_size=2): rank 0 sends ``[[6, 0], [1, 0]]``, rank 1 ``[[0, 0], [0, 1]]``
(an idle rank, graph mode); both get ``[[6, 0], [1, 1]]`` -> 6 tokens, graph mode on.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from specdec.syncs import host_side


@dataclass
class DPContext:
    """This rank's place in the DP group and a log of every collective it issued."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # gloo CPU group; None when size == 1
    collectives: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # (op, shape)

    def record(self, op: str, shape: torch.Size | tuple[int, ...]) -> None:
        self.collectives.append((op, tuple(shape)))


@dataclass(frozen=True, slots=True)
class DPSyncResult:
    num_tokens: int  # max padded token count over ranks: every rank runs this many
    num_tokens_across_dp: torch.Tensor  # [dp_size] int32, each rank's own count
    graph: bool  # True only if every rank can run a captured graph


def packed_metadata(ctx: DPContext, num_tokens: int, graph: bool) -> torch.Tensor:
    """The one tensor shape ever all-reduced on the DP group: [2, dp_size] int32."""
    packed = torch.zeros(2, ctx.size, dtype=torch.int32)
    packed[0, ctx.rank] = num_tokens
    packed[1, ctx.rank] = int(graph)
    return packed


def sync_batch_across_dp(ctx: DPContext, num_tokens: int, graph: bool, *,
                         is_draft_model: bool = False,
                         draft_has_cross_rank_layers: bool = True) -> DPSyncResult:
    """Agree on one padded size and mode across DP ranks.

    The target step and every drafter call use this function. ``is_draft_model=True`` skips
    the collective only when the draft model has no cross-rank layer; that property is a
    model property, identical on every rank, so all ranks skip alike.
    """
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    skip = ctx.size == 1 or (is_draft_model and not draft_has_cross_rank_layers)
    with host_side():  # gloo's buffers live in host memory: reading them is not a device sync
        packed = packed_metadata(ctx, num_tokens, graph)
        if not skip:
            ctx.record("all_reduce", packed.shape)
            dist.all_reduce(packed, group=ctx.group)
        counts = packed[0]
        if skip:
            return DPSyncResult(num_tokens, counts, graph)
        return DPSyncResult(int(counts.max()), counts, bool(packed[1].min() > 0))
