"""A stub engine for measuring the served path without a model (a benchmark tool).

``StubLLM`` has the parts of ``LLM`` that ``EngineLoop`` and ``run_engine_process`` use. Its
step takes no model time: every running request gets ``tokens_per_step`` tokens at once (4 =
EAGLE-3 K=3 at full acceptance; the last chunk is shorter), echoing its prompt's ids (real
ids of the model's tokenizer, so detokenization does real work), until ``max_tokens`` or
``max_model_len`` ends it ("length"; eos and stop ids are ignored). Selected by
``specdec serve --stub-engine N`` (the ``stub_tokens_per_step`` key of the engine process's
``llm_kwargs``); ``benchmarks/bench_served_stub.py`` drives it.
"""

import json
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

from specdec.engine.config import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_SEQS
from specdec.engine.outputs import StepRecord
from specdec.engine.sequence import Request, Status
from specdec.models.checkpoint import load_tokenizer


class StubScheduler:
    """Waiting and running requests; at most ``max_num_seqs`` run."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)


class StubLLM:
    """An ``LLM`` stand-in whose step emits ``tokens_per_step`` tokens per running request."""

    startup = None
    allocator = SimpleNamespace(free=())  # no KV cache

    def __init__(self, tokens_per_step: int, model: str | None, max_num_seqs: int,
                 max_model_len: int):
        from specdec.engine.llm import DEFAULT_MODEL
        if tokens_per_step < 1:
            raise ValueError(f"tokens_per_step={tokens_per_step}: must be >= 1")
        folder = Path(model or DEFAULT_MODEL)
        vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        self.tokens_per_step = tokens_per_step
        self.tokenizer = load_tokenizer(folder)
        self.init_kwargs = dict(model=model)
        self.max_model_len = max_model_len
        self.target = SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size,
                                                             eos_token_ids=()))
        self.scheduler = StubScheduler(max_num_seqs)
        self.steps: list[StepRecord] = []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @classmethod
    def from_kwargs(cls, tokens_per_step: int, llm_kwargs: dict) -> "StubLLM":
        """From ``specdec serve``'s engine kwargs (the ones a stub has a use for; sizes not
        given: ``LLM``'s defaults)."""
        return cls(tokens_per_step, llm_kwargs.get("model"),
                   llm_kwargs.get("max_num_seqs") or DEFAULT_MAX_NUM_SEQS,
                   llm_kwargs.get("max_model_len") or DEFAULT_MAX_MODEL_LEN)

    def add_request(self, prompt_token_ids: list[int], params, request_id: str) -> Request:
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise ValueError("logprobs: the stub engine (a benchmark of the served path) "
                             "computes no log-probabilities")
        req = Request(request_id, list(prompt_token_ids), len(prompt_token_ids), params)
        self.scheduler.waiting.append(req)
        return req

    def abort_request(self, request_id: str, reason: str = "abort") -> bool:
        s = self.scheduler
        for queue in (s.waiting, s.running):
            req = next((r for r in queue if r.request_id == request_id), None)
            if req is not None:
                queue.remove(req)
                req.status, req.finish_reason = Status.FINISHED, reason
                return True
        return False

    def step(self) -> StepRecord:
        start = time.perf_counter()
        s = self.scheduler
        while s.waiting and len(s.running) < s.max_num_seqs:
            s.running.append(s.waiting.popleft())
            s.running[-1].status = Status.RUNNING
        new_tokens = {r.request_id: self._emit(r) for r in s.running}
        s.running = [r for r in s.running if r.status is Status.RUNNING]
        rec = StepRecord(len(new_tokens), sum(new_tokens.values()), time.perf_counter() - start,
                         0.0, None, 0, new_tokens)
        self.steps.append(rec)
        return rec

    def _emit(self, r: Request) -> int:
        """Append this step's tokens (the prompt's ids again, in order); -> how many."""
        budget = min(r.params.max_tokens - len(r.output_token_ids),
                     self.max_model_len - r.num_tokens)
        n = min(self.tokens_per_step, budget)
        out = len(r.output_token_ids)
        r.token_ids += [r.token_ids[(out + i) % r.num_prompt_tokens] for i in range(n)]
        drafts = self.tokens_per_step - 1  # full acceptance: /metrics shows K = N - 1
        if drafts:
            r.num_steps_decoding += 1
            r.num_drafted = [d + 1 for d in r.num_drafted or [0] * drafts]
            r.num_accepted = [a + 1 for a in r.num_accepted or [0] * drafts]
        if n == budget:
            r.status, r.finish_reason = Status.FINISHED, "length"
        return n
