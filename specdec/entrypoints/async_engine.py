"""One background loop steps the engine; HTTP handlers add requests and read their tokens.

Ownership: the ``LLM`` is touched only by the loop task (on the event loop, between steps) and
by ``LLM.step()`` (in one worker thread, so the event loop never blocks). Handlers queue adds
and aborts; the loop applies them before the next step. After each step every request that
got tokens receives one ``TokenChunk`` (a speculative step can bring several tokens).
"""

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdec.engine.sequence import Request, SamplingParams, Status


class QueueFullError(RuntimeError):
    """The running batch and ``max_waiting`` more are taken: the server answers 503."""


@dataclass
class TokenChunk:
    """What one step brought a request: new token ids, and how it ended (if it did)."""

    token_ids: list[int]
    finish_reason: str | None = None  # engine reason: "eos", "stop", "length", "abort"
    error: str | None = None  # the engine failed this request (HTTP 500)


@dataclass
class RequestHandle:
    """A submitted request: its engine-side id and the chunks as they arrive."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    chunks: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None  # the engine's request, once added


class AsyncEngine:
    """Continuous batching over one single-rank ``LLM``; ``metrics`` (optional) sees each step.

    Admission: at most ``max_num_seqs + max_waiting`` requests are in the server at once
    (submitted and not finished), so a burst gets exactly the batch plus ``max_waiting``
    admitted whatever the timing of the engine loop; ``max_waiting=0``: no queue beyond the
    batch."""

    def __init__(self, llm, *, max_waiting: int = 256, metrics=None):
        if not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting={max_waiting!r}: must be an int >= 0")
        self.llm = llm
        self.max_waiting = max_waiting
        self.metrics = metrics
        self._ids = itertools.count()
        self._handles: dict[str, RequestHandle] = {}
        self._to_add: list[RequestHandle] = []
        self._to_abort: list[str] = []
        self._wake = asyncio.Event()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="specdec-step")
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._stop_task: asyncio.Task | None = None

    # ---- handler side --------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._to_add) + len(self.llm.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.llm.scheduler.running)

    @property
    def capacity(self) -> int:
        """Requests admitted at once: the running batch plus ``max_waiting``."""
        return self.llm.scheduler.max_num_seqs + self.max_waiting

    def submit(self, prompt_token_ids: list[int], params: SamplingParams) -> RequestHandle:
        """Queue a request for the next step; QueueFullError when the batch and
        ``max_waiting`` more are already taken."""
        if self._stopping:
            raise QueueFullError("the server is shutting down")
        if len(self._handles) >= self.capacity:
            raise QueueFullError(
                f"{len(self._handles)} requests in the server: the batch "
                f"(max_num_seqs={self.llm.scheduler.max_num_seqs}) and the queue "
                f"(max_waiting={self.max_waiting}) are full; retry later")
        handle = RequestHandle(f"req-{next(self._ids)}", list(prompt_token_ids), params)
        self._handles[handle.request_id] = handle
        self._to_add.append(handle)
        self._wake.set()
        return handle

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone) before the next step; its KV blocks are freed then."""
        if request_id in self._handles:
            self._to_abort.append(request_id)
            self._wake.set()

    # ---- the loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="specdec-engine")

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
            if not self.llm.scheduler.has_unfinished():
                self._wake.clear()
                if not (self._to_add or self._to_abort):
                    await self._wake.wait()
                continue
            try:
                rec = await loop.run_in_executor(self._worker, self.llm.step)
            except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
                self._fail_running(f"engine error: {type(e).__name__}: {e}")
                continue
            if rec is not None:
                self._dispatch(rec)

    def _apply_queued(self) -> None:
        for rid in self._to_abort:
            handle = self._handles.pop(rid, None)
            if handle is None:  # finished meanwhile
                continue
            self._to_add = [h for h in self._to_add if h is not handle]
            if self.llm.abort_request(rid) and self.metrics is not None:
                self.metrics.on_finish(handle.request)
            handle.chunks.put_nowait(TokenChunk([], "abort"))
        self._to_abort.clear()
        for handle in self._to_add:
            try:
                handle.request = self.llm.add_request(handle.prompt_token_ids, handle.params,
                                                      handle.request_id)
            except (ValueError, TypeError) as e:  # checked by the handler; kept as a guard
                self._handles.pop(handle.request_id)
                handle.chunks.put_nowait(TokenChunk([], error=str(e)))
        self._to_add.clear()

    def _dispatch(self, rec) -> None:
        if self.metrics is not None:
            self.metrics.on_step(rec)
        for rid, n in rec.new_tokens.items():
            handle = self._handles.get(rid)
            if not n or handle is None:
                continue
            req = handle.request
            done = req.status is Status.FINISHED
            handle.chunks.put_nowait(TokenChunk(req.output_token_ids[-n:],
                                                req.finish_reason if done else None))
            if done:
                del self._handles[rid]
                if self.metrics is not None:
                    self.metrics.on_finish(req)

    def _fail_running(self, message: str) -> None:
        """After a failed step: ``LLM.step`` has finished the requests of that step with
        reason "error" (blocks freed); tell their clients. The others go on."""
        for rid, handle in list(self._handles.items()):
            req = handle.request
            if req is not None and req.status is Status.FINISHED:
                del self._handles[rid]
                if self.metrics is not None:
                    self.metrics.on_finish(req)
                handle.chunks.put_nowait(TokenChunk([], error=message))
