"""The OpenAI request schema (validated with pydantic), its range checks, and error bodies.

Fields beyond OpenAI's, as vLLM spells them: ``ignore_eos``, ``stop_token_ids``,
``return_token_ids``, ``prompt_logprobs``, ``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``include_stop_str_in_output`` and ``stream_options.continuous_usage_stats``;
``user`` (OpenAI's end-user id) is taken and changes nothing. A field of the wrong type or out
of range is HTTP 400 naming the field, and so is an unknown one (of /tokenize and /detokenize:
ignored). ``n`` samples per prompt are choices ``prompt index * n + i``. OpenAI and vLLM
sampling fields this server does not implement (``best_of`` > 1, ``logit_bias``, ``suffix``,
``echo`` on chat, ``response_format``) are a 400 naming the field unless their value is the
no-op one (null, 1, {}, "", ``{"type": "text"}``), never accepted and ignored. ``null`` for
a field means its default (OpenAI's schema allows it).

Log-probabilities are the target model's (log-softmax of its raw logits: before temperature
and top-p, as vLLM returns them by default): completions take ``logprobs: N`` (the sampled
token's and the N most likely per position) and ``echo`` (the prompt before the completion,
with its positions' log-probabilities when ``logprobs`` is set, the first one null); chat
takes ``logprobs: true`` and ``top_logprobs: N``; both take vLLM's ``prompt_logprobs: N``.
N is at most MAX_LOGPROBS.
"""

from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, ValidationError,
                      model_validator)

from specdec.engine.config import SEED_MAX
from specdec.engine.logprobs import MAX_LOGPROBS

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
    model_config = ConfigDict(extra="forbid", strict=True)  # an unknown field: 400 (parse)

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
    logprobs: int | bool | None = None  # completions: an int N; chat: true / false
    top_logprobs: int | None = None  # chat: N, with logprobs true
    echo: bool = False  # completions: the prompt comes first in the text (and logprobs)
    prompt_logprobs: int | None = None  # vLLM: choices[i].prompt_logprobs
    user: str | None = None  # OpenAI: the caller's end-user id, for its records; changes nothing
    # the engine's SamplingParams fields (ranges checked there: a 400 naming the field)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's sampling fields
    top_k: int | None = None  # None, 0, -1: every token
    min_p: float = 0.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    # not implemented: accepted only with the value that does nothing (see check_unsupported)
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    suffix: str | None = None
    response_format: dict | None = None

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [s for s in stop if isinstance(s, str)]

    def all_stop_token_ids(self) -> tuple[int, ...]:
        stop = self.stop if isinstance(self.stop, list) else []
        return tuple(self.stop_token_ids) + tuple(s for s in stop if isinstance(s, int))


class CompletionRequest(SamplingRequest):
    # one prompt (text or token ids) or several (each its own choice, in order)
    prompt: Text | list[int] | list[Text] | list[list[int]]

    def prompts(self) -> list:
        """The prompts: strings and token-id lists."""
        p = self.prompt
        return [p] if isinstance(p, str) or not p or isinstance(p[0], int) else list(p)

    def prompt_names(self) -> list[str]:
        """How errors name each prompt: ``prompt``, or ``prompt[i]`` when a list was given."""
        prompts = self.prompts()
        if len(prompts) == 1 and prompts[0] is self.prompt:
            return ["prompt"]
        return [f"prompt[{i}]" for i in range(len(prompts))]

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(N per output token, N per prompt token) the engine computes; None: none."""
        if self.logprobs is True:
            raise ApiError(400, f"logprobs=true: completions take an int 0..{MAX_LOGPROBS} "
                                "(the most likely tokens returned per position), or null",
                           "logprobs")
        if self.top_logprobs not in (None, 0):
            raise ApiError(400, f"top_logprobs={self.top_logprobs}: a chat field; completions "
                                "take logprobs=N", "top_logprobs")
        # false: chat's spelling of "none"
        out = check_logprobs("logprobs", None if self.logprobs is False else self.logprobs)
        prompt = check_logprobs("prompt_logprobs", self.prompt_logprobs)
        if self.echo and out is not None:  # the echoed prompt's positions
            prompt = max(out, prompt or 0)
        return out, prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    # chat.ROLES: "developer" is rendered as "system"; "tool" reaches the template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart]  # OpenAI's content parts: text only here
    tool_call_id: str | None = None  # a tool message's: the call it answers

    def as_dict(self) -> dict:
        """What the template renders (``chat.template_messages`` maps the roles)."""
        out = {"role": self.role, "content": self.text()}
        return out if self.tool_call_id is None else {**out, "tool_call_id": self.tool_call_id}

    def text(self) -> str:
        """Content parts joined with newlines, as vLLM joins text parts."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(N per output token, N per prompt token) the engine computes; None: none."""
        if self.logprobs is not None and not isinstance(self.logprobs, bool):
            raise ApiError(400, f"logprobs={self.logprobs}: chat takes true or false; the "
                                "number of most likely tokens goes in top_logprobs", "logprobs")
        if self.echo:
            raise ApiError(400, "echo=true: not supported on /v1/chat/completions; the prompt "
                                "is echoed by /v1/completions", "echo")
        top = check_logprobs("top_logprobs", self.top_logprobs)
        if top and not self.logprobs:
            raise ApiError(400, f"top_logprobs={top}: needs logprobs=true", "top_logprobs")
        out = (top or 0) if self.logprobs else None
        return out, check_logprobs("prompt_logprobs", self.prompt_logprobs)


def check_logprobs(name: str, n: int | None) -> int | None:
    if n is not None and not 0 <= n <= MAX_LOGPROBS:
        raise ApiError(400, f"{name}={n}: allowed 0 <= {name} <= {MAX_LOGPROBS}", name)
    return n


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a ``prompt`` (TokenizeCompletionRequest) or ``messages``
    (TokenizeChatRequest, rendered with the served chat template)."""

    model_config = ConfigDict(extra="ignore")  # unknown fields ignored, as before: no sampling
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # for a prompt; messages: false unless given (as vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model_config = ConfigDict(extra="ignore")
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
        if errors[0]["type"] == "extra_forbidden":
            raise ApiError(400, f"{field}: unknown field, not implemented here (got "
                                f"{short(errors[0]['input'])}){_fields_of(model, field)}",
                           field) from None
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


def _fields_of(model: type[_Strict], field: str) -> str:
    """"; the fields are: ..." for an unknown top-level field (a typo shows its fix)."""
    if "." in field:
        return ""
    return "; the fields are: " + ", ".join(f for f in model.model_fields if f not in NO_OP)


def _is_union_tag(part) -> bool:
    """pydantic puts the union member tried ("str", "list[int]") in error locations."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


# field -> the values that do nothing (accepted); anything else is refused by name
NO_OP = {"best_of": (None, 1), "logit_bias": (None, {}), "suffix": (None, ""),
         "response_format": (None, {"type": "text"})}
WHY = {"best_of": "only best_of=1 is supported (n samples: n)",
       "response_format": 'only {"type": "text"}: this server does not constrain its output'}


def check_unsupported(req: SamplingRequest) -> None:
    """OpenAI/vLLM fields the engine does not implement: a 400 naming the field, unless the
    value is the one that changes nothing (``best_of: 1``, ``logit_bias: {}``)."""
    for name, ok in NO_OP.items():
        value = getattr(req, name)
        if value not in ok:
            raise ApiError(400, f"{name}={short(value)}: not supported; "
                                f"{WHY.get(name, 'this server does not implement it')}", name)


def check_sampling(req: SamplingRequest, num_prompt_tokens: int, max_model_len: int,
                   vocab_size: int, default_max_tokens: int | None, prompt: str = "prompt") -> int:
    """Range checks that need the prompt (``prompt``: its name, e.g. "prompt[1]" of several);
    -> max_tokens (defaulted). ApiError(400) names the field."""
    if not 0 <= req.temperature <= MAX_TEMPERATURE:
        raise ApiError(400, f"temperature={req.temperature}: allowed 0 <= temperature <= "
                            f"{MAX_TEMPERATURE} (0 = greedy)", "temperature")
    if not 0 < req.top_p <= 1:
        raise ApiError(400, f"top_p={req.top_p}: allowed 0 < top_p <= 1", "top_p")
    check_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options: the options of a stream; allowed only with "
                            "stream=true", "stream_options")
    if req.seed is not None and not 0 <= req.seed <= SEED_MAX:
        raise ApiError(400, f"seed={req.seed}: allowed 0 <= seed <= {SEED_MAX}", "seed")
    if any(s == "" for s in req.stop_strings()):
        raise ApiError(400, "stop: stop strings must be non-empty", "stop")
    if bad := [t for t in req.all_stop_token_ids() if not 0 <= t < vocab_size]:
        raise ApiError(400, f"stop_token_ids: {bad} outside the vocabulary [0, {vocab_size})",
                       "stop_token_ids")
    if num_prompt_tokens >= max_model_len:
        raise ApiError(400, f"{prompt}: {num_prompt_tokens} tokens; it must be shorter than "
                            f"max_model_len={max_model_len}", "prompt")
    room = max_model_len - num_prompt_tokens
    max_tokens = req.max_tokens
    name = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, name = req.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    if not 1 <= max_tokens <= room:
        of = "" if prompt == "prompt" else f" of {prompt}"
        raise ApiError(400, f"{name}={max_tokens}: allowed 1 <= {name} <= {room} (max_model_len="
                            f"{max_model_len} - {num_prompt_tokens} prompt tokens{of})", name)
    return max_tokens


def check_prompt_length(prompt, max_model_len: int, max_token_chars: int,
                        name: str = "prompt") -> None:
    """Refuse a prompt that cannot fit before parsing or tokenizing it (both are slow on
    megabytes): a list of more than max_model_len ids, or a string longer than max_model_len
    tokens of the longest vocabulary entry could spell (times 4, for normalizers that fold
    characters, such as NFC). A list of prompts (strings or id lists): each, by its index."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        for i, p in enumerate(prompt):
            check_prompt_length(p, max_model_len, max_token_chars, f"{name}[{i}]")
        return
    if isinstance(prompt, list) and len(prompt) >= max_model_len:
        raise ApiError(400, f"{name}: {len(prompt)} token ids; it must be shorter than "
                            f"max_model_len={max_model_len}", "prompt")
    if isinstance(prompt, str) and len(prompt) > 4 * max_token_chars * max_model_len:
        raise ApiError(400, f"{name}: {len(prompt)} characters is more than max_model_len="
                            f"{max_model_len} tokens can hold (a token here spells at most "
                            f"{max_token_chars} characters)", "prompt")


def check_prompt_ids(ids: list[int], vocab_size: int, name: str = "prompt") -> None:
    if not ids:
        raise ApiError(400, f"{name}: empty; give at least one token", "prompt")
    if bad := [t for t in ids if not 0 <= t < vocab_size][:5]:
        raise ApiError(400, f"{name}: token ids {bad} outside the vocabulary [0, {vocab_size})",
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


MIN_LOGPROB = -9999.0  # vLLM's floor: JSON has no -inf


def token_text(tokenizer, token_id: int) -> str:
    """A token as the logprobs fields spell it: its text (special tokens too), or
    ``token_id:N`` without a tokenizer (vLLM's ``return_tokens_as_token_ids`` form)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(entries: list, token_ids: list[int], tokenizer, offset: int
                        ) -> tuple[dict, int]:
    """OpenAI's completions ``logprobs`` for these tokens (``entries``: a TokenLogprob each, or
    None for an echoed prompt's first token): ``tokens``, ``token_logprobs``, ``top_logprobs``
    (the token's own, then the N most likely: vLLM's order) and ``text_offset`` (from
    ``offset``, the characters before them); -> (that dict, the offset after them)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, e in zip(token_ids, entries):
        text = token_text(tokenizer, tok)
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(max(e.logprob, MIN_LOGPROB))
        top = {text: max(e.logprob, MIN_LOGPROB)}
        for t, lp in e.top:
            top.setdefault(token_text(tokenizer, t), max(lp, MIN_LOGPROB))
        out["top_logprobs"].append(top)
    return out, offset


def chat_logprobs(entries: list, tokenizer) -> list[dict]:
    """OpenAI's chat ``logprobs.content``: per token its text, log-probability, UTF-8 bytes and
    ``top_logprobs`` (the N most likely, best first)."""
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": max(logprob, MIN_LOGPROB),
                "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
            for e in entries]


def vllm_prompt_logprobs(entries: list, tokenizer) -> list:
    """vLLM's ``prompt_logprobs``: per prompt token (the first: null) a dict token id ->
    {logprob, rank, decoded_token} of the prompt token and the N most likely; None when the
    request ended before its prefill did."""
    if entries is None:
        return None
    out = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        one = {str(e.token_id): {"logprob": max(e.logprob, MIN_LOGPROB), "rank": e.rank,
                                 "decoded_token": token_text(tokenizer, e.token_id)}}
        for rank, (t, lp) in enumerate(e.top, 1):
            one.setdefault(str(t), {"logprob": max(lp, MIN_LOGPROB), "rank": rank,
                                    "decoded_token": token_text(tokenizer, t)})
        out.append(one)
    return out
