"""What the engine returns: a finished request's ``RequestOutput`` and a step's ``StepRecord``."""

from dataclasses import dataclass, field

from specdec.engine.logprobs import TokenLogprob
from specdec.engine.sequence import Request


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    text: str | None
    finish_reason: str
    # per draft position, as far as any step of the request drafted (K for the trained heads;
    # ngram / suffix: their longest match, [] for none): [at position 1, 2, ...]
    num_drafted: list[int]
    num_accepted: list[int]
    num_decode_steps: int  # target steps that verified drafts
    error: str | None = None  # what failed, when finish_reason is "error"
    # per generated token / per prompt token (the first: None), when SamplingParams asked
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verifying step: 1 + accepted / steps (1.0 = nothing accepted)."""
        return 1.0 + sum(self.num_accepted) / max(self.num_decode_steps, 1)

    @classmethod
    def of(cls, r: Request, tokenizer) -> "RequestOutput":
        """The output of request ``r`` (its text decoded when there is a tokenizer)."""
        out = r.output_token_ids
        text = tokenizer.decode(out) if tokenizer is not None else None
        return cls(r.request_id, r.token_ids[:r.num_prompt_tokens], out, text,
                   r.finish_reason, r.num_drafted, r.num_accepted, r.num_steps_decoding,
                   r.error, r.logprobs, r.prompt_logprobs)


STEP_GRAPHS = ("target", "draft")  # the step graphs of a StepRecord's new_graphs


@dataclass
class StepRecord:
    """What one engine step cost (host wall time, seconds)."""

    num_reqs: int
    num_tokens: int
    seconds: float
    draft_seconds: float  # of which in the drafter (host wall time)
    host_syncs: int | None  # in the device part of the step; None unless syncs are checked
    collectives: int  # DP collectives issued during the step
    new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> tokens emitted
    captured: bool = False  # the target step replayed a graph (compiled or captured)
    # step graph ("target", "draft": STEP_GRAPHS) -> graphs it compiled or captured in this
    # step (after start-up each one stalled the step); only graphs that made one
    new_graphs: dict[str, int] = field(default_factory=dict)
    num_spec_tokens: int = 0  # the step's K (with a K schedule, its batch size's)
    # async scheduling: launched before the previous step's results were read (its host
    # work ran while that step executed)
    overlapped: bool = False
