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
from starlette.requests import ClientDisconnect

from specdec.engine.parallel_sampling import fan_out
from specdec.engine.sequence import SamplingParams
from specdec.engine.text_stream import TextStream
from specdec.entrypoints.async_engine import (AsyncEngine, EngineDeadError, QueueFullError,
                                             RequestHandle)
from specdec.entrypoints.chat import ChatTemplateError, template_messages
from specdec.entrypoints.protocol import (
    FINISH_REASONS, ApiError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
    HugeInt, SamplingRequest, TokenizeRequest, chat_logprobs, check_prompt_ids,
    check_prompt_length, check_sampling, completion_logprobs, parse,
    spec_decode_metrics, usage, vllm_prompt_logprobs)

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
    tokenizer_info: dict | None = None  # GET /tokenizer_info (None: no tokenizer)


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

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request, e: ClientDisconnect):
        """The client left before its request body arrived: nothing was queued, nobody
        reads an answer (499, nginx's "client closed request"), and it is no server error
        (unhandled, uvicorn logged "Exception in ASGI application" with a traceback)."""
        return Response(status_code=499)

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
        """Before pydantic: a prompt too long to fit is refused without walking it (each of
        a list of prompts)."""
        if isinstance(data, dict):
            check_prompt_length(data.get("prompt"), model.max_model_len, model.max_token_chars)

    @app.post("/v1/completions")
    async def completions(request: Request):
        """One prompt or several (a string, token ids, or a list of either: each its own
        engine request and choice, in order; usage summed)."""
        data = await body(request, precheck_prompt=True)
        precheck(data)
        req = parse(CompletionRequest, data)
        check_model(req.model)
        prompts, names = req.prompts(), req.prompt_names()
        ids = [await encode(model, p, name) for p, name in zip(prompts, names)]
        return await serve(request, req, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, chat=False,
                           prompts_given=prompts, names=names)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await body(request))
        check_model(req.model)
        ids = await encode_chat(model, req.messages, add_generation_prompt=True)
        return await serve(request, req, [ids], None, chat=True)

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the tokenizer's configuration (special tokens, chat template,
        model_max_length), which evaluation clients read before tokenizing remotely."""
        if model.tokenizer_info is None:
            raise ApiError(404, "this model has no tokenizer")
        return model.tokenizer_info

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
        else:  # vLLM's TokenizeChatRequest: no special tokens beyond the template's by default
            given = "add_special_tokens" in req.model_fields_set
            ids = await encode_chat(model, req.messages, req.add_generation_prompt,
                                    given and req.add_special_tokens)
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

    async def serve(request: Request, req: SamplingRequest, prompts: list[list[int]],
                    default_max_tokens: int | None, chat: bool, prompts_given=None,
                    names: list[str] = ("prompt",)):
        """Check every prompt (token ids), then submit one engine request each (all or
        none); ``prompts_given``: the prompts as the request gave them (echo's text);
        ``names``: how errors name each prompt."""
        logprobs, prompt_logprobs = req.logprob_counts()
        params = []
        for ids, name in zip(prompts, names):
            check_prompt_ids(ids, model.vocab_size, name)
            max_tokens = check_sampling(req, len(ids), model.max_model_len, model.vocab_size,
                                        default_max_tokens, name)
            params.append(sampling_params(req, max_tokens, logprobs, prompt_logprobs))
        echoed = [None] * len(prompts)
        if req.echo:  # the prompt as given, or its tokens' text
            echoed = [p if isinstance(p, str) else await asyncio.to_thread(
                decode, model, ids) for p, ids in zip(prompts_given, prompts)]
        # n samples of each prompt: choices prompt * n + i (sample i seeded seed + i)
        ids, params, echoed, _ = fan_out(prompts, params, echoed)
        if len(ids) > engine.capacity:  # never admitted, however long the client retries
            raise ApiError(400, f"n: {len(prompts)} prompt(s) x n={req.n} = {len(ids)} engine "
                                f"requests; the server admits at most {engine.capacity} at "
                                f"once (max_num_seqs={engine.max_num_seqs} + max_waiting="
                                f"{engine.max_waiting})", "n")
        handles = []
        try:
            for x, p in zip(ids, params):
                handles.append(engine.submit(x, p))
        except (QueueFullError, EngineDeadError) as e:
            for h in handles:
                engine.abort(h.request_id)
            raise ApiError(503 if isinstance(e, QueueFullError) else 500, str(e)) from None
        gens = [Generation(engine, h, TextStream(model.tokenizer, req.stop_strings(),
                                                 req.include_stop_str_in_output,
                                                 req.min_tokens), i, e,
                           wait_stats=model.per_request_spec_metrics)
                for i, (h, e) in enumerate(zip(handles, echoed))]
        shape = (ChatShape if chat else CompletionShape)(model, req)
        if req.stream:
            return StreamingResponse(sse(gens, shape, req), media_type="text/event-stream")
        return JSONResponse(shape.response(await collect(gens, request)))

    return app


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    """The engine's SamplingParams of a request (its stop strings stay here: ``TextStream``);
    a value SamplingParams refuses is a 400 naming the field."""
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
            ignore_eos=req.ignore_eos, stop_token_ids=req.all_stop_token_ids(), seed=req.seed,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, n=req.n,
            top_k=req.top_k or 0, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            min_tokens=req.min_tokens)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), re.match(r"\w*", str(e)).group()) from None


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


async def encode(model: ServedModel, prompt, name: str = "prompt") -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if model.tokenizer is None:
        raise ApiError(400, f"{name}: a string needs a tokenizer; this model has none, send "
                            "token ids", "prompt")
    return await asyncio.to_thread(lambda: model.tokenizer.encode(prompt).ids)


def decode(model: ServedModel, ids: list[int]) -> str:
    """Token ids' text ("" without a tokenizer: the ids are the output then)."""
    return model.tokenizer.decode(ids) if model.tokenizer is not None else ""


async def encode_chat(model: ServedModel, messages, add_generation_prompt: bool = True,
                      add_special_tokens: bool = False) -> list[int]:
    """Render the chat template and tokenize, off the event loop; too long a render is refused
    before tokenizing. As transformers' ``apply_chat_template(tokenize=True)``: the template
    writes the special tokens (BOS...), so none is added again unless ``add_special_tokens``.
    A template that refuses the messages (its ``raise_exception``) or fails on them is a 400."""
    if model.tokenizer is None:
        raise ApiError(400, "messages: the model has no tokenizer; use /v1/completions "
                            "with token ids", "messages")
    try:
        plain = template_messages("messages", [m.as_dict() for m in messages])
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), "messages") from None
    if sum(len(m["content"]) for m in plain) > 4 * model.max_token_chars * model.max_model_len:
        raise ApiError(400, f"messages: more characters than max_model_len={model.max_model_len}"
                            f" tokens can hold", "messages")

    def work():
        prompt = model.chat_template(plain, add_generation_prompt=add_generation_prompt)
        return model.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids

    try:
        return await asyncio.to_thread(work)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: rendering the model's chat template failed: {e}",
                       "messages") from None


# ---- one request's tokens ------------------------------------------------------------------
@dataclass
class Delta:
    """One engine step's worth of output for one request."""

    text: str
    token_ids: list[int]
    finish_reason: str | None  # OpenAI's: "stop", "length", or None while running
    logprobs: list | None = None  # a TokenLogprob per token, when asked


class Generation:
    """Async iterator of Deltas for choice ``index``; a stop string or an early close ends the
    engine request. ``echo``: the prompt text returned before the completion (or None).
    ``wait_stats``: a request ended by a stop string still gets the engine's counts of it
    (per-request metrics), its last Delta waiting for them."""

    def __init__(self, engine: AsyncEngine, handle: RequestHandle, text: TextStream,
                 index: int = 0, echo: str | None = None, wait_stats: bool = False):
        self.engine, self.handle, self.text = engine, handle, text
        self.index, self.echo, self.wait_stats = index, echo, wait_stats
        self.finish_reason: str | None = None  # OpenAI's, once finished
        self.finished = False
        self.stats = None  # FinishStats, from the engine's last chunk
        self.logprobs: list = []  # TokenLogprob per kept output token, when asked
        self.prompt_logprobs: list | None = None  # per prompt token (first None), when asked
        self.text_offset = 0  # characters of the logprobs' tokens so far (completions)

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
                before = len(self.text.token_ids)
                text = self.text.add(chunk.token_ids, final=done,
                                     stop_token=chunk.finish_reason in ("eos", "stop"))
                kept = len(self.text.token_ids) - before  # none past a stop string
                logprobs = chunk.logprobs[:kept] if chunk.logprobs is not None else None
                self.logprobs += logprobs or []
                if chunk.prompt_logprobs is not None:
                    self.prompt_logprobs = chunk.prompt_logprobs
                reason = FINISH_REASONS[chunk.finish_reason] if done else None
                if self.text.stopped:
                    reason = "stop"
                    if not done:
                        await self._stop()
                self.finish_reason, self.finished = reason, reason is not None
                yield Delta(text, chunk.token_ids[:kept], reason, logprobs)
        finally:
            self.close()

    async def _stop(self) -> None:
        """End the engine request at a stop string (the engine counts it as stopped, not
        aborted); with ``wait_stats``, read on to the engine's last chunk of it, for its
        counts (tokens past the stop are dropped)."""
        self.engine.abort(self.handle.request_id, "stop", await_stats=self.wait_stats)
        while self.wait_stats:
            chunk = await self.handle.next_chunk()
            if chunk.finish_reason is not None or chunk.error is not None:
                self.stats = chunk.stats
                return

    def close(self) -> None:
        """End the engine request if it still runs (the client went away, a task was
        cancelled, or a stream of several choices ended early)."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.handle.request_id)


async def collect(gens: list[Generation], request: Request) -> list[Generation]:
    """Run generations to their end; a client that disconnects meanwhile aborts them."""
    async def drain(gen):
        async for _ in gen:
            pass

    task = asyncio.ensure_future(asyncio.gather(*(drain(g) for g in gens)))
    # cancelled at a disconnect, the gather ends with a CancelledError nobody awaits: read
    # here, else asyncio logs it with a traceback ("exception was never retrieved")
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()  # re-raises an engine error as ApiError(500)
                return gens
            if await request.is_disconnected():
                task.cancel()
                raise ApiError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
        for g in gens:
            g.close()


async def sse(gens: list[Generation], shape, req: SamplingRequest):
    """``data: {chunk}`` per step, choice after choice (several prompts run together in the
    engine; their chunks are written in prompt order), then the usage chunk when asked, then
    ``data: [DONE]``."""
    opts = req.stream_options
    include_usage = opts is not None and opts.include_usage
    continuous = include_usage and opts.continuous_usage_stats
    try:
        for gen in gens:
            first = True
            async for delta in gen:
                chunk = shape.chunk(gen, delta, first)
                if delta.finish_reason is not None and (metrics := shape.spec_metrics(gen)):
                    chunk["metrics"] = metrics  # on the chunk that ends the request
                if include_usage:
                    chunk["usage"] = (usage(gen.num_prompt_tokens, gen.num_output_tokens)
                                      if continuous else None)
                first = False
                yield f"data: {json.dumps(chunk)}\n\n"
        if include_usage:
            yield f"data: {json.dumps(shape.usage_chunk(gens))}\n\n"
    except ApiError as e:
        yield f"data: {json.dumps(e.body())}\n\n"
    finally:
        for g in gens:
            g.close()
    yield "data: [DONE]\n\n"


# ---- the two response shapes ---------------------------------------------------------------
class CompletionShape:
    object, chunk_object = "text_completion", "text_completion"

    def __init__(self, model: ServedModel, req: SamplingRequest):
        self.model_name = model.name
        self.tokenizer = model.tokenizer
        self.k = model.num_speculative_tokens
        self.with_spec_metrics = model.per_request_spec_metrics
        self.req = req
        self.logprobs, self.prompt_logprobs = req.logprob_counts()
        self.id = uuid.uuid4().hex  # the response's (every choice and chunk of it)
        self.created = int(time.time())

    def spec_metrics(self, gen: Generation) -> dict | None:
        """``{"speculative_decoding": ...}`` of a finished request when the server was asked
        for per-request metrics (and the engine sent its counts), else None."""
        if not self.with_spec_metrics or gen.stats is None:
            return None
        s = gen.stats
        return {"speculative_decoding": spec_decode_metrics(
            s.num_drafted, s.num_accepted, s.num_steps_decoding, self.k)}

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": f"cmpl-{self.id}", "object": obj, "created": self.created,
                "model": self.model_name, "choices": choices}

    def response(self, gens: list[Generation]) -> dict:
        """The whole response: a choice per prompt; usage summed; ``metrics`` (when on) at the
        top for one prompt, in each choice for several."""
        choices = []
        for gen in gens:
            choice = self.final_choice(gen)
            if self.req.return_token_ids:
                choice["token_ids"] = gen.text.token_ids
                choice["prompt_token_ids"] = gen.handle.prompt_token_ids
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(gen.prompt_logprobs,
                                                                 self.tokenizer)
            if len(gens) > 1 and (metrics := self.spec_metrics(gen)) is not None:
                choice["metrics"] = metrics
            choices.append(choice)
        out = self._envelope(self.object, choices)
        out["usage"] = self._usage(gens)
        if len(gens) == 1 and (metrics := self.spec_metrics(gens[0])) is not None:
            out["metrics"] = metrics
        return out

    def _usage(self, gens: list[Generation]) -> dict:
        """Each prompt's tokens once (its n samples, choices prompt * n + i, share it: as
        OpenAI and vLLM count), and every sample's output tokens."""
        return usage(sum(g.num_prompt_tokens for g in gens[::self.req.n]),
                     sum(g.num_output_tokens for g in gens))

    def final_choice(self, gen: Generation) -> dict:
        return {"index": gen.index, "text": (gen.echo or "") + gen.text.text,
                "logprobs": self._logprobs(gen, gen.text.token_ids, gen.logprobs, True),
                "finish_reason": gen.finish_reason}

    def _logprobs(self, gen: Generation, token_ids: list[int], entries: list | None,
                  first: bool) -> dict | None:
        """Completions' logprobs of these tokens (with the echoed prompt's before them on the
        choice's first chunk), text offsets continuing from the previous chunk's."""
        if self.logprobs is None:
            return None
        if first and gen.echo is not None:
            prompt = gen.handle.prompt_token_ids
            token_ids = prompt + token_ids  # no prompt logprobs: aborted before its prefill
            entries = (gen.prompt_logprobs or [None] * len(prompt)) + entries
        out, gen.text_offset = completion_logprobs(entries, token_ids, self.tokenizer,
                                                   gen.text_offset)
        return out

    def chunk(self, gen: Generation, delta: Delta, first: bool) -> dict:
        choice = self.chunk_choice(gen, delta, first)
        if self.req.return_token_ids:
            choice["token_ids"] = delta.token_ids
        if first and self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(gen.prompt_logprobs,
                                                             self.tokenizer)
        return self._envelope(self.chunk_object, [choice])

    def chunk_choice(self, gen: Generation, delta: Delta, first: bool) -> dict:
        echo = (gen.echo or "") if first else ""
        return {"index": gen.index, "text": echo + delta.text,
                "logprobs": self._logprobs(gen, delta.token_ids, delta.logprobs or [], first),
                "finish_reason": delta.finish_reason}

    def usage_chunk(self, gens: list[Generation]) -> dict:
        out = self._envelope(self.chunk_object, [])
        out["usage"] = self._usage(gens)
        return out


class ChatShape(CompletionShape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def _envelope(self, obj: str, choices: list) -> dict:
        return {**super()._envelope(obj, choices), "id": f"chatcmpl-{self.id}"}

    def _chat_logprobs(self, entries: list | None) -> dict | None:
        if self.logprobs is None:
            return None
        return {"content": chat_logprobs(entries or [], self.tokenizer)}

    def response(self, gens: list[Generation]) -> dict:
        """As completions', with vLLM's ``prompt_logprobs`` at the top (one prompt)."""
        out = super().response(gens)
        if self.req.prompt_logprobs is not None:
            out["prompt_logprobs"] = out["choices"][0].pop("prompt_logprobs")
        return out

    def final_choice(self, gen: Generation) -> dict:
        return {"index": gen.index, "message": {"role": "assistant", "content": gen.text.text},
                "logprobs": self._chat_logprobs(gen.logprobs),
                "finish_reason": gen.finish_reason}

    def chunk_choice(self, gen: Generation, delta: Delta, first: bool) -> dict:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        return {"index": gen.index, "delta": content,
                "logprobs": self._chat_logprobs(delta.logprobs),
                "finish_reason": delta.finish_reason}
