"""The server's engine loop: one single-rank ``LLM`` (its ``EngineCore``, engine/core.py, runs
the steps) stepped in a loop, its results as plain messages.

``EngineLoop`` owns the LLM: it applies adds and aborts, steps, and returns a ``CoreOutput``
per step (the ``StepRecord`` plus, per request that got tokens or ended, a ``RequestUpdate``).
The API server runs it either in a worker thread of its own process (``AsyncEngine`` over an
in-process LLM: the tests inject faults there) or in a separate process (``specdec serve``:
``run_engine_process``, connected by a ``multiprocessing`` pipe), so the engine loop never
waits for HTTP parsing, SSE writing or detokenization, and they never wait for a step.

Messages to the engine process: ``("add", request_id, prompt_token_ids, SamplingParams)``,
``("abort", request_id, reason)``, ``("shutdown",)``; with ``serve --account``,
``("account",)`` (answered ``("account", report)``) and ``("account_reset",)``. From it: one
``EngineInfo`` when ready (or ``("error", message)`` when the LLM cannot be built), then
``CoreOutput`` messages.
"""

import gc
import os
import signal
from dataclasses import dataclass, field

from specdec.engine.sequence import Request, SamplingParams, Status
from specdec.entrypoints.account import Account, count_engine


@dataclass
class FinishStats:
    """What the metrics count of a request that left the engine (``ServerMetrics.on_finish``)."""

    num_prompt_tokens: int
    finish_reason: str | None
    num_drafted: list[int]
    num_accepted: list[int]
    num_steps_decoding: int

    @classmethod
    def of(cls, req: Request) -> "FinishStats":
        return cls(req.num_prompt_tokens, req.finish_reason, list(req.num_drafted),
                   list(req.num_accepted), req.num_steps_decoding)


@dataclass
class RequestUpdate:
    """What one step (or an add / abort) did to one request."""

    request_id: str
    token_ids: list[int]  # the tokens this step emitted
    finish_reason: str | None = None  # engine reason once finished: eos, stop, length, abort
    error: str | None = None  # the engine failed this request (HTTP 500)
    stats: FinishStats | None = None  # once the request left the engine
    logprobs: list | None = None  # TokenLogprob per token of token_ids, when asked
    prompt_logprobs: list | None = None  # the prompt's, on its first tokens, when asked


@dataclass
class CoreOutput:
    """One step's result (``step`` None: only adds/aborts were applied) and the gauges."""

    step: object | None  # StepRecord
    updates: list[RequestUpdate] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    idle: int | None = None  # parallel ranks: every DP rank went idle, the idle period's number


@dataclass
class EngineInfo:
    """What the API process needs of the engine it did not build."""

    tokenizer: object  # tokenizers.Tokenizer or None
    model_dir: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    num_threads: int  # torch's intra-op threads in the engine process
    startup: str | None = None  # LLM.startup: step graphs captured / compiled at start-up
    eos_token_ids: tuple[int, ...] = ()  # the model's (for /tokenizer_info)
    frozen_objects: int = 0  # start-up's objects out of the collections (gc.freeze)
    config: object = None  # the engine's EngineConfig (device, dtype chosen); None: a stub

    @classmethod
    def of(cls, llm) -> "EngineInfo":
        """A built engine's (this process's torch threads and frozen objects)."""
        import torch

        from specdec.engine.llm import DEFAULT_MODEL
        return cls(llm.tokenizer, str(llm.init_kwargs.get("model") or DEFAULT_MODEL),
                   llm.max_model_len, llm.target.config.vocab_size, llm.scheduler.max_num_seqs,
                   torch.get_num_threads(), llm.startup, tuple(llm.target.config.eos_token_ids),
                   gc.get_freeze_count(), getattr(llm, "config", None))


class EngineLoop:
    """Adds, aborts and steps over one single-rank LLM; every result is a message."""

    def __init__(self, llm):
        self.llm = llm
        self.requests: dict[str, Request] = {}

    def add(self, request_id: str, prompt_token_ids: list[int],
            params: SamplingParams) -> RequestUpdate | None:
        """None once added; an error update when the engine refuses it."""
        try:
            self.requests[request_id] = self.llm.add_request(prompt_token_ids, params,
                                                             request_id)
        except (ValueError, TypeError) as e:  # checked by the handler; kept as a guard
            return RequestUpdate(request_id, [], error=str(e))
        return None

    def abort(self, request_id: str, reason: str = "abort") -> RequestUpdate | None:
        """End a request early: its update (with its stats), or None if it already ended.
        ``reason``: "abort", or "stop" (the API process found a stop string)."""
        req = self.requests.pop(request_id, None)
        if req is None or not self.llm.abort_request(request_id, reason):
            return None
        return RequestUpdate(request_id, [], reason, stats=FinishStats.of(req))

    def has_work(self) -> bool:
        return self.llm.has_unfinished()

    def gauges(self) -> tuple[int, int, int]:
        """(running, waiting, free KV blocks)."""
        s = self.llm.scheduler
        return len(s.running), len(s.waiting), len(self.llm.allocator.free)

    def step(self) -> CoreOutput:
        """One engine step. A step that raises fails the requests it ran (``EngineCore.step``
        has finished them with reason "error"); the others go on."""
        updates = []
        try:
            rec = self.llm.step()
            self.llm.steps.clear()  # the records go out as messages: none is kept per step
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            rec, message = None, f"engine error: {type(e).__name__}: {e}"
            for rid, req in list(self.requests.items()):
                if req.status is Status.FINISHED:
                    del self.requests[rid]
                    updates.append(RequestUpdate(rid, [], error=message,
                                                 stats=FinishStats.of(req)))
        else:
            updates = self.updates(rec)
        return CoreOutput(rec, updates, *self.gauges())

    def updates(self, rec) -> list[RequestUpdate]:
        """One update per request a step (``rec``, a StepRecord or None) gave tokens, and
        one with its error per request it failed alone (``EngineCore._update``: reason
        "error", no tokens); the finished ones leave ``requests``."""
        updates = []
        for rid, n in (rec.new_tokens.items() if rec is not None else ()):
            req = self.requests.get(rid)
            if req is None:
                continue
            done = req.status is Status.FINISHED
            if done and req.finish_reason == "error":
                del self.requests[rid]
                updates.append(RequestUpdate(rid, [], error=f"engine error: {req.error}",
                                             stats=FinishStats.of(req)))
                continue
            if not n:
                continue
            first = len(req.token_ids) - n == req.num_prompt_tokens
            updates.append(RequestUpdate(
                rid, req.output_token_ids[-n:], req.finish_reason if done else None,
                stats=FinishStats.of(req) if done else None,
                logprobs=req.logprobs[-n:] if req.logprobs is not None else None,
                prompt_logprobs=req.prompt_logprobs if first else None))
            if done:
                del self.requests[rid]
        return updates


def default_engine_threads() -> int:
    """Torch threads of the engine process: the CPUs this process may run on, less one for
    the API process (HTTP, SSE, detokenizing) and the clients on the same machine; at least 1.
    (On a 2-core CPU a second intra-op thread spin-waits against them: measured in
    docs/benchmarks.md.)"""
    return max(1, len(os.sched_getaffinity(0)) - 1)


def run_engine_process(conn, llm_kwargs: dict, num_threads: int) -> None:
    """The engine process's main: ``num_threads`` torch threads, build the LLM, say ready,
    then apply messages and step until ``("shutdown",)`` or the API process goes away (the
    pipe closes). ``llm_kwargs["stub_tokens_per_step"]``: a ``StubLLM`` instead (benchmarks
    of the served path)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the group: the API drains
    import torch
    torch.set_num_threads(num_threads)
    from specdec.flags import UsageError, build_llm
    stub = llm_kwargs.pop("stub_tokens_per_step", None)  # a benchmark tool: stub_engine.py
    account = Account() if llm_kwargs.pop("account", False) else None  # serve --account
    try:
        if stub is None:
            llm = build_llm(**llm_kwargs)
        else:
            from specdec.entrypoints.stub_engine import StubLLM
            llm = StubLLM.from_kwargs(stub, llm_kwargs)
    except UsageError as e:
        conn.send(("error", str(e)))
        return
    core = EngineLoop(llm)
    send, wait = conn.send, conn.recv
    if account is not None:
        count_engine(account, core)
        send, wait = account.timed(conn.send, "send"), account.timed(conn.recv, "wait")
    # the engine lives as long as this process: what start-up made (torch, the model, the
    # graphs) goes to the permanent generation, so a full collection while serving scans
    # only what serving made (a full collection of it all: ~120 ms here, a stalled step)
    gc.collect()
    gc.freeze()
    conn.send(EngineInfo.of(llm))
    try:
        while True:
            messages = [] if core.has_work() else [wait()]  # idle: block until asked
            while conn.poll():
                messages.append(conn.recv())
            updates = []
            for m in messages:
                if m[0] == "shutdown":
                    return
                if m[0] == "account":  # serve --account's requests
                    send(("account", account.report()))
                    continue
                if m[0] == "account_reset":
                    account.reset()
                    continue
                update = core.add(*m[1:]) if m[0] == "add" else core.abort(*m[1:])
                if update is not None:
                    updates.append(update)
            out = core.step() if core.has_work() else CoreOutput(None, [], *core.gauges())
            out.updates[:0] = updates
            if out.step is not None or out.updates:
                send(out)
    except (EOFError, BrokenPipeError, ConnectionResetError):  # the API process is gone
        return
