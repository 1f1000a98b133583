"""A request as the engine tracks it: its tokens, its KV blocks and its speculative stats."""

from dataclasses import dataclass, field
from enum import Enum


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


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
    finish_reason: str | None = None
    # speculative stats, per draft position (index 0 = first draft)
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    num_steps_decoding: int = 0  # target steps that verified drafts for this request

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
