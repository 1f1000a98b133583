"""Data- and tensor-parallel engine: N x T rank processes, one ``LLM`` each, one process group.

``run_data_parallel(jobs, N, engine=LLM, tp_size=T)`` starts N*T processes (``rank_context``)
that join a process group through a file store and build the DP x TP grid
(``specdec.distributed``: gloo on CPU; ``cpu:gloo,cuda:nccl`` / ``cpu:gloo,npu:hccl`` on an
accelerator, so the packed DP metadata and the step broadcast stay on a CPU group). For each
job, every rank builds ``engine(**job.llm_kwargs, dp=..., tp=...)`` (``engine``: the class
handed in, ``specdec.LLM``; this module imports no engine) from the same arguments (same
seed); TP rank 0 of each
DP replica takes the replica's share of the prompts (round-robin by index unless
``job.assignment`` says otherwise) and calls ``step()`` until it returns None -- every DP rank
idle -- while its TP peers ``serve()`` its steps. A DP rank with nothing scheduled while others
work runs ``dummy_run`` inside ``step()``, so all ranks issue the same collectives.

Results (outputs, StepRecords, the (op, shape) collectives of each step) come back through a
multiprocessing queue, never through the DP group. A rank that raises (a ValueError or
TypeError keeps its type, anything else becomes a RuntimeError with the rank's traceback),
dies (the error names it and its signal), or a run that exceeds ``timeout`` seconds
(``LLM(data_parallel_timeout=...)``) fails the call (the other ranks are killed) instead of
hanging. A rank whose parent process dies exits.

Ranks start with the ``forkserver`` method (``spawn`` where there is none): each imports the
launching script again, so a script calling this (or ``LLM(data_parallel_size=N).generate``)
needs the usual ``if __name__ == "__main__":`` guard.

Worked example: 5 prompts, N=2, no assignment -> rank 0 runs prompts [0, 2, 4], rank 1 [1, 3];
``run.outputs`` lists the 5 outputs in prompt order. Request ids are the prompt indices, so
per-request files (extract_hidden_states) do not collide across ranks.

``LLM`` asks here which process it is (``parallel_role``: one rank's engine, a torchrun rank,
or the launcher of the ranks) and, for the last two, ``generate_across_ranks`` runs its
``generate``; ``LLM.__init__`` itself only ever builds one rank's engine.
"""

import os
import queue
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.multiprocessing as mp

import torch.distributed as dist

from specdec.distributed import Grid, TPContext, backend_for, env_rank, init_grid
from specdec.dp import DPContext
from specdec.engine.config import EngineConfig
from specdec.engine.outputs import RequestOutput, StepRecord
from specdec.engine.sequence import SamplingParams

DEATH_GRACE_S = 3.0  # how long a rank's failure waits for a peer's death to show


@dataclass
class DPJob:
    llm_kwargs: dict  # LLM(...) arguments, without dp / data_parallel_size
    prompts: list  # str or list[int] each
    params: SamplingParams | list[SamplingParams]  # every prompt's, or one per prompt
    assignment: list[list[int]] | None = None  # rank -> prompt indices; None = round-robin
    request_ids: list[str] | None = None  # one per prompt; None: the prompt index


@dataclass
class RankResult:
    rank: int  # world rank: dp_rank * tp_size + tp_rank
    outputs: dict[int, RequestOutput]  # prompt index -> output (TP peers: none)
    steps: list[StepRecord]  # every step that ran (the final None step excluded; peers: none)
    collectives: list[list[tuple[str, tuple[int, ...]]]]  # per step, incl. the final one


@dataclass
class DPRun:
    outputs: list[RequestOutput]  # in prompt order
    ranks: list[RankResult] = field(default_factory=list)  # TP rank 0 of each DP rank, by DP rank
    tp_peers: list[RankResult] = field(default_factory=list)  # TP ranks > 0, by world rank


@dataclass
class ParallelRole:
    """Which process an ``LLM`` is: one rank's engine (``dp``/``tp`` given, from a torchrun
    grid, or single), or the launcher of the rank processes (builds no engine)."""

    launcher: bool  # generate() spawns data_parallel_size x tensor_parallel_size ranks
    dp: DPContext | None  # None: a single rank (or the launcher)
    tp: TPContext
    grid: Grid | None = None  # a torchrun rank's groups (closed at exit)

    @property
    def torchrun(self) -> bool:
        return self.grid is not None


def parallel_role(cfg: EngineConfig, dp: DPContext | None, tp: TPContext | None
                  ) -> ParallelRole:
    """Check the parallel arguments of ``LLM`` and say which process this is. Under torchrun
    (RANK / WORLD_SIZE = data x tensor parallel ranks) join the grid, and on an accelerator
    take the local rank's device (``cfg.device`` updated)."""
    dp_size, tp_size = cfg.data_parallel_size, cfg.tensor_parallel_size
    if dp_size > 1 and dp is not None:
        raise ValueError("pass dp=DPContext (this process is one rank) or "
                         "data_parallel_size > 1 (launch the ranks), not both")
    if dp is not None and not isinstance(dp, DPContext):
        raise TypeError(f"dp={dp!r}: must be a DPContext or None")
    if tp is not None and (not isinstance(tp, TPContext) or tp.size != tp_size):
        raise ValueError(f"tp={tp!r}: must be a TPContext of size tensor_parallel_size="
                         f"{tp_size} or None")
    env = env_rank()
    if dp is None and tp is None and dp_size * tp_size > 1 and env is not None \
            and env[1] == dp_size * tp_size:
        grid = init_grid(dp_size, tp_size, env[0], device_type=cfg.device.type,
                         timeout=cfg.data_parallel_timeout,
                         sequence_parallel=cfg.sequence_parallel)
        if cfg.device.type != "cpu":  # one accelerator per local rank
            count = getattr(torch, cfg.device.type).device_count()
            cfg.device = torch.device(cfg.device.type, env[2] % count)
        return ParallelRole(False, grid.dp, grid.tp, grid)
    launcher = dp is None and tp is None and (dp_size > 1 or tp_size > 1)
    return ParallelRole(launcher, dp, tp or TPContext())


def generate_across_ranks(llm, ids: list[list[int]], per_prompt: list[SamplingParams],
                          request_ids: list[str]) -> list[RequestOutput]:
    """``llm.generate`` of a launcher or a torchrun rank: the outputs of every prompt (checked
    token ids; ``request_ids``: the ones a single rank would give them), in prompt order."""
    if llm.role.torchrun:
        return _generate_on_torchrun_ranks(llm, ids, per_prompt, request_ids)
    run, = run_data_parallel([DPJob(llm.init_kwargs, ids, per_prompt, None, request_ids)],
                             llm.config.data_parallel_size, engine=type(llm),
                             timeout=llm.config.data_parallel_timeout,
                             tp_size=llm.config.tensor_parallel_size)
    return run.outputs


def _generate_on_torchrun_ranks(llm, ids: list[list[int]], per_prompt: list[SamplingParams],
                                request_ids: list[str]) -> list[RequestOutput]:
    """Under torchrun: DP rank d runs prompts d, d+D, ... (TP rank 0 steps, its peers serve);
    every rank returns every output, in prompt order (one all_gather_object)."""
    grid, mine = llm.role.grid, {}
    if grid.tp.rank == 0:
        reqs = {i: llm.add_request(ids[i], per_prompt[i], request_ids[i])
                for i in range(grid.dp.rank, len(ids), grid.dp.size)}
        while llm.step() is not None:
            pass
        mine = {i: RequestOutput.of(r, llm.tokenizer) for i, r in reqs.items()}
    else:
        llm.serve()
    everyone = [None] * grid.world.size()
    dist.all_gather_object(everyone, mine, group=grid.world)
    merged = {i: out for part in everyone for i, out in part.items()}
    return [merged[i] for i in range(len(ids))]


def round_robin(num_prompts: int, dp_size: int) -> list[list[int]]:
    """Prompt i goes to rank i % dp_size: ``round_robin(5, 2) == [[0, 2, 4], [1, 3]]``."""
    return [list(range(r, num_prompts, dp_size)) for r in range(dp_size)]


def check_assignment(assignment: list[list[int]], num_prompts: int, dp_size: int) -> None:
    if len(assignment) != dp_size or sorted(i for a in assignment for i in a) != list(
            range(num_prompts)):
        raise ValueError(f"assignment={assignment}: need {dp_size} lists (one per rank) that "
                         f"together hold each prompt index 0..{num_prompts - 1} once")


def rank_context(device_types: set[str]):
    """How ranks start: on CPU, forkserver where the platform has it -- each rank forks from
    one server process per launcher that imported the engine once (and ``torch._dynamo``,
    which a rank building a sharded model on the meta device imports: ~2.6 s of CPU a rank
    otherwise), so a data- or tensor-parallel ``generate`` starts its ranks in ~0.3 s instead
    of ~3 s of imports (2 ranks, this CPU) -- else spawn (accelerator ranks too, until forked
    ranks have run on one). Both run the launcher's script afresh in a rank (its ``__main__`` guard)."""
    if device_types != {"cpu"} or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["specdec.engine.llm", "torch._dynamo"])
    return ctx


MAIN_GUARD_STATUS = 86  # a rank process ran, while importing it, the script that launches ranks


def exit_if_a_rank_reran_the_script() -> None:
    """A rank imports the user's script again while it starts; one without a ``__main__``
    guard builds a launcher there (``LLM.__init__``) or runs one (``run_data_parallel``) and
    could only fail: exit at once, and the launcher says what to add (``_raise_if_dead``)."""
    if getattr(mp.current_process(), "_inheriting", False):
        os._exit(MAIN_GUARD_STATUS)


def run_data_parallel(jobs: list[DPJob], dp_size: int, *, engine: type,
                      timeout: float = 600.0, tp_size: int = 1) -> list[DPRun]:
    """Run each job on ``dp_size`` x ``tp_size`` ranks (one start for all jobs), each rank's
    engine an ``engine`` (``specdec.LLM``); one DPRun per job."""
    exit_if_a_rank_reran_the_script()
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size={tp_size!r}: must be an int >= 1")
    if not isinstance(dp_size, int) or dp_size < (2 if tp_size == 1 else 1):
        raise ValueError(f"data_parallel_size={dp_size!r}: the DP engine needs an int >= 2 "
                         "(>= 1 with tensor_parallel_size > 1)")
    for job in jobs:
        backend_for(torch.device(job.llm_kwargs.get("device", "cpu")).type)
        if job.llm_kwargs.get("tensor_parallel_size", 1) != tp_size:
            raise ValueError(f"tensor_parallel_size={job.llm_kwargs.get('tensor_parallel_size')}"
                             f" in a job of a tp_size={tp_size} launch")
    jobs = [replace(job, assignment=round_robin(len(job.prompts), dp_size))
            if job.assignment is None else job for job in jobs]
    for job in jobs:
        check_assignment(job.assignment, len(job.prompts), dp_size)
    ctx = rank_context({torch.device(job.llm_kwargs.get("device", "cpu")).type
                        for job in jobs})
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="specdec-dp-") as tmp:
        store = str(Path(tmp) / "store")
        world = dp_size * tp_size
        procs = [ctx.Process(target=_rank_main, daemon=True, name=f"specdec-rank-{rank}",
                             args=(rank, dp_size, tp_size, store, engine, jobs, timeout,
                                   results, os.getpid(), dict(os.environ)))
                 for rank in range(world)]
        for p in procs:
            p.start()
        try:
            got = _collect(procs, results, len(jobs) * world, timeout,
                           "tensor-parallel" if dp_size == 1 else "data-parallel")
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    runs = []
    for j, job in enumerate(jobs):
        ranks = [got[j, d * tp_size] for d in range(dp_size)]
        outs = {i: o for rr in ranks for i, o in rr.outputs.items()}
        runs.append(DPRun([outs[i] for i in range(len(job.prompts))], ranks,
                          [got[j, r] for r in range(world) if r % tp_size]))
    return runs


def _collect(procs, results, expected: int, timeout: float, kind: str = "data-parallel") -> dict:
    """Gather ``expected`` rank results; raise on a rank error, a dead rank or the deadline
    (``kind`` names the ranks: data-parallel or tensor-parallel)."""
    got, deadline = {}, time.monotonic() + timeout
    while len(got) < expected:
        if time.monotonic() > deadline:
            waiting = sorted({r for r in range(len(procs))} - {r for _, r in got})
            _kill(procs)
            raise TimeoutError(f"data-parallel run: no result from ranks {waiting} within "
                               f"{timeout}s (a hang: do all ranks issue the same collectives?)")
        try:
            msg = results.get(timeout=0.5)
        except queue.Empty:
            _raise_if_dead(procs, kind)
            continue
        if msg[0] == "error":  # a user error keeps its type (as with one rank)
            _, rank, user_error, tb = msg
            if user_error is not None:
                _kill(procs)
                raise type(user_error)(f"data-parallel rank {rank}: {user_error}")
            # a rank that lost its peer fails too ("Connection closed by peer"): name the
            # rank that died, if one did, rather than the one that noticed
            give_up = time.monotonic() + DEATH_GRACE_S
            while time.monotonic() < give_up:
                _raise_if_dead(procs, kind)
                time.sleep(0.1)
            _kill(procs)
            raise RuntimeError(f"data-parallel rank {rank} failed:\n{tb}")
        _, job, rank, result = msg
        got[job, rank] = result
    return got


def _raise_if_dead(procs, kind: str = "data-parallel") -> None:
    """RuntimeError naming each rank that exited abnormally and how (signal or status); one
    line saying what to add when the ranks ran the launching script again."""
    dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    if dead:
        _kill(procs)
        if any(code == MAIN_GUARD_STATUS for _, code in dead):
            raise RuntimeError(
                f"the {kind} rank processes ran this script again (multiprocessing "
                "imports it in each one): put the code that builds and runs the LLM under "
                "`if __name__ == \"__main__\":`")
        how = ", ".join(f"rank {r} " + (f"killed by {signal.Signals(-code).name}" if code < 0
                                        else f"exited with status {code}")
                        for r, code in dead)
        raise RuntimeError(f"{kind} rank died: {how}")


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()


def exit_with_parent(parent_pid: int) -> None:
    """A rank whose parent died (the rank was re-parented, or the parent's pid is gone)
    exits at once instead of finishing its job and blocking forever on a result nobody
    reads."""
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def watch():
        # the process that forked this one: the launcher under spawn, under forkserver its
        # fork server, which exits with the launcher
        forker = os.getppid()
        while os.getppid() == forker != 1 and alive(parent_pid):
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True, name="specdec-parent-watch").start()


def _rank_main(rank: int, dp_size: int, tp_size: int, store: str, engine: type,
               jobs: list[DPJob], timeout: float, results, parent_pid: int,
               environ: dict) -> None:
    os.environ.clear()  # the launcher's environment now, not the fork server's at its start
    os.environ.update(environ)
    exit_with_parent(parent_pid)
    try:
        torch.set_num_threads(1)
        device = torch.device(jobs[0].llm_kwargs.get("device", "cpu")).type
        grid = init_grid(dp_size, tp_size, rank, device_type=device,
                         init_method=f"file://{store}", timeout=timeout)
        for j, job in enumerate(jobs):
            results.put(("ok", j, rank, _run_job(engine, job, rank, grid)))
        grid.close()
    except BaseException as e:
        user_error = e if type(e) in (ValueError, TypeError) else None
        results.put(("error", rank, user_error, traceback.format_exc()))


def rank_kwargs(llm_kwargs: dict, rank: int, grid: Grid) -> dict:
    """One rank's engine arguments: ``llm_kwargs`` (without data_parallel_size) with this
    rank's accelerator (one per rank) and fresh DP / TP contexts of ``grid`` (a fresh log of
    collectives)."""
    kwargs = dict(llm_kwargs)
    device = torch.device(kwargs.get("device", "cpu")).type
    if device != "cpu":
        kwargs["device"] = f"{device}:{rank % getattr(torch, device).device_count()}"
    dp = DPContext(grid.dp.rank, grid.dp.size, grid.dp.group)
    tp = TPContext(grid.tp.rank, grid.tp.size, grid.tp.group,
                   kwargs.get("sequence_parallel", False), dp.record)
    return kwargs | dict(dp=dp, tp=tp if tp.size > 1 else None)


def _run_job(engine: type, job: DPJob, rank: int, grid: Grid) -> RankResult:
    kwargs = rank_kwargs(job.llm_kwargs, rank, grid)
    llm, dp, tp = engine(**kwargs), kwargs["dp"], grid.tp
    if tp.rank > 0:
        return RankResult(rank, {}, [], llm.serve())
    params = job.params if isinstance(job.params, list) else [job.params] * len(job.prompts)
    rids = job.request_ids or [str(i) for i in range(len(job.prompts))]
    reqs = {i: llm.add_request(job.prompts[i], params[i], request_id=rids[i])
            for i in job.assignment[dp.rank]}
    collectives = []
    while True:
        start = len(dp.collectives)
        rec = llm.step()
        collectives.append(dp.collectives[start:])
        if rec is None:
            break
    outputs = {i: RequestOutput.of(r, llm.tokenizer) for i, r in reqs.items()}
    return RankResult(rank, outputs, llm.steps, collectives)
