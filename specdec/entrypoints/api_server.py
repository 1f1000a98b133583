"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
and vLLM's /tokenize and /detokenize.

Nothing slow runs on the event loop: a body over ``max_request_bytes`` is a 413 before it is
read whole, a prompt that cannot fit max_model_len is refused before it is parsed or
tokenized, and tokenizing (and rendering a chat template) runs in a worker thread.

    specdec serve --method eagle3 -k 3 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
"""

import asyncio
import json
import re
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.async_engine import (AsyncEngine, EngineDeadError, QueueFullError,
                                             RequestHandle)
from specdec.entrypoints.protocol import (
    FINISH_REASONS, ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
    HugeInt, SamplingRequest, TokenizeRequest, check_prompt_ids, check_prompt_length,
    check_sampling, greedy_top_p, parse, spec_decode_metrics, usage)
from specdec.entrypoints.text import TextStream

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.2
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # --max-request-bytes
MAX_INT_DIGITS = 4000  # below Python's int parsing limit (4300 digits)


@dataclass
class ServedModel:
    """What the handlers need besides the engine."""

    name: str
    tokenizer: object  # tokenizers.Tokenizer or None (token ids only)
    chat_template: object  # messages -> prompt str
    max_model_len: int
    vocab_size: int
    max_token_chars: int = 64  # the longest vocabulary entry, in characters
    num_speculative_tokens: int = 0  # K of the engine (0: no speculation)
    # --per-request-spec-decode-metrics summary: each response carries its request's
    # ``metrics.speculative_decoding`` (vLLM's per-request summary)
    per_request_spec_metrics: bool = False


def build_app(engine: AsyncEngine, model: ServedModel, metrics=None,
              shutdown_timeout_s: float = 10.0,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The app; its lifespan starts the engine loop and stops it (drain, then abort).

    ``app.state.begin_shutdown()`` (called on SIGTERM, before uvicorn waits for connections)
    starts that drain at once, so requests still running after ``shutdown_timeout_s`` end
    with finish_reason "abort" while their connections are still open."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.stop(shutdown_timeout_s)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine, app.state.model, app.state.metrics = engine, model, metrics
    app.state.max_request_bytes = max_request_bytes
    app.state.begin_shutdown = lambda: asyncio.ensure_future(engine.stop(shutdown_timeout_s))

    async def body(request: Request, precheck_prompt: bool = False):
        raw = await read_body(request, app.state.max_request_bytes)
        if precheck_prompt and len(raw) > BIG_BODY_BYTES:  # json.loads would hold the loop
            n = top_level_list_len(raw, b'"prompt"')
            if n is not None:
                check_prompt_length([None] * n, model.max_model_len, model.max_token_chars)
        return decode_json(raw)

    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health():
        return {"status": "ok", "running": engine.num_running, "waiting": engine.num_waiting}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model.name, "object": "model", "created": 0,
                                            "owned_by": "specdec", "root": model.name,
                                            "max_model_len": model.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            raise ApiError(404, "metrics are off")
        return Response(metrics.render(), media_type=metrics.content_type)

    def precheck(data):
        """Before pydantic: a prompt too long to fit is refused without walking it."""
        if isinstance(data, dict):
            check_prompt_length(data.get("prompt"), model.max_model_len, model.max_token_chars)

    @app.post("/v1/completions")
    async def completions(request: Request):
        data = await body(request, precheck_prompt=True)
        precheck(data)
        req = parse(CompletionRequest, data)
        check_model(req.model)
        ids = await encode(model, req.prompt)
        return await serve(request, req, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await body(request))
        check_model(req.model)
        ids = await encode_chat(model, req.messages, add_generation_prompt=True)
        return await serve(request, req, ids, None, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: {"prompt" | "messages", "add_special_tokens", ...} -> {"count",
        "max_model_len", "tokens", "token_strs"}; the ids /v1/completions would feed."""
        data = await body(request)
        req = parse(TokenizeRequest, data)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "prompt: give exactly one of prompt or messages", "prompt")
        if model.tokenizer is None:
            raise ApiError(400, "prompt: this model has no tokenizer", "prompt")
        if req.prompt is not None:
            check_prompt_length(req.prompt, model.max_model_len, model.max_token_chars)
            ids = await asyncio.to_thread(
                lambda: model.tokenizer.encode(req.prompt,
                                               add_special_tokens=req.add_special_tokens).ids)
        else:
            ids = await encode_chat(model, req.messages, req.add_generation_prompt,
                                    req.add_special_tokens)
        strs = [model.tokenizer.id_to_token(t) for t in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": model.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's: {"tokens"} -> {"prompt"}."""
        req = parse(DetokenizeRequest, await body(request))
        check_model(req.model)
        if model.tokenizer is None:
            raise ApiError(400, "tokens: this model has no tokenizer", "tokens")
        if bad := [t for t in req.tokens if not 0 <= t < model.vocab_size][:5]:
            raise ApiError(400, f"tokens: ids {bad} outside the vocabulary "
                                f"[0, {model.vocab_size})", "tokens")
        return {"prompt": await asyncio.to_thread(model.tokenizer.decode, req.tokens)}

    def check_model(name):
        if name is not None and name != model.name:
            raise ApiError(404, f"model={name!r} is not served; this server serves "
                                f"{model.name!r}", "model")

    async def serve(request: Request, req: SamplingRequest, ids: list[int],
                    default_max_tokens: int | None, chat: bool):
        check_prompt_ids(ids, model.vocab_size)
        max_tokens = check_sampling(req, len(ids), model.max_model_len, model.vocab_size,
                                    default_max_tokens)
        temperature, top_p = req.temperature, req.top_p
        if greedy_top_p(top_p, model.vocab_size):  # keeps only the top token: greedy
            temperature, top_p = 0.0, 1.0
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=top_p, ignore_eos=req.ignore_eos,
                                stop_token_ids=req.all_stop_token_ids(), seed=req.seed)
        try:
            handle = engine.submit(ids, params)
        except QueueFullError as e:
            raise ApiError(503, str(e)) from None
        except EngineDeadError as e:
            raise ApiError(500, str(e)) from None
        gen = Generation(engine, handle, TextStream(model.tokenizer, req.stop_strings()))
        shape = (ChatShape if chat else CompletionShape)(model)
        if req.stream:
            return StreamingResponse(sse(gen, shape, req), media_type="text/event-stream")
        return JSONResponse(shape.response(await collect(gen, request), req))

    return app


BIG_BODY_BYTES = 2**20


def top_level_list_len(raw: bytes, key: bytes) -> int | None:
    """Items of a flat JSON list under a top-level ``key``, counted without parsing (parsing a
    million numbers holds the event loop for most of a second); None when not that shape."""
    at = raw.find(key)
    if at < 0 or raw.count(b"{", 0, at) - raw.count(b"}", 0, at) != 1 \
            or raw.count(b"[", 0, at) != raw.count(b"]", 0, at):
        return None
    rest = raw[at + len(key):at + len(key) + 64].lstrip()
    if not rest.startswith(b":") or not rest[1:].lstrip().startswith(b"["):
        return None
    start = raw.index(b"[", at)
    end = raw.find(b"]", start)
    if end < 0 or raw.find(b"[", start + 1, end) >= 0 or raw.find(b'"', start, end) >= 0:
        return None
    return raw.count(b",", start, end) + 1 if raw[start + 1:end].strip() else 0


async def read_body(request: Request, limit: int) -> bytes:
    """The body; 413 past ``limit`` bytes (from Content-Length, else while reading)."""
    too_big = (f"the request body is larger than {limit} bytes, the most this server "
               f"accepts (--max-request-bytes)")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, too_big.replace("larger than", f"{int(declared)} bytes, more than"))
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise ApiError(413, too_big)
        parts.append(part)
    return b"".join(parts)


def decode_json(raw: bytes):
    try:
        return json.loads(raw)
    except RecursionError:
        field = deep_field(raw)
        raise ApiError(400, f"{field or 'the body'}: JSON nested too deeply", field) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    except ValueError:  # an integer past Python's digit limit: let the field's check name it
        try:
            return json.loads(raw, parse_int=lambda s: HugeInt(s) if len(s) > MAX_INT_DIGITS
                              else int(s))
        except ValueError as e:
            raise ApiError(400, f"the body is not valid JSON: {e}") from None


_JSON_TOKENS = re.compile(rb'"(?:[^"\\]|\\.)*"\s*:?|[\[\]{}]')
MAX_SCAN_DEPTH = 256


def deep_field(raw: bytes) -> str | None:
    """The top-level key whose value nests past MAX_SCAN_DEPTH (None if the body itself)."""
    depth, key = 0, None
    for m in _JSON_TOKENS.finditer(raw):
        tok = m.group()
        if tok in (b"{", b"["):
            depth += 1
            if depth > MAX_SCAN_DEPTH:
                return key
        elif tok in (b"}", b"]"):
            depth -= 1
        elif depth == 1 and tok.endswith(b":"):
            try:
                key = json.loads(tok[:-1])
            except ValueError:
                key = None
    return None


async def encode(model: ServedModel, prompt) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if model.tokenizer is None:
        raise ApiError(400, "prompt: a string needs a tokenizer; this model has none, send "
                            "token ids", "prompt")
    return await asyncio.to_thread(lambda: model.tokenizer.encode(prompt).ids)


async def encode_chat(model: ServedModel, messages, add_generation_prompt: bool = True,
                      add_special_tokens: bool = True) -> list[int]:
    """Render the chat template and tokenize, off the event loop; too long a render is refused
    before tokenizing."""
    if model.tokenizer is None:
        raise ApiError(400, "messages: the model has no tokenizer; use /v1/completions "
                            "with token ids", "messages")
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    if sum(len(m["content"]) for m in plain) > 4 * model.max_token_chars * model.max_model_len:
        raise ApiError(400, f"messages: more characters than max_model_len={model.max_model_len}"
                            f" tokens can hold", "messages")

    def work():
        prompt = model.chat_template(plain, add_generation_prompt=add_generation_prompt)
        return model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids

    return await asyncio.to_thread(work)


# ---- one request's tokens ------------------------------------------------------------------
@dataclass
class Delta:
    """One engine step's worth of output for one request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # OpenAI's: "stop", "length", or None while running


class Generation:
    """Async iterator of Deltas; a stop string or an early close aborts the engine request."""

    def __init__(self, engine: AsyncEngine, handle: RequestHandle, text: TextStream):
        self.engine, self.handle, self.text = engine, handle, text
        self.id = uuid.uuid4().hex
        self.created = int(time.time())
        self.finish_reason: str | None = None  # OpenAI's, once finished
        self.finished = False
        self.stats = None  # FinishStats, from the engine's last chunk

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.handle.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.text.token_ids)

    async def __aiter__(self):
        try:
            while not self.finished:
                chunk = await self.handle.next_chunk()
                if chunk.error is not None:
                    self.finished = True
                    raise ApiError(500, chunk.error)
                done = chunk.finish_reason is not None
                self.stats = chunk.stats or self.stats
                text = self.text.add(chunk.token_ids, final=done)
                reason = FINISH_REASONS[chunk.finish_reason] if done else None
                if self.text.stopped and not done:
                    reason = "stop"
                    self.engine.abort(self.handle.request_id)
                self.finish_reason, self.finished = reason, reason is not None
                yield Delta(text, chunk.token_ids, reason)
        finally:
            if not self.finished:  # the client went away, or the task was cancelled
                self.engine.abort(self.handle.request_id)


async def collect(gen: Generation, request: Request) -> Generation:
    """Run a generation to its end; a client that disconnects meanwhile aborts it."""
    async def drain():
        async for _ in gen:
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()  # re-raises an engine error as ApiError(500)
                return gen
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()


async def sse(gen: Generation, shape, req: SamplingRequest):
    """``data: {chunk}`` per step, then the usage chunk when asked, then ``data: [DONE]``."""
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts.continuous_usage_stats
    first = True
    try:
        async for delta in gen:
            chunk = shape.chunk(gen, delta, first, req)
            if delta.finish_reason is not None and (metrics := shape.spec_metrics(gen)):
                chunk["metrics"] = metrics  # on the chunk that ends the request
            if include_usage:
                chunk["usage"] = (usage(gen.num_prompt_tokens, gen.num_output_tokens)
                                  if continuous else None)
            first = False
            yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            yield f"data: {json.dumps(shape.usage_chunk(gen))}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    yield "data: [DONE]\n\n"


# ---- the two response shapes ---------------------------------------------------------------
class CompletionShape:
    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: ServedModel):
        self.model_name = model.name
        self.k = model.num_speculative_tokens
        self.with_spec_metrics = model.per_request_spec_metrics

    def spec_metrics(self, gen: Generation) -> dict | None:
        """``{"speculative_decoding": ...}`` of a finished request when the server was asked
        for per-request metrics (and the engine sent its counts), else None."""
        if not self.with_spec_metrics or gen.stats is None:
            return None
        s = gen.stats
        return {"speculative_decoding": spec_decode_metrics(
            s.num_drafted, s.num_accepted, s.num_steps_decoding, self.k)}

    def _envelope(self, gen: Generation, obj: str, choices: list) -> dict:
        return {"id": f"cmpl-{gen.id}", "object": obj, "created": gen.created,
                "model": self.model_name, "choices": choices}

    def response(self, gen: Generation, req: SamplingRequest) -> dict:
        choice = self.final_choice(gen)
        if req.return_token_ids:
            choice["token_ids"] = gen.text.token_ids
            choice["prompt_token_ids"] = gen.handle.prompt_token_ids
        out = self._envelope(gen, self.object, [choice])
        out["usage"] = usage(gen.num_prompt_tokens, gen.num_output_tokens)
        if (metrics := self.spec_metrics(gen)) is not None:
            out["metrics"] = metrics
        return out

    def final_choice(self, gen: Generation) -> dict:
        return {"index": 0, "text": gen.text.text, "logprobs": None,
                "finish_reason": gen.finish_reason}

    def chunk(self, gen: Generation, delta: Delta, first: bool, req: SamplingRequest) -> dict:
        choice = self.chunk_choice(delta, first)
        if req.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return self._envelope(gen, self.chunk_object, [choice])

    def chunk_choice(self, delta: Delta, first: bool) -> dict:
        return {"index": 0, "text": delta.text, "logprobs": None,
                "finish_reason": delta.finish_reason}

    def usage_chunk(self, gen: Generation) -> dict:
        out = self._envelope(gen, self.chunk_object, [])
        out["usage"] = usage(gen.num_prompt_tokens, gen.num_output_tokens)
        return out


class ChatShape(CompletionShape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def _envelope(self, gen: Generation, obj: str, choices: list) -> dict:
        return {**super()._envelope(gen, obj, choices), "id": f"chatcmpl-{gen.id}"}

    def final_choice(self, gen: Generation) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": gen.text.text},
                "logprobs": None, "finish_reason": gen.finish_reason}

    def chunk_choice(self, delta: Delta, first: bool) -> dict:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {"index": 0, "delta": content, "logprobs": None,
                "finish_reason": delta.finish_reason}
