"""The API process's side of the engine: admission, one chunk queue per request, metrics.

HTTP handlers ``submit`` requests and read ``TokenChunk`` objects from their handles; each
engine step sends every request that got tokens one chunk (a speculative step can bring
several tokens), and a handler that lags reads the chunks queued meanwhile as one. The engine
itself is an ``EngineLoop`` (``specdec.entrypoints.engine_loop``), reached one of two ways:

* ``AsyncEngine(llm)``: an LLM built in this process, stepped in one worker thread; adds and
  aborts are queued and applied by the loop task between steps (the tests use it to inject
  faults into the LLM).
* ``ProcessEngine(llm_kwargs)``: ``specdec serve``'s engine, built and stepped in its own
  process; adds and aborts go down a pipe at once and its outputs are read by the event loop
  (``loop.add_reader``), so no step waits for HTTP and no HTTP handler waits for a step. An
  engine process that dies fails every request with a 500 and calls ``on_engine_death``.
"""

import asyncio
import itertools
import multiprocessing
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.engine_loop import (CoreOutput, EngineLoop, EngineInfo, FinishStats,
                                             run_engine_process)
from specdec.entrypoints.outbox import Outbox


class QueueFullError(RuntimeError):
    """The running batch and ``max_waiting`` more are taken: the server answers 503."""


class EngineDeadError(RuntimeError):
    """The engine process has exited: the server answers 500 and shuts down."""


@dataclass
class TokenChunk:
    """What one step brought a request: new token ids, and how it ended (if it did)."""

    token_ids: list[int]
    finish_reason: str | None = None  # engine reason: "eos", "stop", "length", "abort"
    error: str | None = None  # the engine failed this request (HTTP 500)
    stats: FinishStats | None = None  # the request's counts, on its last chunk
    logprobs: list | None = None  # a TokenLogprob per token, when the request asked
    prompt_logprobs: list | None = None  # on the request's first tokens, when asked


@dataclass
class RequestHandle:
    """A submitted request: its engine-side id and the chunks as they arrive."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    _held: TokenChunk | None = field(default=None, init=False, repr=False)  # an error, due next

    async def next_chunk(self) -> TokenChunk:
        """The next chunk, merged with every chunk queued behind it: a reader that lags the
        engine (several steps arrived since its last read) gets their tokens in one chunk,
        so it writes one event, not one per step. Lossless: the tokens in order, the last
        chunk's finish reason; an error never rides on tokens, it comes as its own chunk."""
        chunk, self._held = self._held or await self.chunks.get(), None
        while chunk.finish_reason is None and chunk.error is None and not self.chunks.empty():
            after = self.chunks.get_nowait()
            if after.error is not None:
                self._held = after
                break
            logprobs = (None if chunk.logprobs is None and after.logprobs is None
                        else (chunk.logprobs or []) + (after.logprobs or []))
            chunk = TokenChunk(chunk.token_ids + after.token_ids, after.finish_reason,
                               stats=after.stats, logprobs=logprobs,
                               prompt_logprobs=chunk.prompt_logprobs or after.prompt_logprobs)
        return chunk


class EngineFrontend:
    """Admission and dispatch shared by both engines. Admission: at most ``max_num_seqs +
    max_waiting`` requests are in the server at once (submitted and not finished), so a burst
    gets exactly the batch plus ``max_waiting`` admitted whatever the timing of the engine
    loop; ``max_waiting=0``: no queue beyond the batch."""

    frozen_objects = 0  # start-up objects frozen out of collections (an engine in the API
    #                     process freezes none: the process is not only the engine's)

    def __init__(self, max_num_seqs: int, max_waiting: int, metrics):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting!r}: must be an int >= 0")
        self.max_num_seqs = max_num_seqs
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}
        self._stopping = False
        self._stop_task: asyncio.Task | None = None

    @property
    def capacity(self) -> int:
        """Requests admitted at once: the running batch plus ``max_waiting``."""
        return self.max_num_seqs + self.max_waiting

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Send a request to the engine; QueueFullError when the batch and ``max_waiting``
        more are already taken."""
        if self._stopping:
            raise QueueFullError("the server is shutting down")
        if len(self._handles) >= self.capacity:
            raise QueueFullError(
                f"{len(self._handles)} requests in the server: the batch "
                f"(max_num_seqs={self.max_num_seqs}) and the queue "
                f"(max_waiting={self.max_waiting}) are full; retry later")
        handle = RequestHandle(f"req-{next(self._ids)}", list(prompt_token_ids), params)
        self._handles[handle.request_id] = handle
        self._send_add(handle)
        return handle

    def abort(self, request_id: str, reason: str = "abort", *,
              await_stats: bool = False) -> None:
        """Drop a request (client gone; or ``reason`` "stop": its text reached a stop string);
        the engine frees its KV blocks before its next step and counts it under ``reason``.
        Its stream ends at once with that finish reason; with ``await_stats``, it ends with
        the engine's last chunk of it instead, which carries its counts (FinishStats)."""
        if request_id not in self._handles:
            return
        if not await_stats:
            self._handles.pop(request_id).chunks.put_nowait(TokenChunk([], reason))
        self._send_abort(request_id, reason)

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout_s``, abort the rest
        (their streams end with finish_reason "abort"). A second call waits for the first."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop(timeout_s))
        await asyncio.shield(self._stop_task)

    async def _stop(self, timeout_s: float) -> None:
        self._stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._handles and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for rid in list(self._handles):
            self.abort(rid)
        await self._close()

    def _dispatch(self, out: CoreOutput) -> None:
        """An engine output: metrics, then one chunk per request it concerns."""
        if self.metrics is not None and out.step is not None:
            self.metrics.on_step(out.step)
        for u in out.updates:
            if u.stats is not None and self.metrics is not None:
                self.metrics.on_finish(u.stats)
            handle = self._handles.get(u.request_id)
            if handle is None:  # aborted here already
                continue
            if u.stats is not None or u.error is not None:
                del self._handles[u.request_id]
            handle.chunks.put_nowait(TokenChunk(u.token_ids, u.finish_reason, u.error, u.stats,
                                                u.logprobs, u.prompt_logprobs))

    def _fail_all(self, message: str) -> None:
        for handle in self._handles.values():
            handle.chunks.put_nowait(TokenChunk([], error=message))
        self._handles.clear()


class AsyncEngine(EngineFrontend):
    """An in-process single-rank ``LLM`` stepped by one worker thread; ``metrics`` (optional)
    sees each step. The LLM is touched only by the loop task (between steps) and the worker."""

    def __init__(self, llm, *, max_waiting: int = 256, metrics=None):
        super().__init__(llm.scheduler.max_num_seqs, max_waiting, metrics)
        self.llm = llm
        self.core = EngineLoop(llm)
        self._to_add: list[RequestHandle] = []
        self._to_abort: list[tuple[str, str]] = []  # (request id, reason)
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="specdec-step")
        self._task: asyncio.Task | None = None

    @property
    def num_waiting(self) -> int:
        return len(self._to_add) + len(self.llm.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.llm.scheduler.running)

    def free_blocks(self) -> int:
        return len(self.llm.allocator.free)

    @property
    def num_kv_blocks(self) -> int | None:
        """The engine's KV blocks (None: a stub without a config)."""
        config = getattr(self.llm, "config", None)
        return config.num_kv_blocks if config is not None else None

    def _send_add(self, handle: RequestHandle) -> None:
        self._to_add.append(handle)
        self._wake.set()

    def _send_abort(self, request_id: str, reason: str) -> None:
        self._to_abort.append((request_id, reason))
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="specdec-engine")

    async def _close(self) -> None:
        while self._to_abort and not self._task.done():
            await asyncio.sleep(0.01)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._worker.shutdown(wait=True)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._apply_queued()
            if not self.core.has_work():
                self._wake.clear()
                if not (self._to_add or self._to_abort):
                    await self._wake.wait()
                continue
            self._dispatch(await loop.run_in_executor(self._worker, self.core.step))

    def _apply_queued(self) -> None:
        updates = [self.core.abort(rid, reason) for rid, reason in self._to_abort]
        self._to_abort.clear()
        updates += [self.core.add(h.request_id, h.prompt_token_ids, h.params)
                    for h in self._to_add if h.request_id in self._handles]
        self._to_add.clear()
        updates = [u for u in updates if u is not None]
        if updates:  # add refusals and abort stats (most loop turns have none)
            self._dispatch(CoreOutput(None, updates))


def engine_start_method(device) -> str:
    """How the engine process starts: forked on a CPU (it has this process's imports, torch
    included: the server answers ~2 s sooner on 2 cores), where the platform forks and
    this process runs one thread (a fork copies no other thread, nor any lock it held);
    spawned otherwise -- an accelerator's runtime does not survive a fork."""
    on_cpu = device is not None and str(device).split(":")[0] == "cpu"
    forks = "fork" in multiprocessing.get_all_start_methods()
    return "fork" if on_cpu and forks and threading.active_count() == 1 else "spawn"


def _run_forked(api_end, *args) -> None:
    """A forked engine process: close its copy of the API process's end of the pipe first
    (else the pipe stays open when the API process dies, and the engine outlives it), then
    ``run_engine_process(*args)``."""
    api_end.close()
    run_engine_process(*args)


class ProcessEngine(EngineFrontend):
    """The engine in its own process (``run_engine_process``, ``num_threads`` torch threads),
    built from ``llm_kwargs`` (``specdec.flags.build_llm``'s arguments); ``info`` once
    ``start_process`` returned."""

    def __init__(self, llm_kwargs: dict, *, num_threads: int, max_waiting: int = 256,
                 metrics=None):
        super().__init__(llm_kwargs.get("max_num_seqs", 0), max_waiting, metrics)
        self.llm_kwargs = llm_kwargs
        self.num_threads = num_threads  # torch threads of the engine process
        self.info: EngineInfo | None = None
        self.process = None
        self.conn = None
        self._outbox: Outbox | None = None  # the messages to the engine process, once started
        self.exitcode: int | None = None  # set when the engine process died
        self.on_engine_death = None  # called (no arguments) once the engine process died
        self._gauges = (0, 0, 0)  # running, waiting, free blocks: from the last output

    @property
    def where(self) -> str:
        return f"engine process {self.process.pid}"

    def discard(self) -> None:
        """End the engine before it served: its process exits when its pipe closes."""
        self.conn.close()
        self.process.join(30)

    @property
    def frozen_objects(self) -> int:
        """Start-up objects the engine process froze out of its collections."""
        return self.info.frozen_objects if self.info is not None else 0

    def start_process(self, timeout_s: float = 600.0) -> EngineInfo:
        """Start the engine process (``engine_start_method``) and wait until its LLM is
        built; RuntimeError with the engine's message when it cannot be."""
        method = engine_start_method(self.llm_kwargs.get("device"))
        ctx = multiprocessing.get_context(method)
        self.conn, child = ctx.Pipe()
        target, args = run_engine_process, (child, self.llm_kwargs, self.num_threads)
        if method == "fork":
            target, args = _run_forked, (self.conn, *args)
        self.process = ctx.Process(target=target, args=args, name="specdec-engine", daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(timeout_s):
            self.process.kill()
            raise RuntimeError(f"the engine process did not start within {timeout_s:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited with code {self.process.exitcode} "
                               "before it was ready") from None
        if isinstance(msg, tuple):  # ("error", message)
            self.process.join()
            raise RuntimeError(msg[1])
        self.info = msg
        self.max_num_seqs = msg.max_num_seqs
        return msg

    @property
    def num_running(self) -> int:
        return self._gauges[0]

    @property
    def num_waiting(self) -> int:
        return self._gauges[1]

    def free_blocks(self) -> int:
        return self._gauges[2]

    @property
    def num_kv_blocks(self) -> int | None:
        """The engine process's KV blocks (None: a stub, or not started)."""
        config = self.info.config if self.info is not None else None
        return config.num_kv_blocks if config is not None else None

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        if self.exitcode is not None:
            raise EngineDeadError(f"the engine process exited with code {self.exitcode}")
        return super().submit(prompt_token_ids, params)

    def _send_add(self, handle: RequestHandle) -> None:
        self._send(("add", handle.request_id, handle.prompt_token_ids, handle.params))

    def _send_abort(self, request_id: str, reason: str) -> None:
        self._send(("abort", request_id, reason))

    def _send(self, msg) -> None:
        self._outbox.put(msg)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._on_readable)
        self._outbox = Outbox(self.conn, loop, self._engine_died)

    async def account(self, reset: bool = False) -> dict | None:
        """``serve --account``: the engine process's account (``reset``: zero it; None)."""
        if reset:
            self._send(("account_reset",))
            return None
        self._account_reply = asyncio.get_running_loop().create_future()
        self._send(("account",))
        return await self._account_reply

    def _on_readable(self) -> None:
        try:
            while self.conn.poll():
                out = self.conn.recv()
                if isinstance(out, tuple):  # ("account", report): serve --account
                    self._account_reply.set_result(out[1])
                    continue
                self._gauges = (out.running, out.waiting, out.free_blocks)
                self._dispatch(out)
        except (EOFError, ConnectionResetError, OSError):
            self._engine_died()

    def _engine_died(self) -> None:
        if self.exitcode is not None:
            return
        asyncio.get_running_loop().remove_reader(self.conn.fileno())
        self.process.join(5)
        self.exitcode = self.process.exitcode if self.process.exitcode is not None else -1
        self._fail_all(f"the engine process exited with code {self.exitcode}")
        if self.on_engine_death is not None:
            self.on_engine_death()

    async def _close(self) -> None:
        loop, running = asyncio.get_running_loop(), self.exitcode is None
        if running:
            loop.remove_reader(self.conn.fileno())
            self._send(("shutdown",))
        await loop.run_in_executor(None, self._outbox.close, 30)
        if running:
            await loop.run_in_executor(None, self.process.join, 30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
        self.conn.close()
