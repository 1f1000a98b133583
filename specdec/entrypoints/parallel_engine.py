"""``specdec serve`` over data x tensor parallel ranks: one API process, D x T rank processes.

The ranks start as ``run_data_parallel``'s do (``dp_engine.rank_context``, one file store,
``init_grid``), each building its rank's engine from the same ``build_llm`` arguments, so a
refusal is the one a single rank gives. TP rank 0 of each DP replica (its leader) has a pipe
to the API process and runs an ``EngineLoop`` over the requests sent to it; its TP peers
``serve()`` its steps. The API process sends each request to the DP replica with the fewest
unfinished ones, and sums the replicas' gauges; ``/metrics`` counts every replica's steps and
requests (an idle replica's dummy steps are not counted as steps).

Lockstep: every leader's ``step()`` joins the others' (the plan all-reduce, every MoE
exchange), so leaders step together or not at all. A step that returns None (every DP rank
idle) ends an awake period on every leader at once; each counts it (idle period c) and goes to
sleep, and DP rank 0's leader sends ``idle=c`` to the API process. A sleeping leader applies
adds and aborts but steps again only on ``("wake", c)``, which the API process sends to every
leader at once: on ``idle=c`` while it has unfinished requests (their adds are on the way),
else with the next request, and every ``keepalive_s`` while the server sits idle (a no-op
step, so the TP peers waiting in the step broadcast never reach the process group's timeout).
Every leader thus wakes for the same periods, and no collective waits on a sleeping leader.

Messages to a leader: ``("add", request_id, prompt_token_ids, SamplingParams)``,
``("abort", request_id, reason)``, ``("wake", c)``, ``("shutdown",)`` (sent once all sleep).
From it: an ``EngineInfo`` when built (or ``("error", message)``), then ``CoreOutput``s.

Worked example (D=2, T=1): requests a, b, c arrive while both leaders sleep at c=0 -> a to
replica 0 with a wake(0) to both, b to 1, c to 0; both step (replica 1 runs b, 0 runs a and c)
until every request is done; the step after returns None on both: idle period 1, replica 0
reports ``idle=1``, and both sleep until the next request's wake(1).
"""

import asyncio
import os
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

from specdec.entrypoints.async_engine import EngineDeadError, EngineFrontend
from specdec.entrypoints.engine_loop import CoreOutput, EngineInfo, EngineLoop
from specdec.entrypoints.outbox import Outbox

START_POLL_S = 0.1  # how often start-up looks for a dead rank


def _lead(conn, llm, dp_rank: int, shutdown) -> None:
    """A DP replica's leader: apply messages, step in lockstep with the other leaders."""
    loop, idle, awake = EngineLoop(llm), 0, False
    while True:
        messages = [] if awake else [conn.recv()]  # asleep: block until told
        while conn.poll():
            messages.append(conn.recv())
        updates = []
        for m in messages:
            if m[0] == "shutdown":
                shutdown.set()  # before the STOP: a TP peer returning from serve() sees it
                if llm.config.tensor_parallel_size > 1:
                    llm.runner.send_stop()
                return
            if m[0] == "wake":
                awake = awake or m[1] == idle
                continue
            update = loop.add(*m[1:]) if m[0] == "add" else loop.abort(*m[1:])
            if update is not None:
                updates.append(update)
        if not awake:
            if updates:
                conn.send(CoreOutput(None, updates, *loop.gauges()))
            continue
        rec = llm.step()  # a fault ends this rank: its peers' collectives cannot go on
        llm.steps.clear()
        out = CoreOutput(rec if rec is not None and rec.num_reqs else None,
                         updates + loop.updates(rec), *loop.gauges())
        if rec is None:
            awake, idle = False, idle + 1
            if dp_rank == 0:
                out.idle = idle
        if out.step is not None or out.updates or out.idle is not None:
            conn.send(out)


def run_rank_process(rank: int, dp_size: int, tp_size: int, store: str, llm_kwargs: dict,
                     conn, shutdown, num_threads: int, parent_pid: int, environ: dict) -> None:
    """A rank's main: join the grid, build the rank's engine; a leader (``conn``) reports
    ready and leads, a TP peer serves its leader's steps until ``shutdown`` is set."""
    os.environ.clear()  # the API process's environment, not the fork server's
    os.environ.update(environ)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the API drains
    import torch

    from specdec.distributed import init_grid
    from specdec.engine.dp_engine import exit_with_parent, rank_kwargs
    from specdec.flags import UsageError, build_llm
    exit_with_parent(parent_pid)
    torch.set_num_threads(num_threads)
    device = torch.device(llm_kwargs.get("device", "cpu")).type
    grid = init_grid(dp_size, tp_size, rank, device_type=device, init_method=f"file://{store}",
                     timeout=llm_kwargs.get("data_parallel_timeout", 600.0))
    kwargs = rank_kwargs({k: v for k, v in llm_kwargs.items() if k != "data_parallel_size"},
                         rank, grid)
    try:
        llm = build_llm(**kwargs)
    except UsageError as e:
        if conn is not None:
            conn.send(("error", str(e)))
        return
    if conn is None:
        while not shutdown.is_set():
            llm.serve()
        return
    conn.send(EngineInfo.of(llm))
    try:
        _lead(conn, llm, grid.dp.rank, shutdown)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the API process is gone
        return


def _pending(conn):
    """What a rank sent on ``conn`` and is not read yet; None: nothing (or it hung up)."""
    try:
        return conn.recv() if conn.poll() else None
    except (EOFError, OSError):
        return None


class ParallelEngine(EngineFrontend):
    """``specdec serve``'s engine over ``data_parallel_size`` x ``tensor_parallel_size`` rank
    processes (``run_rank_process``, ``num_threads`` torch threads each), built from
    ``llm_kwargs`` (``build_llm``'s arguments); ``info`` (DP rank 0's) once started."""

    def __init__(self, llm_kwargs: dict, *, num_threads: int, max_waiting: int = 256,
                 metrics=None):
        super().__init__(0, max_waiting, metrics)
        self.llm_kwargs = llm_kwargs
        self.dp_size = llm_kwargs.get("data_parallel_size", 1)
        self.tp_size = llm_kwargs.get("tensor_parallel_size", 1)
        self.num_threads = num_threads
        self.keepalive_s = llm_kwargs.get("data_parallel_timeout", 600.0) / 4
        self.info: EngineInfo | None = None
        self.processes: list = []
        self.conns: list = []  # one per DP replica (its leader's pipe)
        self._outboxes: list[Outbox] = []  # the messages to each, once started
        self.exitcode: int | None = None  # set when a rank process died
        self.on_engine_death = None
        self._gauges = [(0, 0, 0)] * self.dp_size  # per replica: running, waiting, free blocks
        self._replica: dict[str, int] = {}  # request id -> replica, until the engine ends it
        self._asleep_at: int | None = 0  # the idle period all leaders sleep in; None: awake
        self._keepalive: asyncio.TimerHandle | None = None

    @property
    def where(self) -> str:
        pids = ", ".join(str(p.pid) for p in self.processes)
        return f"{len(self.processes)} rank processes {pids}: DP={self.dp_size} x TP={self.tp_size}"

    def start_process(self, timeout_s: float = 600.0) -> EngineInfo:
        """Start the rank processes and wait until every replica is built; RuntimeError with
        a rank's message (or its death) when one cannot be."""
        import torch

        from specdec.engine.dp_engine import exit_if_a_rank_reran_the_script, rank_context
        exit_if_a_rank_reran_the_script()
        ctx = rank_context({torch.device(self.llm_kwargs.get("device", "cpu")).type})
        self._store = tempfile.TemporaryDirectory(prefix="specdec-serve-")
        store, shutdown = str(Path(self._store.name) / "store"), ctx.Event()
        children = []
        for rank in range(self.dp_size * self.tp_size):
            api_end, child = ctx.Pipe() if rank % self.tp_size == 0 else (None, None)
            if api_end is not None:
                self.conns.append(api_end)
                children.append(child)
            self.processes.append(ctx.Process(
                target=run_rank_process, daemon=True, name=f"specdec-rank-{rank}",
                args=(rank, self.dp_size, self.tp_size, store, self.llm_kwargs, child, shutdown,
                      self.num_threads, os.getpid(), dict(os.environ))))
        for p in self.processes:
            p.start()
        for child in children:
            child.close()
        infos, deadline = [], time.monotonic() + timeout_s
        for conn in self.conns:
            while not conn.poll(START_POLL_S):
                dead = [(r, p.exitcode) for r, p in enumerate(self.processes)
                        if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    # a leader that refused sent why before it exited: that is the error
                    errors = [m[1] for m in map(_pending, self.conns)
                              if isinstance(m, tuple)]
                    self.discard()
                    if errors:
                        raise RuntimeError(errors[0])
                    raise RuntimeError(f"rank {dead[0][0]} exited with code {dead[0][1]} "
                                       "before it was ready" if dead else
                                       f"the rank processes did not start within "
                                       f"{timeout_s:.0f} s")
            msg = conn.recv()
            if isinstance(msg, tuple):  # ("error", message): every rank refuses alike
                self.discard()
                raise RuntimeError(msg[1])
            infos.append(msg)
        self.info = infos[0]
        self.max_num_seqs = sum(i.max_num_seqs for i in infos)
        return self.info

    def discard(self) -> None:
        """End every rank process now."""
        for p in self.processes:
            if p.is_alive():
                p.kill()
        for p in self.processes:
            p.join()

    @property
    def frozen_objects(self) -> int:
        return self.info.frozen_objects if self.info is not None else 0

    @property
    def num_running(self) -> int:
        return sum(g[0] for g in self._gauges)

    @property
    def num_waiting(self) -> int:
        return sum(g[1] for g in self._gauges)

    def free_blocks(self) -> int:
        return sum(g[2] for g in self._gauges)

    @property
    def num_kv_blocks(self) -> int | None:
        """Every replica's KV blocks (each rank of a replica holds its TP share of them)."""
        config = self.info.config if self.info is not None else None
        return config.num_kv_blocks * self.dp_size if config is not None else None

    def submit(self, prompt_token_ids, params):
        if self.exitcode is not None:
            raise EngineDeadError(f"a rank process exited with code {self.exitcode}")
        return super().submit(prompt_token_ids, params)

    def _send_add(self, handle) -> None:
        load = Counter(self._replica.values())  # unfinished requests per replica
        replica = min(range(self.dp_size), key=load.__getitem__)
        self._replica[handle.request_id] = replica
        self._send(replica, ("add", handle.request_id, handle.prompt_token_ids, handle.params))
        self._wake()

    def _send_abort(self, request_id: str, reason: str) -> None:
        if request_id in self._replica:
            self._send(self._replica[request_id], ("abort", request_id, reason))

    def _wake(self) -> None:
        """Every leader steps again (``("wake", c)``), if they sleep."""
        if self._asleep_at is not None:
            c, self._asleep_at = self._asleep_at, None
            for replica in range(self.dp_size):
                self._send(replica, ("wake", c))

    def _send(self, replica: int, msg) -> None:
        self._outboxes[replica].put(msg)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for replica, conn in enumerate(self.conns):
            loop.add_reader(conn.fileno(), self._on_readable, replica)
        self._outboxes = [Outbox(conn, loop, self._engine_died) for conn in self.conns]
        for p in self.processes:  # a TP peer's death shows here, not on a pipe
            loop.add_reader(p.sentinel, self._engine_died)
        self._keepalive = loop.call_later(self.keepalive_s, self._keep_alive)

    def _keep_alive(self) -> None:
        """Asleep: a no-op step on every rank (awake: nothing), again in ``keepalive_s``."""
        if self.exitcode is None:
            self._wake()
            self._keepalive = asyncio.get_running_loop().call_later(self.keepalive_s,
                                                                    self._keep_alive)

    def _on_readable(self, replica: int) -> None:
        try:
            while self.conns[replica].poll():
                out = self.conns[replica].recv()
                self._gauges[replica] = (out.running, out.waiting, out.free_blocks)
                for u in out.updates:
                    if u.stats is not None or u.error is not None:
                        del self._replica[u.request_id]
                self._dispatch(out)
                if out.idle is not None:
                    self._asleep_at = out.idle
                    if self._replica:  # requests on their way to a leader
                        self._wake()
        except (EOFError, ConnectionResetError, OSError):
            self._engine_died()

    def _engine_died(self) -> None:
        if self.exitcode is not None:
            return
        self._stop_reading()
        time.sleep(0.2)  # the rank that failed first, not its peers that noticed
        dead = [p.exitcode for p in self.processes if p.exitcode not in (None, 0)]
        self.discard()
        self.exitcode = dead[0] if dead else -1
        self._replica.clear()
        self._fail_all(f"a rank process exited with code {self.exitcode}")
        if self.on_engine_death is not None:
            self.on_engine_death()

    async def _close(self) -> None:
        """Every leader asleep (all requests ended), then shut down; kill what lingers."""
        if self._keepalive is not None:
            self._keepalive.cancel()
        loop, running = asyncio.get_running_loop(), self.exitcode is None
        if running:
            deadline = time.monotonic() + 30
            while (self._asleep_at is None or self._replica) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            self._stop_reading()
            for replica in range(self.dp_size):
                self._send(replica, ("shutdown",))
        for outbox in self._outboxes:
            await loop.run_in_executor(None, outbox.close, 30)
        if running:
            await loop.run_in_executor(None, self._join, 30)
        for conn in self.conns:
            conn.close()
        self._store.cleanup()

    def _stop_reading(self) -> None:
        """The event loop stops watching the leaders' pipes and the rank processes."""
        loop = asyncio.get_running_loop()
        for conn in self.conns:
            loop.remove_reader(conn.fileno())
        for p in self.processes:
            loop.remove_reader(p.sentinel)

    def _join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        self.discard()
