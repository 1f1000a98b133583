"""Data-parallel coordination: one packed int32 all-reduce of one fixed shape per step.

The step planner (:mod:`specdec.padding`) is the only caller of :func:`sync_step_across_dp`,
once per engine step, before the target runs; the drafter reuses that plan and issues no
sync of its own. So one tensor shape on the DP group per step (upstream's gloo ``8 vs 4``
crash cannot be built) and one all-reduce per rank per step.

The packed tensor is ``[4, dp_size]`` int32: row 0 holds each rank's padded token count in its
own column, row 1 its padded request count, row 2 its capture level (``CAPTURE_UNIFORM`` = 2:
a uniform decode within a capture bucket, or idle; ``CAPTURE_MIXED`` = 1: token and request
counts both capture buckets; 0: eager), row 3 its K for the step (a K schedule's pick for its
batch size; an idle rank sends the largest K). After a SUM all-reduce: ``max(row 0)`` and
``max(row 1)`` are what every rank runs, ``min(row 2)`` is the level every rank can replay,
``min(row 3)`` the K every rank runs (a rank that scheduled more cuts its drafts to it).

Worked example (dp_size=2, K=3): rank 0 sends ``[[8, 0], [2, 0], [2, 0], [3, 0]]``, rank 1
(idle) ``[[0, 0], [0, 0], [0, 2], [0, 3]]``; both get ``[[8, 0], [2, 0], [2, 2], [3, 3]]`` ->
8 tokens, 2 requests, a uniform decode every rank can replay, K = 3.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from specdec.syncs import host_side


CAPTURE_MIXED, CAPTURE_UNIFORM = 1, 2  # capture levels (0: eager)


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
    num_reqs: int  # max padded request count over ranks
    capture: int  # the lowest capture level over ranks (0 eager, CAPTURE_MIXED, CAPTURE_UNIFORM)
    num_tokens_across_dp: tuple[int, ...]  # [dp_size] each rank's own padded token count
    num_spec_tokens: int = 0  # the smallest K over ranks: every rank's K this step


def packed_metadata(ctx: DPContext, num_tokens: int, num_reqs: int,
                    capture: int, num_spec_tokens: int = 0) -> torch.Tensor:
    """The one tensor shape ever all-reduced on the DP group: [4, dp_size] int32."""
    packed = torch.zeros(4, ctx.size, dtype=torch.int32)
    packed[0, ctx.rank] = num_tokens
    packed[1, ctx.rank] = num_reqs
    packed[2, ctx.rank] = capture
    packed[3, ctx.rank] = num_spec_tokens
    return packed


def sync_step_across_dp(ctx: DPContext, num_tokens: int, num_reqs: int,
                        capture: int, num_spec_tokens: int = 0) -> DPSyncResult:
    """Agree on one padded step size, mode and K across DP ranks (no collective at DP=1)."""
    if num_tokens < 0 or num_reqs < 0:
        raise ValueError(f"num_tokens={num_tokens}, num_reqs={num_reqs}: must be >= 0")
    if ctx.size == 1:
        return DPSyncResult(num_tokens, num_reqs, capture, (num_tokens,), num_spec_tokens)
    with host_side():  # gloo's buffers live in host memory: reading them is not a device sync
        packed = packed_metadata(ctx, num_tokens, num_reqs, capture, num_spec_tokens)
        ctx.record("all_reduce", packed.shape)
        dist.all_reduce(packed, group=ctx.group)
        return DPSyncResult(int(packed[0].max()), int(packed[1].max()),
                            int(packed[2].min()), tuple(packed[0].tolist()),
                            int(packed[3].min()))
