"""The OpenAI request schema (validated with pydantic), its range checks, and error bodies.

Fields beyond OpenAI's, as vLLM spells them: ``ignore_eos``, ``stop_token_ids``,
``return_token_ids`` and ``stream_options.continuous_usage_stats``. Unknown fields are
ignored; a known field of the wrong type or out of range is HTTP 400 naming the field.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specdec.engine.config import SEED_MAX

MAX_TEMPERATURE = 2.0


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "internal_server_error",
             503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (the harness counts tokens)


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default; 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str | int] | None = None  # strings, and token ids
    stop_token_ids: list[int] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    return_token_ids: bool = False  # vLLM: choices[i].token_ids (and prompt_token_ids)

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if isinstance(s, str)]

    def all_stop_token_ids(self) -> tuple[int, ...]:
        stop = self.stop if isinstance(self.stop, list) else []
        return tuple(self.stop_token_ids) + tuple(s for s in stop if isinstance(s, int))


class CompletionRequest(SamplingRequest):
    prompt: str | list[int]


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


def parse(model: type[_Strict], data) -> _Strict:
    """Validate a decoded JSON body; the first error becomes an ApiError(400) naming its field."""
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()

        def field_of(err):
            return ".".join(str(p) for p in err["loc"] if not _is_union_tag(p)) or None

        field = field_of(errors[0])
        msgs = dict.fromkeys(err["msg"] for err in errors if field_of(err) == field)
        raise ApiError(400, f"{field}: {' or '.join(msgs)} (got {errors[0].get('input')!r})",
                       field) from None


def _is_union_tag(part) -> bool:
    """pydantic puts the union member tried ("str", "list[int]") in error locations."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def check_sampling(req: SamplingRequest, num_prompt_tokens: int, max_model_len: int,
                   vocab_size: int, default_max_tokens: int | None) -> int:
    """Range checks that need the prompt; -> max_tokens (defaulted). ApiError(400) names the field."""
    if not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"temperature={req.temperature}: allowed 0 <= temperature <= "
                            f"{MAX_TEMPERATURE} (0 = greedy)", "temperature")
    if not 0 < req.top_p <= 1:
        raise ApiError(400, f"top_p={req.top_p}: allowed 0 < top_p <= 1", "top_p")
    if req.n != 1:
        raise ApiError(400, f"n={req.n}: only n=1 is supported", "n")
    if req.seed is not None and not 0 <= req.seed <= SEED_MAX:
        raise ApiError(400, f"seed={req.seed}: allowed 0 <= seed <= {SEED_MAX}", "seed")
    if any(s == "" for s in req.stop_strings()):
        raise ApiError(400, "stop: stop strings must be non-empty", "stop")
    if bad := [t for t in req.all_stop_token_ids() if not 0 <= t < vocab_size]:
        raise ApiError(400, f"stop_token_ids: {bad} outside the vocabulary [0, {vocab_size})",
                       "stop_token_ids")
    if num_prompt_tokens >= max_model_len:
        raise ApiError(400, f"prompt: {num_prompt_tokens} tokens; it must be shorter than "
                            f"max_model_len={max_model_len}", "prompt")
    room = max_model_len - num_prompt_tokens
    max_tokens = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if not 1 <= max_tokens <= room:
        raise ApiError(400, f"{name}={max_tokens}: allowed 1 <= {name} <= {room} (max_model_len="
                            f"{max_model_len} - {num_prompt_tokens} prompt tokens)", name)
    return max_tokens


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    if not ids:
        raise ApiError(400, "prompt: empty; give at least one token", "prompt")
    if bad := [t for t in ids if not 0 <= t < vocab_size][:5]:
        raise ApiError(400, f"prompt: token ids {bad} outside the vocabulary [0, {vocab_size})",
                       "prompt")


# ---- responses -----------------------------------------------------------------------------
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
