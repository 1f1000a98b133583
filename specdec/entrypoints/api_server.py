"""The FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

    specdec serve --method eagle3 -k 3 --port 8000
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
"""

import asyncio
import json
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.async_engine import AsyncEngine, QueueFullError, RequestHandle
from specdec.entrypoints.protocol import (
    FINISH_REASONS, ApiError, ChatCompletionRequest, CompletionRequest, SamplingRequest,
    check_prompt_ids, check_sampling, parse, usage)
from specdec.entrypoints.text import TextStream

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.2


@dataclass
class ServedModel:
    """What the handlers need besides the engine."""

    name: str
    tokenizer: object  # tokenizers.Tokenizer or None (token ids only)
    chat_template: object  # messages -> prompt str
    max_model_len: int
    vocab_size: int


def build_app(engine: AsyncEngine, model: ServedModel, metrics=None,
              shutdown_timeout_s: float = 10.0) -> FastAPI:
    """The app; its lifespan starts the engine loop and stops it (drain, then abort)."""

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.stop(shutdown_timeout_s)

    app = FastAPI(title="specdec", lifespan=lifespan)
    app.state.engine, app.state.model, app.state.metrics = engine, model, metrics

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

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await json_body(request))
        ids = encode(model, req.prompt)
        return await serve(request, req, ids, COMPLETIONS_DEFAULT_MAX_TOKENS, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse(ChatCompletionRequest, await json_body(request))
        prompt = model.chat_template([m.model_dump() for m in req.messages])
        if model.tokenizer is None:
            raise ApiError(400, "messages: the model has no tokenizer; use /v1/completions "
                                "with token ids", "messages")
        return await serve(request, req, model.tokenizer.encode(prompt).ids, None, chat=True)

    async def serve(request: Request, req: SamplingRequest, ids: list[int],
                    default_max_tokens: int | None, chat: bool):
        if req.model is not None and req.model != model.name:
            raise ApiError(404, f"model={req.model!r} is not served; this server serves "
                                f"{model.name!r}", "model")
        check_prompt_ids(ids, model.vocab_size)
        max_tokens = check_sampling(req, len(ids), model.max_model_len, model.vocab_size,
                                    default_max_tokens)
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature,
                                top_p=req.top_p, ignore_eos=req.ignore_eos,
                                stop_token_ids=req.all_stop_token_ids(), seed=req.seed)
        try:
            handle = engine.submit(ids, params)
        except QueueFullError as e:
            raise ApiError(503, str(e)) from None
        gen = Generation(engine, handle, TextStream(model.tokenizer, req.stop_strings()))
        shape = ChatShape(model.name) if chat else CompletionShape(model.name)
        if req.stream:
            return StreamingResponse(sse(gen, shape, req), media_type="text/event-stream")
        return JSONResponse(shape.response(await collect(gen, request), req))

    return app


async def json_body(request: Request):
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None


def encode(model: ServedModel, prompt) -> list[int]:
    if isinstance(prompt, list):
        return prompt
    if model.tokenizer is None:
        raise ApiError(400, "prompt: a string needs a tokenizer; this model has none, send "
                            "token ids", "prompt")
    return model.tokenizer.encode(prompt).ids


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

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.handle.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.text.token_ids)

    async def __aiter__(self):
        try:
            while not self.finished:
                chunk = await self.handle.chunks.get()
                if chunk.error is not None:
                    self.finished = True
                    raise ApiError(500, chunk.error)
                done = chunk.finish_reason is not None
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

    def __init__(self, model_name: str):
        self.model_name = model_name

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
