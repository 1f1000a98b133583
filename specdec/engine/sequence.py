"""A request as the engine tracks it: its tokens, its KV blocks and its speculative stats."""

from dataclasses import dataclass, field
from enum import Enum

from specdec.checks import check_bool, check_float, check_int, check_token_ids
from specdec.engine.config import SEED_MAX
from specdec.engine.logprobs import MAX_LOGPROBS, TokenLogprob

FLOAT32_MAX = 3.4028234663852886e38  # the step holds temperatures in float32: no larger


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    # the key of this request's random numbers (None: one from the engine seed and its id):
    # the same prompt and seed give the same tokens whatever else is in the batch
    seed: int | None = None
    # log-probabilities of the target distribution (raw logits: before temperature and top-p):
    # for each output token, its own and the ``logprobs`` most likely ones (0: its own only);
    # for each prompt token after the first, the same with ``prompt_logprobs``. None: none
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        check_int("max_tokens", self.max_tokens, lo=1)
        self.temperature = check_float("temperature", self.temperature, lo=0.0,
                                       hi=FLOAT32_MAX)
        self.top_p = check_float("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        check_bool("ignore_eos", self.ignore_eos)
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise TypeError(f"stop_token_ids={self.stop_token_ids!r}: must be a list of ints")
        for i, t in enumerate(self.stop_token_ids):
            check_int(f"stop_token_ids[{i}]", t, lo=0)
        self.stop_token_ids = tuple(self.stop_token_ids)
        if self.seed is not None:
            check_int("seed", self.seed, lo=0, hi=SEED_MAX)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), lo=0, hi=MAX_LOGPROBS)

    def check_vocab(self, vocab_size: int) -> None:
        """Stop ids the model can never emit are a mistake, not a no-op."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    token_ids: list[int]  # prompt + accepted output tokens
    num_prompt_tokens: int
    params: SamplingParams
    row: int = -1  # row in the device token table / block table, -1 while waiting
    num_computed_tokens: int = 0  # tokens whose KV is final in the target cache
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "eos", "stop", "length", "error" or "abort"
    error: str | None = None  # what failed, for finish_reason "error"
    # speculative stats, per draft position (index 0 = first draft)
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    num_steps_decoding: int = 0  # target steps that verified drafts for this request
    # per output token / per prompt token (the first: None), when params ask for them
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def __post_init__(self):
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
