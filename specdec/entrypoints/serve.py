"""``specdec serve``: flags, the engine process and the app, running uvicorn (SIGTERM drains).

fastapi/uvicorn/prometheus-client are imported only when the command runs (the ``serve`` extra).
"""

import argparse
import errno
import json
import signal
import socket
import sys
from pathlib import Path

from specdec.flags import (UsageError, add_engine_arguments, add_speculation_arguments,
                           engine_kwargs, floats, speculation_from_args, tree_keys)

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # = api_server.DEFAULT_MAX_REQUEST_BYTES
UVICORN_GRACE_S = 5.0  # uvicorn waits this much longer than we do, so we end streams first


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="target folder, as in vllm serve MODEL (or --model; default: the "
                        "embedded model)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="target folder; heads in its sibling mtp/, eagle/, eagle3/ "
                        "(default: the embedded model)")
    p.add_argument("--synthetic", default=None, metavar="SHAPE",
                   help="a synthetic target instead of MODEL (specdec/models/synthetic.py: "
                        "llama-tiny, llama-1b, llama-8b, deepseek-tiny, deepseek-16b), no "
                        "download; prompts as token ids (default: none)")
    p.add_argument("--synthetic-init", default=None, choices=("zeros", "random"),
                   help="with --synthetic, its weights: zeros (every logit ties: token 0, "
                        "every draft accepted) or random (seeded by --seed; default: zeros)")
    p.add_argument("--draft-acceptance", type=floats, default=None, metavar="R,..",
                   help="with --synthetic and a head method: drafts accepted at these rates "
                        "per position, one per draft position (e.g. 0.75,0.6,0.45; default: "
                        "every draft accepted)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients pass as model (default: --model, or specdec-default)")
    add_speculation_arguments(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000,
                   help="0..65535; 0: any free port, the start-up line says which")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests per batch (default 16; with --gpu-memory-utilization: the "
                        "most the KV cache share holds, at most 256)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output tokens (default: min(512, the model's "
                        "max_position_embeddings))")
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="tokens per engine step (prefill chunks fill what decodes leave)")
    p.add_argument("--max-waiting", type=int, default=256, metavar="N",
                   help="requests admitted beyond the running batch (--max-num-seqs); the "
                        "next gets 503; 0: no queue beyond the batch (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   metavar="B", help="larger request bodies get 413 "
                                     f"(default {DEFAULT_MAX_REQUEST_BYTES}, 16 MiB)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM, seconds running requests get to finish; then each ends "
                        "with finish_reason 'abort' (default 10)")
    p.add_argument("--engine-threads", type=int, default=None, metavar="N",
                   help="torch threads of the engine process (default: the CPUs this process "
                        "may use, less one for the API process; at least 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-request-spec-decode-metrics", choices=["summary"], default=None,
                   help="each response (a stream: its last chunk) carries its request's "
                        "metrics.speculative_decoding, vLLM's per-request summary: drafted, "
                        "accepted, steps, acceptance rate, length and histogram (default: off)")
    p.add_argument("--stub-engine", type=int, default=None, metavar="TOKENS_PER_STEP",
                   help="benchmark tool: a stub engine (no model) whose steps take no time and "
                        "give each request TOKENS_PER_STEP tokens of its prompt "
                        "(benchmarks/bench_served_stub.py); flags that set the model's "
                        "engine are refused with it")
    p.add_argument("--account", action="store_true",
                   help="benchmark tool: count the wall and CPU time of each part of a served "
                        "token in both processes, served at GET /account (POST /account/reset "
                        "zeroes it; specdec/entrypoints/account.py; default: off)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(p)


def served_model(name: str, tokenizer, model_dir: str, max_model_len: int, vocab_size: int,
                 num_speculative_tokens: int = 0, per_request_spec_metrics: bool = False,
                 eos_token_ids: tuple[int, ...] = ()):
    """What the handlers need of the model (``api_server.ServedModel``)."""
    from specdec.entrypoints.api_server import ServedModel
    from specdec.entrypoints.chat import load_chat_template
    longest = max(map(len, tokenizer.get_vocab()), default=1) if tokenizer is not None else 1
    return ServedModel(name, tokenizer, load_chat_template(model_dir), max_model_len,
                       vocab_size, longest, num_speculative_tokens, per_request_spec_metrics,
                       tokenizer_info(tokenizer, model_dir, max_model_len, eos_token_ids))


def tokenizer_info(tokenizer, model_dir: str, max_model_len: int,
                   eos_token_ids: tuple[int, ...]) -> dict | None:
    """vLLM's /tokenizer_info: the folder's special tokens and chat template, as chat requests
    use them (``specdec.entrypoints.chat``; the eos token from the model's eos id where the
    folder names none) and ``model_max_length`` = max_model_len. None without a tokenizer."""
    from specdec.entrypoints.chat import find_chat_template, special_tokens
    if tokenizer is None:
        return None
    path = Path(model_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    tokens = special_tokens(model_dir)
    eos = tokens.get("eos_token")
    if eos is None and eos_token_ids:
        eos = tokenizer.id_to_token(eos_token_ids[0])
    return {"tokenizer_class": config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "model_max_length": max_model_len, "bos_token": tokens.get("bos_token"),
            "eos_token": eos, "pad_token": tokens.get("pad_token"),
            "unk_token": tokens.get("unk_token"), "chat_template": find_chat_template(model_dir)}


def app_over(engine, model, shutdown_timeout_s: float, max_request_bytes: int):
    """The app over an engine (AsyncEngine or ProcessEngine), with its metrics."""
    from specdec.entrypoints.api_server import build_app
    from specdec.entrypoints.metrics import ServerMetrics
    engine.metrics = ServerMetrics((lambda: engine.num_running, lambda: engine.num_waiting,
                                    engine.free_blocks), engine.frozen_objects, model.name,
                                   engine.num_kv_blocks)
    return build_app(engine, model, engine.metrics, shutdown_timeout_s, max_request_bytes)


def build_server_app(llm, name: str, max_waiting: int = 256, shutdown_timeout_s: float = 10.0,
                     max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                     per_request_spec_metrics: bool = False):
    """An app serving an already-built single-rank ``LLM`` in this process (the tests use it
    in-process: its engine steps in a worker thread of this process)."""
    from specdec.engine.llm import DEFAULT_MODEL
    from specdec.entrypoints.async_engine import AsyncEngine
    k = llm.spec.num_speculative_tokens if llm.spec is not None else 0
    model = served_model(name, llm.tokenizer, llm.init_kwargs.get("model") or DEFAULT_MODEL,
                         llm.max_model_len, llm.target.config.vocab_size, k,
                         per_request_spec_metrics, tuple(llm.target.config.eos_token_ids))
    return app_over(AsyncEngine(llm, max_waiting=max_waiting), model, shutdown_timeout_s,
                    max_request_bytes)


def run_from_args(args) -> int:
    try:
        import uvicorn  # noqa: F401 - only checks the serve extra is installed
    except ImportError:
        raise UsageError("specdec serve needs the serve extra: pip install 'specdec[serve]'") \
            from None
    from specdec.entrypoints.async_engine import ProcessEngine
    from specdec.entrypoints.engine_loop import default_engine_threads
    args.model = model_from_args(args)
    for name in ("max_num_seqs", "max_model_len", "max_waiting", "max_request_bytes"):
        value = getattr(args, name)  # max_model_len None: the engine's default
        if value is not None and value < (0 if name == "max_waiting" else 1):
            raise UsageError(f"--{name.replace('_', '-')}={value} is out of range")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port={args.port}: allowed 0 <= --port <= 65535 (0: any free port)")
    if not 0 <= args.shutdown_timeout < float("inf"):  # NaN too
        raise UsageError(f"--shutdown-timeout={args.shutdown_timeout}: allowed a number of "
                         "seconds >= 0 (0: abort running requests at once)")
    if args.engine_threads is not None and args.engine_threads < 1:
        raise UsageError(f"--engine-threads={args.engine_threads}: allowed an int >= 1")
    if args.stub_engine is not None and args.stub_engine < 1:
        raise UsageError(f"--stub-engine={args.stub_engine}: allowed an int >= 1")
    if args.stub_engine is not None:
        refuse_what_the_stub_ignores(args)
    spec = speculation_from_args(args) if args.stub_engine is None else None  # stub: no drafter
    listen_socket(args.host, args.port).close()  # a taken port fails now, not after the engine
    threads = args.engine_threads or default_engine_threads()
    stub = {} if args.stub_engine is None else dict(stub_tokens_per_step=args.stub_engine)
    kwargs = dict(model=args.model, spec=spec, seed=args.seed, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len,
                  max_num_batched_tokens=args.max_num_batched_tokens, **engine_kwargs(args))
    if args.synthetic is not None:
        kwargs.update(synthetic=args.synthetic, synthetic_init=args.synthetic_init or "zeros",
                      draft_acceptance=args.draft_acceptance)
    elif args.draft_acceptance is not None or args.synthetic_init is not None:
        flag = "--draft-acceptance" if args.draft_acceptance is not None else "--synthetic-init"
        raise UsageError(f"{flag} sets the synthetic target's weights or its head's rates: "
                         "give --synthetic")
    ranks = kwargs.get("data_parallel_size", 1) * kwargs.get("tensor_parallel_size", 1)
    if ranks > 1:  # one engine per rank, their leaders behind this process
        if args.account:
            raise UsageError("--account counts one engine process: give it without "
                             "--tensor-parallel-size / --data-parallel-size")
        if stub:
            raise UsageError("--stub-engine has no ranks: give it without "
                             "--tensor-parallel-size / --data-parallel-size")
        from specdec.entrypoints.parallel_engine import ParallelEngine
        engine = ParallelEngine(kwargs, num_threads=max(1, threads // ranks),
                                max_waiting=args.max_waiting)
    else:
        engine = ProcessEngine(kwargs | stub | ({"account": True} if args.account else {}),
                               num_threads=threads, max_waiting=args.max_waiting)
    try:
        info = engine.start_process()
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    try:  # bound after the engine process started: a forked engine would hold it open
        sock = listen_socket(args.host, args.port)
    except UsageError:  # taken since the check above
        engine.discard()
        raise
    name = args.served_model_name or args.model or (
        f"synthetic-{args.synthetic}" if args.synthetic else "specdec-default")
    k = spec["num_speculative_tokens"] if spec else 0
    app = app_over(engine, served_model(name, info.tokenizer, info.model_dir,
                                        info.max_model_len, info.vocab_size, k,
                                        args.per_request_spec_decode_metrics == "summary",
                                        info.eos_token_ids),
                   args.shutdown_timeout, args.max_request_bytes)
    if args.account:
        from specdec.entrypoints.account_routes import serve_account
        serve_account(app, engine)
    host = f"[{args.host}]" if ":" in args.host else args.host
    chosen = "" if info.config is None else f"; {info.config.describe(args.device is None)}"
    print(f"specdec serve: {name} on http://{host}:{sock.getsockname()[1]} "
          f"speculative_config={json.dumps(spec)} ({engine.where}, "
          f"{info.num_threads} torch threads{' each' if ranks > 1 else ''}{chosen}"
          + (f"; start-up: {info.startup})" if info.startup else ")"), flush=True)
    serve_until_signal(app, sock, args.log_level, args.shutdown_timeout)
    if engine.exitcode is not None:
        who = "a rank process" if ranks > 1 else "the engine process"
        print(f"specdec serve: {who} exited with code {engine.exitcode}; "
              "its requests got 500", file=sys.stderr, flush=True)
        return 1
    return 0


def model_from_args(args) -> str | None:
    """The target folder: ``serve MODEL`` (vLLM's positional) or ``--model``; both given and
    different is a UsageError."""
    tag, flag = args.model_tag, args.model
    if tag is not None and flag is not None and Path(tag).resolve() != Path(flag).resolve():
        raise UsageError(f"MODEL={tag!r} and --model={flag!r} name different folders; give "
                         "one of them")
    return tag if tag is not None else flag


def listen_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port and listening, as uvicorn binds one (it serves on it);
    UsageError naming --port when the port is taken, --host when that address is not this
    machine's."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise UsageError(f"--port={port}: {host}:{port} is already in use; give another "
                             "--port (0: any free port)") from None
        raise UsageError(f"--host={host} --port={port}: cannot listen there "
                         f"({e.strerror or e})") from None
    return sock


def refuse_what_the_stub_ignores(args) -> None:
    """``--stub-engine`` runs no model: it reads ``--model``'s tokenizer, ``--max-num-seqs``
    and ``--max-model-len`` only; a flag that sets anything else is refused by name."""
    ignored = [flag for flag, given in (
        ("--method", args.method is not None), ("-k", args.num_speculative_tokens is not None),
        ("--speculative-config", args.speculative_config is not None),
        ("--draft-model", args.draft_model is not None), ("--no-padded", args.no_padded),
        ("--synthetic", args.synthetic is not None), ("--dtype", args.dtype is not None),
        ("--device", args.device is not None),
        ("--graph-backend", args.graph_backend is not None),
        ("--enforce-eager", args.enforce_eager), ("--async-scheduling", args.async_scheduling),
        ("--compile-backend", args.compile_backend is not None),
        ("--gpu-memory-utilization", args.gpu_memory_utilization is not None),
        ("--enable-prefix-caching", args.enable_prefix_caching is not None),
        ("--pack-prefill", args.pack_prefill is not None),
        ("--enable-expert-parallel", args.enable_expert_parallel)) if given]
    ignored += ["--" + key.replace("_", "-") for key in tree_keys(args)]
    if ignored:
        raise UsageError(f"{ignored[0]} sets the model's engine, and --stub-engine runs none (it "
                         "reads --model's tokenizer, --max-num-seqs and --max-model-len); give "
                         "one or the other")


def serve_until_signal(app, sock: socket.socket, log_level: str, shutdown_timeout: float):
    """uvicorn on ``sock`` (``listen_socket``) until SIGTERM/SIGINT; then exit status 0.

    On the signal uvicorn stops accepting and waits for open connections; at the same moment
    the engine starts its drain (``app.state.begin_shutdown``): running requests get
    ``shutdown_timeout`` seconds, then end with finish_reason "abort" (a stream gets that
    chunk and ``[DONE]``). uvicorn's own limit is longer (+UVICORN_GRACE_S) so it never cuts
    a stream mid-chunk. uvicorn re-raises the captured signal after it is done; our no-op
    handlers (restored by uvicorn before it re-raises) take it, so the exit status is 0."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            first = not self.should_exit
            super().handle_exit(sig, frame)
            if first:  # in the main thread, which runs the event loop: schedule, don't block
                asyncio.get_event_loop().call_soon_threadsafe(app.state.begin_shutdown)

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if received:  # a signal came before uvicorn took the handlers over: honour it
                self.handle_exit(received[0], None)

    def engine_died():  # fail fast: stop accepting, end the streams (already failed), exit 1
        server.should_exit = True

    app.state.engine.on_engine_death = engine_died
    received = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, f: received.append(s))
    config = uvicorn.Config(app, log_level=log_level,
                            timeout_graceful_shutdown=shutdown_timeout + UVICORN_GRACE_S)
    server = Server(config)
    server.run(sockets=[sock])
