"""The OpenAI request schema (validated with pydantic), its range checks, and error bodies.

Fields beyond OpenAI's, as vLLM spells them: ``ignore_eos``, ``stop_token_ids``,
``return_token_ids`` and ``stream_options.continuous_usage_stats``. Unknown fields are
ignored; a known field of the wrong type or out of range is HTTP 400 naming the field.
OpenAI fields this server does not implement (``logprobs``, ``top_logprobs``, ``echo``,
``best_of`` > 1, vLLM's ``prompt_logprobs``, penalties, ``logit_bias``, ``suffix``) are a 400
naming the field unless their value is the no-op one (null, false, 0, 1, {}), never accepted
and ignored. ``null`` for a field means its default (OpenAI's schema allows it).
"""

from typing import Annotated, Literal

import numpy as np

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      model_validator)

from specdec.engine.config import SEED_MAX

MAX_TEMPERATURE = 2.0


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
             500: "internal_server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


ECHO_CHARS = 60  # an error message quotes at most this much of the input


def short(value) -> str:
    """``repr(value)`` cut to a short prefix: error bodies never echo a huge input back."""
    if isinstance(value, HugeInt):
        return repr(value)
    text = repr(value)
    if len(text) <= ECHO_CHARS:
        return text
    size = f"{len(value)} items" if isinstance(value, (list, dict, str)) else f"{len(text)} chars"
    return f"{text[:ECHO_CHARS]}... ({size})"


class HugeInt:
    """A JSON integer longer than Python parses (4300 digits): kept as a marker so the field
    that holds it fails validation by name (HTTP 400) instead of ``json.loads`` raising."""

    def __init__(self, digits: str):
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {len(self.digits.lstrip('-'))} digits"


def _valid_unicode(text: str) -> str:
    """A lone surrogate ("\\ud800" in JSON) is not text a tokenizer can take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"holds a lone surrogate {text[e.start]!r} at character {e.start}; "
                         "text must be valid Unicode") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """``"temperature": null`` (and any field with a non-null default) means the default."""
        if isinstance(data, dict):
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and fields[k].default is not None
                            and fields[k].is_required() is False)}
        return data


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
    stop: Text | list[Text | int] | None = None  # strings, and token ids
    stop_token_ids: list[int] = []
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    n: int = 1
    return_token_ids: bool = False  # vLLM: choices[i].token_ids (and prompt_token_ids)
    # not implemented: accepted only with the value that does nothing (see check_unsupported)
    logprobs: int | bool | None = None
    top_logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if isinstance(s, str)]

    def all_stop_token_ids(self) -> tuple[int, ...]:
        stop = self.stop if isinstance(self.stop, list) else []
        return tuple(self.stop_token_ids) + tuple(s for s in stop if isinstance(s, int))


class CompletionRequest(SamplingRequest):
    prompt: Text | list[int]


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: Text | list[TextPart]  # OpenAI's content parts: text only here

    def text(self) -> str:
        """Content parts joined with newlines, as vLLM joins text parts."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a ``prompt`` (TokenizeCompletionRequest) or ``messages``
    (TokenizeChatRequest, rendered with the served chat template)."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # vLLM's default for prompts; this server's for both
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


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
        # the union member tried first names the field; deeper errors say what is wrong inside
        msgs: dict[str, str] = {}  # message -> the first path it was found at
        for err in errors:
            at = field_of(err)
            if at == field or field is not None and (at or "").startswith(field + "."):
                msgs.setdefault(err["msg"], at)
        msgs = {m if at == field else f"{at}: {m}": None for m, at in list(msgs.items())[:3]}
        raise ApiError(400, f"{field}: {' or '.join(msgs)} (got {short(errors[0].get('input'))})",
                       field) from None
    except RecursionError:  # nesting that json.loads took but pydantic cannot walk
        raise ApiError(400, "the body is nested too deeply") from None


def _is_union_tag(part) -> bool:
    """pydantic puts the union member tried ("str", "list[int]") in error locations."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


# field -> the values that do nothing (accepted); anything else is refused by name
NO_OP = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (False,),
         "best_of": (None, 1), "prompt_logprobs": (None,), "presence_penalty": (0,),
         "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": (None, {}),
         "suffix": (None, "")}
WHY = {"logprobs": "log-probabilities are not returned by this server",
       "top_logprobs": "log-probabilities are not returned by this server",
       "echo": "the prompt is not echoed (and prompt log-probabilities are not computed)",
       "best_of": "only best_of=1 (= n) is supported",
       "prompt_logprobs": "prompt log-probabilities are not computed"}


def check_unsupported(req: SamplingRequest) -> None:
    """OpenAI/vLLM fields the engine does not implement: a 400 naming the field, unless the
    value is the one that changes nothing (``logprobs: null``, ``echo: false``, ``best_of: 1``)."""
    for name, ok in NO_OP.items():
        value = getattr(req, name)
        if value not in ok:
            raise ApiError(400, f"{name}={short(value)}: not supported; "
                                f"{WHY.get(name, 'this server does not implement it')}", name)


def greedy_top_p(top_p: float, vocab_size: int) -> bool:
    """top_p at or below 1/vocab keeps only the most likely token (it alone holds >= 1/V of the
    mass), which is greedy decoding; the engine's float32 filter would keep nothing once top_p
    rounds to 0, so such a request is served as greedy (temperature 0)."""
    return float(np.float32(top_p)) <= 1.0 / vocab_size


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
    check_unsupported(req)
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


def check_prompt_length(prompt, max_model_len: int, max_token_chars: int) -> None:
    """Refuse a prompt that cannot fit before parsing or tokenizing it (both are slow on
    megabytes): a list of more than max_model_len ids, or a string longer than max_model_len
    tokens of the longest vocabulary entry could spell (times 4, for normalizers that fold
    characters, such as NFC)."""
    if isinstance(prompt, list) and len(prompt) >= max_model_len:
        raise ApiError(400, f"prompt: {len(prompt)} token ids; it must be shorter than "
                            f"max_model_len={max_model_len}", "prompt")
    if isinstance(prompt, str) and len(prompt) > 4 * max_token_chars * max_model_len:
        raise ApiError(400, f"prompt: {len(prompt)} characters is more than max_model_len="
                            f"{max_model_len} tokens can hold (a token here spells at most "
                            f"{max_token_chars} characters)", "prompt")


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


def spec_decode_metrics(num_drafted: list[int], num_accepted: list[int], num_steps: int,
                        k: int) -> dict:
    """One request's speculative figures in vLLM's per-request summary shape (its response's
    ``metrics.speculative_decoding``), from the engine's counts per draft position
    (``num_accepted[j]``: the verifying steps that accepted at least j + 1 drafts, since
    drafts are accepted as a prefix). ``acceptance_histogram[j]``: steps that accepted
    exactly j of their drafts, j = 0..K."""
    drafted, accepted = sum(num_drafted), sum(num_accepted)
    at_least = [num_steps] + list(num_accepted) + [0] * (k + 1 - len(num_accepted))
    return {"num_spec_tokens": k, "num_spec_steps": num_steps, "num_draft_tokens": drafted,
            "num_accepted_draft_tokens": accepted,
            "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_acceptance_length": 1.0 + accepted / num_steps if num_steps else 1.0,
            "acceptance_histogram": [at_least[j] - at_least[j + 1] for j in range(k + 1)]}
