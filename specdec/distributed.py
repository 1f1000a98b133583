"""The process grid (DP x TP ranks) and the tensor-parallel collectives.

World rank ``w = dp_rank * tp_size + tp_rank``. TP group of DP replica d: ranks
``d*T .. d*T+T-1``; DP group of TP rank t: ranks ``t, T+t, .., (D-1)*T+t``. Every rank creates
every group, in the same order (``torch.distributed.new_group``'s rule). TP rank 0 of each
replica schedules, plans (the one DP all-reduce, on the DP group of TP rank 0) and broadcasts
the step's host buffers to its TP peers; MoE layers exchange tokens on the DP group of their
own TP rank.

Worked example (D=2, T=2): TP groups [0, 1] and [2, 3]; DP groups [0, 2] and [1, 3]; world
rank 3 is DP rank 1, TP rank 1.

Backends by device: gloo on CPU; ``cpu:gloo,cuda:nccl`` on CUDA and ``cpu:gloo,npu:hccl`` on
NPU (torch_npu imported only when an npu device is asked for), so host buffers (the DP
metadata, the step broadcast) stay on gloo and activations use the accelerator's library.
"""

import atexit
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from specdec import platform
from specdec.dp import DPContext

BACKENDS = {"cpu": "gloo", "cuda": "cpu:gloo,cuda:nccl", "npu": "cpu:gloo,npu:hccl"}
# torch >= 2.13 names; older torch has the *_tensor spellings
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def backend_for(device_type: str) -> str:
    """The process-group backend string for a device type; ValueError naming the allowed."""
    if device_type not in BACKENDS:
        raise ValueError(f"device={device_type!r} has no distributed backend; allowed: "
                         f"{sorted(BACKENDS)}")
    if device_type == "npu":
        platform.torch_device("npu")  # imports torch_npu, or names why it cannot
    return BACKENDS[device_type]


@dataclass
class TPContext:
    """This rank's place in its TP group, and the collectives of TP / SP layers.

    With ``sequence_parallel`` the residual stream holds this rank's N/T tokens: ``gather``
    all-gathers tokens before a column-parallel layer, ``reduce`` reduce-scatters after a
    row-parallel one (all-reduce without SP). Each call logs ``("tp_<op>", shape)`` through
    ``record`` (the DPContext's log, so one list holds every collective of a step)."""

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None  # None when size == 1
    sequence_parallel: bool = False
    record: Callable[[str, tuple[int, ...]], None] | None = None

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.size > 1

    def _log(self, op: str, t: torch.Tensor) -> None:
        if self.record is not None:
            self.record(f"tp_{op}", tuple(t.shape))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the TP ranks (in place on ``x``, returned)."""
        if self.size == 1:
            return x
        self._log("all_reduce", x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[M, ...] on each rank -> [T*M, ...], rank-major."""
        if self.size == 1:
            return x
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))
        self._log("all_gather", x)
        _all_gather(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """[N, ...] partial sums on each rank -> this rank's [N/T, ...] of their sum."""
        if self.size == 1:
            return x
        n = x.shape[0]
        if n % self.size:
            raise ValueError(f"token count {n} is not a multiple of tensor_parallel_size="
                             f"{self.size} (sequence parallelism splits tokens evenly)")
        out = x.new_empty((n // self.size, *x.shape[1:]))
        self._log("reduce_scatter", x)
        _reduce_scatter(out, x.contiguous(), group=self.group)
        return out

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[M, C] on each rank -> [M, T*C]: rank r's columns at r*C.. (vocab-parallel logits)."""
        if self.size == 1:
            return x
        m, c = x.shape
        return self.all_gather(x).view(self.size, m, c).transpose(0, 1).reshape(m, -1)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """After a row-parallel layer: reduce-scatter tokens (SP) or all-reduce [N, H]."""
        return self.reduce_scatter(x) if self.sp else self.all_reduce(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Before a column-parallel layer: all-gather the token shards (SP), else ``x``."""
        return self.all_gather(x) if self.sp else x

    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's N/T tokens of a replicated [N, ...] (SP), else ``x`` (no collective)."""
        if not self.sp:
            return x
        n = x.shape[0]
        if n % self.size:
            raise ValueError(f"token count {n} is not a multiple of tensor_parallel_size="
                             f"{self.size} (sequence parallelism splits tokens evenly)")
        per = n // self.size
        return x[self.rank * per:(self.rank + 1) * per]

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """TP rank 0's ``t`` onto every rank of the group (in place)."""
        if self.size > 1:
            self._log("broadcast", t)
            dist.broadcast(t, group=self.group, group_src=0)
        return t


@dataclass
class Grid:
    """This process's DP and TP contexts (their collectives share one log: ``dp.record``) and
    ``world``, a group of every rank for the grid's collectives over all of them."""

    dp: DPContext
    tp: TPContext
    world: dist.ProcessGroup | None = None
    owns_default: bool = False  # init_grid initialized the default group

    def close(self) -> None:
        """Destroy the grid's groups (the default one too if it owns it) and drop them, so
        each gloo group joins its worker threads now (init_grid runs this at exit).

        A gloo worker frees its last collective's tensors after the caller has returned,
        taking the GIL; if that happens during interpreter shutdown, the thread is killed
        inside a destructor and the process aborts ("terminate called without an active
        exception"). The default group cannot be joined so (torch.distributed.nn.functional,
        imported lazily with torch._dynamo, keeps it as a default argument), hence ``world``."""
        groups = [g for g in (self.tp.group, self.dp.group, self.world) if g is not None]
        self.tp.group = self.dp.group = self.world = None
        if not dist.is_initialized():
            return
        if self.owns_default:
            dist.destroy_process_group()  # every group
        else:
            for g in groups:
                dist.destroy_process_group(g)


def init_grid(dp_size: int, tp_size: int, rank: int, *, device_type: str = "cpu",
              init_method: str | None = None, timeout: float = 600.0,
              sequence_parallel: bool = False) -> Grid:
    """Join (or reuse) the world process group of ``dp_size * tp_size`` ranks and create the
    TP, DP and ``world`` groups; -> this rank's Grid, closed at exit (``Grid.close``).
    ``init_method`` None: ``env://`` (torchrun)."""
    world = dp_size * tp_size
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank}: allowed 0..{world - 1} (data_parallel_size="
                         f"{dp_size} x tensor_parallel_size={tp_size})")
    owns_default = not dist.is_initialized()
    if owns_default:
        dist.init_process_group(backend_for(device_type), init_method=init_method or "env://",
                                rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    if dist.get_world_size() != world:
        raise ValueError(f"world size {dist.get_world_size()} != data_parallel_size={dp_size} x "
                         f"tensor_parallel_size={tp_size}")
    dp_rank, tp_rank = divmod(rank, tp_size)
    limit = timedelta(seconds=timeout)  # (a new group's own default is 30 minutes)
    tp_groups = [dist.new_group(list(range(d * tp_size, (d + 1) * tp_size)), timeout=limit)
                 for d in range(dp_size)] if tp_size > 1 else [None] * dp_size
    dp_groups = [dist.new_group([d * tp_size + t for d in range(dp_size)], timeout=limit)
                 for t in range(tp_size)] if dp_size > 1 else [None] * tp_size
    world_group = dist.new_group(list(range(world)), timeout=limit)
    dp = DPContext(dp_rank, dp_size, dp_groups[tp_rank])
    tp = TPContext(tp_rank, tp_size, tp_groups[dp_rank], sequence_parallel, dp.record)
    grid = Grid(dp, tp, world_group, owns_default)
    atexit.register(grid.close)
    return grid


def env_rank() -> tuple[int, int, int] | None:
    """(RANK, WORLD_SIZE, LOCAL_RANK) as torchrun sets them; None when not launched so."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
