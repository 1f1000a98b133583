"""A request as the engine tracks it: its tokens, its KV blocks and its speculative stats."""

from dataclasses import dataclass, field
from enum import Enum

from specdec.checks import check_bool, check_float, check_int, check_token_ids
from specdec.engine.config import SEED_MAX
from specdec.engine.logprobs import MAX_LOGPROBS, TokenLogprob
from specdec.engine.rejection_sampler import GREEDY_TEMPERATURE

FLOAT32_MAX = 3.4028234663852886e38  # the step holds temperatures in float32: no larger
MAX_N = 1024  # samples per prompt
MIN_TOKENS_STOP_IDS = 16  # the most stop ids (eos + stop_token_ids) min_tokens can hold back
NOT_BUILT = {  # vLLM SamplingParams fields taken only at their no-op value: field -> allowed
    "bad_words": (None, [], ()), "logit_bias": (None, {}), "allowed_token_ids": (None,),
    "best_of": (None, 1)}


@dataclass(slots=True)
class SamplingParams:
    """One request's sampling, as vLLM's ``SamplingParams`` (the fields below; every one checked
    here, its name and allowed range in the message). The processing of the target's logits at
    every verified position, in vLLM's order (``engine/penalties.py``, ``rejection_sampler``):
    min_tokens (eos and stop_token_ids at -inf), repetition / frequency / presence penalties,
    [greedy: argmax], temperature, min_p, top_k, top_p."""

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
    # samples per prompt (``LLM.generate``: one CompletionOutput each; with a seed, sample i
    # draws with seed + i, as vLLM); greedy (temperature 0) takes n = 1 only, as vLLM
    n: int = 1
    # strings that end the output (matched on its detokenized text); the text stops before
    # the string (``include_stop_str_in_output``: after it), finish_reason "stop" and
    # stop_reason the string
    stop: str | list[str] | tuple[str, ...] | None = None
    include_stop_str_in_output: bool = False
    top_k: int = 0  # keep the k most likely tokens (ties kept); 0 or -1: all
    min_p: float = 0.0  # drop tokens below min_p x the most likely one's probability
    # over prompt and output tokens: a seen token's logit divided by it (> 0) or multiplied
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # subtracted from each token the output holds
    frequency_penalty: float = 0.0  # subtracted once per time the output holds the token
    min_tokens: int = 0  # no eos / stop_token_ids before this many output tokens
    # vLLM's fields this engine does not build: only their no-op value (NOT_BUILT)
    bad_words: list[str] | None = None
    logit_bias: dict | None = None
    allowed_token_ids: list[int] | None = None
    best_of: int | None = None

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
        self._check_vllm_fields()

    def _check_vllm_fields(self) -> None:
        check_int("n", self.n, lo=1, hi=MAX_N)
        if self.n > 1 and self.temperature < GREEDY_TEMPERATURE:
            raise ValueError(f"n={self.n} with temperature={self.temperature}: greedy sampling "
                             "gives one output (as vLLM: 'n must be 1 when using greedy "
                             "sampling'); allowed: n=1, or temperature > 0")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise ValueError(f"seed={self.seed} with n={self.n}: sample i draws with seed + i; "
                             f"allowed seed <= {SEED_MAX - self.n + 1}")
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            raise TypeError(f"stop={stop!r}: must be a str, a list of str, or None")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise TypeError(f"stop[{i}]={s!r}: stop strings must be str (token ids go in "
                                "stop_token_ids)")
            if not s:
                raise ValueError(f"stop[{i}]='': stop strings must be non-empty")
        self.stop = tuple(dict.fromkeys(stop))
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if check_int("top_k", self.top_k) < -1:
            raise ValueError(f"top_k={self.top_k}: allowed 0 or -1 (every token), or >= 1")
        if self.top_k == -1:  # vLLM takes -1 for "off" too
            self.top_k = 0
        self.min_p = check_float("min_p", self.min_p, lo=0.0, hi=1.0)
        self.repetition_penalty = check_float("repetition_penalty", self.repetition_penalty,
                                              lo=0.0, hi=FLOAT32_MAX, lo_open=True)
        for name in ("presence_penalty", "frequency_penalty"):
            setattr(self, name, check_float(name, getattr(self, name), lo=-2.0, hi=2.0))
        if check_int("min_tokens", self.min_tokens) < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens}: allowed 0 <= min_tokens <= "
                             f"max_tokens={self.max_tokens}")
        for name, allowed in NOT_BUILT.items():
            value = getattr(self, name)
            if not any(value == a and type(value) is type(a) for a in allowed):
                shown = " or ".join(repr(a) for a in allowed if not isinstance(a, tuple))
                raise ValueError(f"{name}={value!r}: not supported by this engine; allowed: "
                                 f"{shown} (nothing is accepted and ignored)")

    def processes_logits(self, num_output_tokens: int) -> bool:
        """Whether the next step's logits go through more than temperature and top-p, with
        ``num_output_tokens`` out so far: a penalty, top_k, min_p, or min_tokens not reached
        (``runner.sampling_variant``; once reached it stays reached)."""
        filters = self.temperature >= GREEDY_TEMPERATURE and (self.top_k > 0 or self.min_p > 0)
        return (filters or self.repetition_penalty != 1.0
                or self.presence_penalty != 0 or self.frequency_penalty != 0
                or num_output_tokens < self.min_tokens)

    def check_model(self, vocab_size: int, eos_token_ids, has_tokenizer: bool) -> None:
        """What needs the model: stop ids it can never emit are a mistake, not a no-op; stop
        strings need its tokenizer; min_tokens holds back at most MIN_TOKENS_STOP_IDS ids."""
        check_token_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        if self.stop and not has_tokenizer:
            raise ValueError(f"stop={list(self.stop)!r}: stop strings are matched on the "
                             "decoded text and the model has no tokenizer; allowed: None "
                             "(stop_token_ids work on ids)")
        held = self.min_tokens_stop_ids(eos_token_ids)
        if len(held) > MIN_TOKENS_STOP_IDS:
            raise ValueError(f"min_tokens={self.min_tokens} holds back {len(held)} stop ids "
                             "(the model's eos ids and stop_token_ids); allowed: at most "
                             f"{MIN_TOKENS_STOP_IDS}")

    def min_tokens_stop_ids(self, eos_token_ids) -> tuple[int, ...]:
        """The ids min_tokens holds back: the model's eos ids (even with ignore_eos, as vLLM)
        and stop_token_ids; () without min_tokens."""
        if not self.min_tokens:
            return ()
        return tuple(dict.fromkeys((*eos_token_ids, *self.stop_token_ids)))


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
    # a draft tree's: each draft's parent node (0 the root, draft i node i + 1)
    spec_parents: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # prefix cache: the entry ids of its registered (or hit) full blocks, in order, and the
    # prompt tokens it found cached when admitted
    block_entries: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    # linear attention with prefix caching: the block boundary whose state its row's staging
    # slot holds from its last step (the scheduler snapshots it once final), else None
    snapshot_at: int | None = None
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
    # params.stop: the output's text as it grows (engine.text_stream.TextStream), and the
    # stop string that ended it
    text_stream: object | None = None
    stop_reason: str | None = None

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
