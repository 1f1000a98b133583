"""Endpoint ITL harness: streamed TTFT, ITL, TPOT, E2E and tokens/s of an OpenAI-compatible server.

    specdec bench serve --launch --quick --out /tmp/bench-serve          # starts specdec serve
    specdec bench serve --base-url http://127.0.0.1:8000 [--model DIR]   # specdec or vllm serve

The prompts are the in-process harness's (``specdec bench``: held-out stdlib windows through
the embedded tokenizer, sent as token ids), with ``ignore_eos`` and exactly ``output_len``
tokens. A run sends ``num_prompts`` requests (default: the concurrency) at a fixed
concurrency, or spaced by a Poisson process of ``--request-rate`` requests/s, and reads the
SSE stream. A *chunk* is an SSE event that brought tokens; its token count comes from
``stream_options.continuous_usage_stats`` (vLLM's extension, served by specdec too), else
``token_ids``, else 1. Per request: TTFT = first chunk - send; E2E = last chunk - send; each
token of a later chunk gets ITL = chunk gap / tokens in the chunk (so they add up to E2E -
TTFT); the chunk gaps themselves are ``itl_chunk_ms``. Acceptance comes from ``/metrics``
(``specdec:`` or ``vllm:`` spec-decode counters, read before and after each run).
Output: the same ``results.json`` + PNG plots as ``specdec bench``, plus per-request records.
"""

import argparse
import asyncio
import json
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from specdec.bench import datasets, metrics, plots, report
from specdec.bench import sweep as bench_sweep
from specdec.config import SpeculativeConfig
from specdec.flags import (UsageError, add_engine_arguments, add_speculation_arguments, ints,
                           speculation_from_args)

SCHEMA_VERSION = 1
DEFAULTS = dict(concurrency=[1, 4, 16], prompt_len=64, output_len=64, repeats=3, warmup=1,
                seed=0, request_rate=None, num_prompts=None, dataset_name="random",
                dataset_path=None, multi_turn=None, multi_turn_pacing=None)
# --multi-turn-pacing (specdec/bench/multiturn.py replays them)
MULTI_TURN_PACINGS = ("rounds", "free")
QUICK = dict(DEFAULTS, concurrency=[1, 4], prompt_len=32, output_len=32, repeats=4)
DEFINITIONS = {
    **{k: v for k, v in metrics.DEFINITIONS.items() if k not in ("dp", "collectives_per_step")},
    "mode": "padded / ragged: the drafter batch of a server the bench launched; plain: it "
            "launched one without a drafter; server: one started elsewhere (not known)",
    "server": "owned_by of the model in the server's /v1/models (specdec or vllm), its URL",
    "chunk": "an SSE event that brought output tokens (a speculative step: several)",
    "itl": "per output token after a request's first chunk: (gap to the previous chunk) / "
           "(tokens in the chunk), client clock; per request they add up to e2e - ttft",
    "itl_chunk": "gap between consecutive chunks of a request (client clock)",
    "ttft": "first chunk arrival - request send",
    "e2e": "last chunk arrival - request send",
    "output_tokens_per_s": "output tokens of the run / (last chunk arrival - first send)",
    "engine metrics": "num_steps, step_seconds, draft_seconds, captured_steps, spec_tokens, "
                      "drafted/accepted: "
                      "deltas of the server's /metrics over the run (0 when it has none)",
}


# ---- one request ----------------------------------------------------------------------------
async def stream_one(session, url: str, body: dict) -> dict:
    """POST a streaming completion (or chat completion); -> {send, chunks: [(arrival,
    tokens)], output_tokens, prompt_tokens (None without usage), text}."""
    send = time.perf_counter()
    chunks, done_tokens, usage, text = [], 0, None, []
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:  # one SSE line per iteration
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            t = time.perf_counter()
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            usage = event.get("usage") or usage
            if not event.get("choices"):
                continue
            choice = event["choices"][0]
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            text.append(piece)
            if usage is not None and event.get("usage"):
                n = usage["completion_tokens"] - done_tokens
            elif "token_ids" in choice:
                n = len(choice["token_ids"] or [])
            else:
                n = 1 if piece else 0
            if n > 0:
                chunks.append((t, n))
                done_tokens += n
    total = usage["completion_tokens"] if usage else done_tokens
    return dict(send=send, chunks=chunks, output_tokens=total, text="".join(text),
                prompt_tokens=usage.get("prompt_tokens") if usage else None)


def request_figures(rec: dict) -> dict:
    """Per-request latencies (seconds) from its chunk arrivals."""
    (first, _), (last, _) = rec["chunks"][0], rec["chunks"][-1]
    itl_s, chunk_gaps = [], []
    for (prev, _), (t, n) in zip(rec["chunks"], rec["chunks"][1:]):
        itl_s += [(t - prev) / n] * n
        chunk_gaps.append(t - prev)
    return dict(ttft=first - rec["send"], e2e=last - rec["send"], itl=itl_s, chunk_gaps=chunk_gaps,
                tpot=(last - first) / max(rec["output_tokens"] - 1, 1),
                output_tokens=rec["output_tokens"], chunk_tokens=[n for _, n in rec["chunks"]])


async def run_once(base_url: str, body: dict, prompts: list, concurrency: int,
                   request_rate: float | None, seed: int) -> tuple[list[dict], float, float]:
    """Send every prompt; -> (request records, first send, last arrival) in perf_counter s."""
    import aiohttp
    sem = asyncio.Semaphore(concurrency)
    gaps = random.Random(seed)
    async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600.0), read_bufsize=2**20,
            connector=aiohttp.TCPConnector(limit=concurrency + 4)) as session:
        async def one(prompt):  # token ids, or a dict of request fields (prompt, max_tokens)
            fields = prompt if isinstance(prompt, dict) else {"prompt": prompt}
            async with sem:
                return await stream_one(session, f"{base_url}/v1/completions",
                                        {**body, **fields})

        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(one(prompt)))
            if request_rate:
                await asyncio.sleep(gaps.expovariate(request_rate))
        records = await asyncio.gather(*tasks)
    start = min(r["send"] for r in records)
    end = max(r["chunks"][-1][0] for r in records)
    return records, start, end


# ---- server metrics -------------------------------------------------------------------------
def scrape(base_url: str) -> dict:
    """The server's /metrics as {(sample name, position label): value}, summed over other
    labels; {} when the server has none."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    try:
        resp = httpx.get(f"{base_url}/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    if resp.status_code != 200:
        return {}
    out = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            key = (s.name, s.labels.get("position"))
            out[key] = out.get(key, 0.0) + s.value
    return out


def engine_deltas(before: dict, after: dict) -> dict:
    """Step and speculative figures of one run from two scrapes (specdec: or vllm: names)."""
    def d(name, pos=None):
        return after.get((name, pos), 0.0) - before.get((name, pos), 0.0)

    prefix = "specdec:" if any(k[0].startswith("specdec:") for k in after) else "vllm:"
    positions = sorted({int(p) for (n, p) in after if p is not None
                        and n == f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"})
    drafts = d(f"{prefix}spec_decode_num_drafts_total")
    accepted = [int(d(f"{prefix}spec_decode_num_accepted_tokens_per_pos_total", str(j)))
                for j in positions]
    if prefix == "specdec:":
        drafted = [int(d("specdec:spec_decode_num_draft_tokens_per_pos_total", str(j)))
                   for j in positions]
    else:  # vLLM drafts K tokens per draft
        drafted = [int(drafts)] * len(positions)
    return dict(num_steps=int(d("specdec:step_seconds_count")),
                step_seconds=d("specdec:step_seconds_sum"),
                draft_seconds=d("specdec:step_draft_seconds_total"),
                captured_steps=int(d("specdec:captured_steps_total")), collectives=0,
                spec_tokens=int(d("specdec:step_spec_tokens_total")),
                prefix_cache_queries=int(d("vllm:prefix_cache_queries_total")),
                prefix_cache_hits=int(d("vllm:prefix_cache_hits_total")),
                verify_steps=int(drafts), drafted=drafted, accepted=accepted)


def run_figures(records: list[dict], start: float, end: float, engine: dict) -> dict:
    """One run's JSON record: ``metrics.repeat_figures`` plus chunk gaps and per-request records."""
    per = [request_figures(r) for r in records]
    raw = dict(engine, wall_s=end - start, output_tokens=sum(p["output_tokens"] for p in per),
               itl_s=[x for p in per for x in p["itl"]], ttft_s=[p["ttft"] for p in per],
               e2e_s=[p["e2e"] for p in per], tpot_s=[p["tpot"] for p in per],
               decode_time_s=sum(p["e2e"] - p["ttft"] for p in per))
    rep = metrics.repeat_figures(raw)
    rep["itl_chunk_ms"] = [1e3 * x for p in per for x in p["chunk_gaps"]]
    rep["requests"] = [dict(ttft_ms=1e3 * p["ttft"], e2e_ms=1e3 * p["e2e"],
                            itl_ms=[1e3 * x for x in p["itl"]], chunk_tokens=p["chunk_tokens"],
                            output_tokens=p["output_tokens"]) for p in per]
    return rep


# ---- launching specdec serve ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(serve_args: list[str], timeout_s: float = 180.0) -> tuple[subprocess.Popen, str]:
    """Start ``specdec serve`` on a free port; -> (process, base URL) once /health answers."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.commands.cli", "serve", "--port",
                             str(port), *serve_args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}", "specdec serve", timeout_s)


def wait_healthy(proc: subprocess.Popen, url: str, name: str, timeout_s: float) -> str:
    """``url`` once its /health answers 200; UsageError (after stopping ``proc``) when the
    server exits first or stays silent for ``timeout_s``."""
    import httpx
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise UsageError(f"{name} exited with {proc.returncode}: {proc.stderr.read()[-500:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    stop(proc)
    raise UsageError(f"{name} did not answer /health within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM (graceful), then kill after 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- the sweep ------------------------------------------------------------------------------
def served_models(base_url: str) -> list[dict]:
    """The server's ``/v1/models`` entries ([] when it has none or does not answer)."""
    import httpx
    try:
        data = httpx.get(f"{base_url}/v1/models", timeout=30).json().get("data")
    except (httpx.HTTPError, ValueError, AttributeError):
        return []
    return data if isinstance(data, list) else []


def served_model(base_url: str) -> str:
    """The first model of ``/v1/models``."""
    models = served_models(base_url)
    if not models:
        raise UsageError(f"{base_url}/v1/models lists no model: give --served-model-name NAME")
    return models[0]["id"]


def server_info(base_url: str, model: str, launched: bool) -> dict:
    """Which server the figures came from: ``owned_by`` of the model in ``/v1/models``
    (specdec serve: "specdec", vllm serve: "vllm"), else the base URL's host."""
    entry = next((m for m in served_models(base_url) if m.get("id") == model), {})
    owner = entry.get("owned_by")
    name = f"{owner} serve" if owner in ("specdec", "vllm") else (owner or "unknown server")
    return dict(name=name + (" (launched by the bench)" if launched else ""), owned_by=owner,
                base_url=base_url, model=model, launched=launched)


def endpoint_mode(spec: dict | None, launched: bool) -> str:
    """The drafter batch of the served engine when the bench launched it (padded, ragged;
    plain without a drafter); ``server`` when the server was started elsewhere (unknown)."""
    if not launched:
        return "server"
    if spec is None:
        return "plain"
    return "ragged" if spec.get("disable_padded_drafter_batch") else "padded"


def read_dataset(opts: dict):
    """(the bench's tokenizer, its Dataset or None for ``random``): the file read and checked
    before a server is launched or a request sent, so a malformed line fails first."""
    from tokenizers import Tokenizer

    from specdec.engine.llm import DEFAULT_MODEL
    tok = Tokenizer.from_file(str(Path(opts["tokenizer"] or DEFAULT_MODEL) / "tokenizer.json"))
    return tok, datasets.load(opts["dataset_name"], opts["dataset_path"],
                              lambda text: len(tok.encode(text).ids))


def prompt_source(data: "datasets.Dataset | None", tok, opts: dict, max_model_len: int, k: int):
    """The generated prompts (PromptSource), or the dataset's rows that fit the server's
    ``max_model_len`` (DatasetPrompts)."""
    if data is None:
        return bench_sweep.PromptSource(tok, tok.get_vocab_size())
    return bench_sweep.DatasetPrompts(data, tok, max_model_len, opts["output_len"], k + 1)


def server_max_model_len(base_url: str, model: str, tokenizer_dir: str | None) -> int:
    """``max_model_len`` of the model in ``/v1/models`` (specdec and vLLM list it), else the
    most the model folder's config allows."""
    entry = next((m for m in served_models(base_url) if m.get("id") == model), {})
    return entry.get("max_model_len") or bench_sweep.model_limit(tokenizer_dir)


def bench(opts: dict, base_url: str, model: str, label: str, k: int, console: Console,
          tok, data: "datasets.Dataset | None", mode: str = "server",
          server: dict | None = None) -> dict:
    """Warm up, then the interleaved repeats over the concurrencies (and a dataset's
    categories: one run each); -> results.json dict. ``tok``, ``data``: ``read_dataset``'s."""
    source = prompt_source(data, tok, opts,
                           server_max_model_len(base_url, model, opts["tokenizer"]), k)
    generated = bench_sweep.PromptSource(tok, tok.get_vocab_size())  # the warm-up's
    dataset = isinstance(source, bench_sweep.DatasetPrompts)
    body = dict(model=model, max_tokens=opts["output_len"], temperature=0.0, stream=True,
                ignore_eos=True, stream_options=dict(include_usage=True,
                                                     continuous_usage_stats=True))
    runs = [(c, cat) for c in opts["concurrency"]
            for cat in (source.categories if dataset else [None])]
    reps = {run: [] for run in runs}
    phases, t_start = {}, time.perf_counter()

    def one(c: int, category: str | None, prompt_seed: int, warm: bool = False) -> dict:
        n = opts["num_prompts"] or c
        if dataset and not warm:
            ids, max_tokens = source.prompts(n, category, prompt_seed)
            prompts = [dict(prompt=p, max_tokens=m or opts["output_len"])
                       for p, m in zip(ids, max_tokens)]
        else:
            prompts = generated.prompts(n, opts["prompt_len"], prompt_seed)
        before = scrape(base_url)
        records, start, end = asyncio.run(run_once(base_url, body, prompts, c,
                                                   opts["request_rate"], prompt_seed))
        return run_figures(records, start, end, engine_deltas(before, scrape(base_url)))

    for w in range(opts["warmup"]):  # generated prompts: a dataset's are not sent twice
        for c in opts["concurrency"]:
            one(c, None, 10_000 + opts["seed"] + w, warm=True)
    phases["warmup_s"] = time.perf_counter() - t_start
    t = time.perf_counter()
    for r in range(opts["repeats"]):
        for c, cat in runs if r % 2 == 0 else runs[::-1]:
            reps[c, cat].append(one(c, cat, opts["seed"] + r))
            rep = reps[c, cat][-1]
            console.print(f"repeat {r + 1}/{opts['repeats']} concurrency {c}"
                          + (f" category {cat}" if cat is not None else "") + ": "
                          f"{rep['output_tokens_per_s']:.0f} tok/s, {rep['num_steps']} steps, "
                          f"{100 * rep['captured_share']:.0f}% captured", highlight=False)
    phases["measure_s"] = time.perf_counter() - t
    configs = []
    prompt_len = 0 if dataset else opts["prompt_len"]
    for c, cat in runs:
        summary = metrics.summarize(reps[c, cat])
        summary["itl_chunk_ms"] = metrics.dist([x for r in reps[c, cat]
                                                for x in r["itl_chunk_ms"]])
        summary["host_syncs_per_step"] = None  # an endpoint is timed, never checked
        prompts = f"p{prompt_len}" if prompt_len else "dataset"
        configs.append(dict(
            name=f"{label}-c{c}-{prompts}" + (f"-{cat}" if cat is not None else "")
                 + f"-o{opts['output_len']}", method=label,
            mode=mode, k=k, concurrency=c, prompt_len=prompt_len, category=cat,
            output_len=opts["output_len"], request_rate=opts["request_rate"], status="ok",
            summary=summary, repeats=reps[c, cat]))
    sweep = {**opts, "dp": 1, "base_url": base_url, "model": model}
    return dict(schema_version=SCHEMA_VERSION, kind="endpoint", server=server or {},
                definitions=DEFINITIONS,
                environment=bench_sweep.environment({"device": "cpu"}), sweep=sweep,
                prompt_source=source.kind, phase_seconds=phases, configs=configs,
                warnings=source.warnings() if dataset else [])


# ---- command line ---------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (specdec or vllm serve; "
                                           "this or --launch is required)")
    target.add_argument("--launch", action="store_true",
                        help="start specdec serve on a free port, stop it at the end (this or "
                             "--base-url is required)")
    p.add_argument("--model", metavar="PATH", help="the checkpoint folder, as for generate "
                   "and serve: its tokenizer makes the prompts, and with --launch the server "
                   "runs it (default: the embedded model)")
    p.add_argument("--served-model-name", metavar="NAME", help="the model name the requests "
                   "give (default: the first of the server's /v1/models)")
    p.add_argument("--label", help="the config name in the results (default: the method "
                                   "with --launch, else the served model name)")
    p.add_argument("--quick", action="store_true", help="concurrency 1,4, 32-token prompts, "
                   "32 output tokens, 4 repeats (see docs/benchmarks.md for its measured duration; "
                   "default: concurrency 1,4,16, 64-token prompts and outputs, 3 repeats)")
    p.add_argument("--out", default="bench-serve-results", metavar="DIR",
                   help="where results.json and the PNGs go")
    p.add_argument("--concurrency", type=ints,
                   help=f"comma list (default {','.join(map(str, d['concurrency']))})")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s "
                   "(concurrency then caps requests in flight; default: all at once)")
    p.add_argument("--num-prompts", type=int, help="requests per run (default: concurrency)")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens (default {d['prompt_len']})")
    p.add_argument("--output-len", type=int, help=f"output tokens (default {d['output_len']})")
    p.add_argument("--repeats", type=int, help=f"measured runs per concurrency "
                                               f"(default {d['repeats']})")
    p.add_argument("--warmup", type=int, help=f"warm-up runs per concurrency, excluded "
                                              f"(default {d['warmup']})")
    p.add_argument("--seed", type=int, help=f"prompt seed (default {d['seed']})")
    p.add_argument("--tokenizer", metavar="PATH", help="folder with the tokenizer.json that "
                   "makes the prompts (default: --model's)")
    p.add_argument("--dataset-name", choices=datasets.NAMES,
                   help="prompts: random (generated), custom (vLLM's JSONL: prompt, "
                        "output_tokens, category), sharegpt (human turns; a reply's length as "
                        "the output length), spec_bench (SpecBench's question.jsonl: category, "
                        "turns; specdec/bench/traces/agentic.jsonl too); with categories, one "
                        "run per category (default: random)")
    p.add_argument("--dataset-path", metavar="FILE", help="the file of --dataset-name custom, "
                   "sharegpt or spec_bench (default: none)")
    p.add_argument("--multi-turn", type=int, metavar="N", help="replay conversations of up to "
                   "N user turns through /v1/chat/completions (each turn sends the earlier "
                   "turns with the server's replies; --concurrency: conversations in flight; "
                   "--num-prompts: conversations; report per turn; default: single turns)")
    p.add_argument("--multi-turn-pacing", choices=MULTI_TURN_PACINGS, help="with --multi-turn: "
                   "rounds (turn t of every conversation, then turn t+1: per-turn tokens/s and "
                   "hit rate) or free (vLLM's: each conversation's next turn as soon as its "
                   "reply ends, the next conversation when one ends; tokens/s over the whole "
                   "replay) (default: rounds)")
    g = p.add_argument_group("with --launch: the server's engine (as specdec serve; "
                             "refused with --base-url)")
    add_speculation_arguments(g)
    add_engine_arguments(g)  # --graph-backend replay counts the steps a CUDA graph would capture
    g.add_argument("--max-num-seqs", type=int, metavar="N",
                   help="the server's batch (default: the largest --concurrency)")
    g.add_argument("--max-num-batched-tokens", type=int, metavar="N",
                   help="the server's tokens per step (default: max(256, the largest "
                        "--concurrency x (K + 1)))")


# the flags of the launched server's engine (add_speculation_arguments, add_engine_arguments)
# by argument name; the speculation ones reach it as one --speculative-config
SPECULATION_FLAGS = {"method": "--method", "num_speculative_tokens": "-k",
                     "speculative_config": "--speculative-config",
                     "draft_model": "--draft-model", "no_padded": "--no-padded",
                     "speculative_token_tree": "--speculative-token-tree",
                     "tree_topk": "--tree-topk", "num_draft_tokens": "--num-draft-tokens",
                     "tree_score_temperature": "--tree-score-temperature"}
ENGINE_FLAGS = {"device": "--device", "dtype": "--dtype", "graph_backend": "--graph-backend",
                "compile_backend": "--compile-backend", "async_scheduling": "--async-scheduling",
                "enforce_eager": "--enforce-eager",
                "gpu_memory_utilization": "--gpu-memory-utilization",
                "tensor_parallel_size": "--tensor-parallel-size",
                "data_parallel_size": "--data-parallel-size",
                "enable_expert_parallel": "--enable-expert-parallel",
                "enable_prefix_caching": "--enable-prefix-caching",  # False: --no-...
                "pack_prefill": "--pack-prefill",  # False: --no-...
                "max_num_seqs": "--max-num-seqs",
                "max_num_batched_tokens": "--max-num-batched-tokens"}


BOTH_WAYS = ("enable_prefix_caching", "pack_prefill")  # switches given off as --no-...


def fed_drafts(spec: dict | None) -> int:
    """The tokens a decode of this speculative config feeds past its last known one: K, or
    a draft tree's nodes past its root (0 without one); UsageError for a bad config."""
    if spec is None:
        return 0
    try:
        return SpeculativeConfig.from_dict(dict(spec)).num_fed_drafts
    except (TypeError, ValueError) as e:
        raise UsageError(f"--speculative-config: {e}") from None


def engine_flags(args) -> list[str]:
    """The engine flags given (not None; a switch: not False, --no-enable-prefix-caching and
    --no-pack-prefill given) -> the launched ``specdec serve``'s arguments; UsageError
    naming them when there is no server to launch (--base-url)."""
    given = {dest: getattr(args, dest) for dest in [*SPECULATION_FLAGS, *ENGINE_FLAGS]
             if getattr(args, dest) is not None and (getattr(args, dest) is not False
                                                     or dest in BOTH_WAYS)}
    if given and not args.launch:
        names = [{**SPECULATION_FLAGS, **ENGINE_FLAGS}[dest] for dest in given]
        raise UsageError(f"{', '.join(names)}: the launched server's engine flags; with "
                         "--base-url the server is already running (use --launch, or set "
                         "them on that server)")
    out = []
    for dest, flag in ENGINE_FLAGS.items():
        if dest in given:
            value = given[dest]
            out += ([flag] if value is True else [f"--no-{flag[2:]}"] if value is False
                    else [flag, str(value)])
    return out


def options(args) -> dict:
    opts = dict(QUICK if args.quick else DEFAULTS, tokenizer=args.tokenizer or args.model)
    for key in ("concurrency", "request_rate", "num_prompts", "prompt_len", "output_len",
                "repeats", "warmup", "seed", "dataset_name", "dataset_path", "multi_turn",
                "multi_turn_pacing"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    for key, low in (("prompt_len", 1), ("output_len", 2), ("repeats", 1), ("warmup", 0)):
        if not isinstance(opts[key], int) or opts[key] < low:
            raise UsageError(f"--{key.replace('_', '-')}={opts[key]!r}: allowed ints >= {low}")
    if not opts["concurrency"] or min(opts["concurrency"]) < 1:
        raise UsageError(f"--concurrency={opts['concurrency']}: allowed ints >= 1")
    if opts["num_prompts"] is not None and opts["num_prompts"] < 1:
        raise UsageError(f"--num-prompts={opts['num_prompts']}: allowed an int >= 1")
    if opts["request_rate"] is not None and opts["request_rate"] <= 0:
        raise UsageError(f"--request-rate={opts['request_rate']}: allowed a number > 0")
    datasets.check_pair(opts["dataset_name"], opts["dataset_path"])
    if opts["multi_turn"] is not None:
        if opts["multi_turn"] < 1:
            raise UsageError(f"--multi-turn={opts['multi_turn']}: allowed an int >= 1")
        if opts["request_rate"] is not None:
            raise UsageError("--request-rate with --multi-turn: a conversation's next turn "
                             "follows its reply (rounds), so there is no arrival rate to set")
        opts["multi_turn_pacing"] = opts["multi_turn_pacing"] or "rounds"
    elif opts["multi_turn_pacing"] is not None:
        raise UsageError(f"--multi-turn-pacing={opts['multi_turn_pacing']} without "
                         "--multi-turn: single turns have no pacing (allowed with --multi-turn N)")
    return opts


def run_from_args(args, turns_bench=None) -> int:
    """``specdec bench serve``; ``turns_bench``: the multi-turn replay's ``bench``
    (``specdec.bench.multiturn``, which builds on this module: the command line hands it
    in), run for --multi-turn."""
    try:
        import aiohttp  # noqa: F401
        import httpx  # noqa: F401
    except ImportError:
        raise UsageError("specdec bench serve needs the serve extra: "
                         "pip install 'specdec[serve]'") from None
    opts = options(args)
    launched_flags = engine_flags(args)  # refused without --launch, before anything starts
    tok, data = read_dataset(opts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console(stderr=True)
    proc, spec, k = None, None, 0
    start = time.perf_counter()
    try:
        if args.launch:
            spec = speculation_from_args(args)  # as specdec serve would take these flags
            k = spec["num_speculative_tokens"] if spec else 0
            fed = fed_drafts(spec)  # a decode's tokens past its last known one
            # a dataset's or a conversation's length is not known before it runs: the most
            # the model allows
            max_len = (bench_sweep.model_limit(args.model)
                       if opts["multi_turn"] or opts["dataset_name"] != "random"
                       else opts["prompt_len"] + opts["output_len"] + fed + 1)
            serve_args = ["--method", "none", "--max-num-seqs", str(max(opts["concurrency"])),
                          "--max-model-len", str(max_len),
                          "--max-num-batched-tokens",
                          str(max(256, max(opts["concurrency"]) * (fed + 1)))]
            if spec:
                serve_args += ["--speculative-config", json.dumps(spec)]
            if args.model:
                serve_args += ["--model", args.model]
            proc, base_url = launch(serve_args + launched_flags)
        else:
            base_url = args.base_url.rstrip("/")
        model = args.served_model_name or served_model(base_url)
        label = args.label or ((spec["method"] if spec else "none") if args.launch else model)
        server = server_info(base_url, model, args.launch)
        run = turns_bench if opts["multi_turn"] else bench
        results = run(opts, base_url, model, label, k, console, tok, data,
                      mode=endpoint_mode(spec, args.launch), server=server)
    finally:
        if proc is not None:
            stop(proc)
    results["launched_speculative_config"] = spec
    results["launched_engine_flags"] = launched_flags if args.launch else None
    turns = results["kind"] == "multi_turn"
    results["plots"] = (plots.write_turn_plots if turns else plots.write_plots)(results, out)
    results["wall_seconds"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    out_console = Console()
    out_console.print(report.turns_table(results) if turns
                      else report.results_table(results, out_console.width))
    for line in results["warnings"] + (report.failed_turn_lines(results) if turns else []):
        out_console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    out_console.print(f"wrote {out / 'results.json'} and {', '.join(results['plots'])} in "
               f"{results['wall_seconds']:.1f} s", markup=False, highlight=False, soft_wrap=True)
    return 0
