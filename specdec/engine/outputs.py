"""What the engine returns: a finished request's ``RequestOutput`` and a step's ``StepRecord``."""

from dataclasses import dataclass, field

from specdec.engine.logprobs import TokenLogprob
from specdec.engine.sequence import Request


@dataclass
class CompletionOutput:
    """One sample of a request, as vLLM's ``CompletionOutput`` (one per request here: n = 1)."""

    index: int  # the sample's index among the request's outputs (0)
    text: str | None  # the generated text (None: the model has no tokenizer)
    token_ids: list[int]  # the generated tokens
    # the sum of the chosen tokens' log-probabilities (natural log, the target's raw
    # logits) when SamplingParams.logprobs asked for them, else None (as vLLM)
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None  # one per generated token, when asked
    # "eos", "stop" (a stop_token_ids token, a stop string, or a caller's: abort_request),
    # "length", "abort" or "error"
    finish_reason: str | None
    # the stop token id or stop string (SamplingParams.stop) that ended it; None otherwise
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """A finished request, in vLLM's shape (``outputs[0].text``, ``prompt_token_ids``, ...)
    plus the speculation figures; ``text``, ``token_ids``, ``finish_reason``, ``logprobs``,
    ``cumulative_logprob`` and ``stop_reason`` are read from ``outputs[0]``."""

    request_id: str
    prompt: str | None  # the prompt's text (None: it was given as token ids)
    prompt_token_ids: list[int]
    # per prompt token (the first: None), when SamplingParams.prompt_logprobs asked
    prompt_logprobs: list[TokenLogprob | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True
    # per draft position, as far as any step of the request drafted (K for the trained heads;
    # ngram / suffix: their longest match, [] for none): [at position 1, 2, ...]
    num_drafted: list[int] = field(default_factory=list)
    num_accepted: list[int] = field(default_factory=list)
    num_decode_steps: int = 0  # target steps that verified drafts
    error: str | None = None  # what failed, when finish_reason is "error"

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs

    @property
    def cumulative_logprob(self) -> float | None:
        return self.outputs[0].cumulative_logprob

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per verifying step: 1 + accepted / steps (1.0 = nothing accepted)."""
        return 1.0 + sum(self.num_accepted) / max(self.num_decode_steps, 1)

    @classmethod
    def of(cls, r: Request, tokenizer, prompt: str | None = None) -> "RequestOutput":
        """The output of request ``r`` (its text decoded when there is a tokenizer)."""
        out = r.output_token_ids
        # as vLLM, the eos or stop_token_ids id that ended it has no text in the output
        shown = (out[:-1] if r.finish_reason in ("eos", "stop") and r.stop_reason is None
                 and not r.params.include_stop_str_in_output else out)
        text = tokenizer.decode(shown) if tokenizer is not None else None
        cumulative = (sum(t.logprob for t in r.logprobs) if r.logprobs is not None
                      else None)
        stop = (out[-1] if r.finish_reason == "stop" and out
                and out[-1] in r.params.stop_token_ids else None)
        if r.stop_reason is not None:  # a stop string: the text ends at it (or after it)
            text, stop = r.text_stream.text, r.stop_reason
        sample = CompletionOutput(0, text, out, cumulative, r.logprobs, r.finish_reason, stop)
        return cls(r.request_id, prompt, r.token_ids[:r.num_prompt_tokens], r.prompt_logprobs,
                   [sample], True, r.num_drafted, r.num_accepted, r.num_steps_decoding,
                   r.error)


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
    # prefix cache: prompt tokens of the requests the step admitted, and how many of them
    # were found cached (vLLM's prefix_cache_queries / prefix_cache_hits)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
