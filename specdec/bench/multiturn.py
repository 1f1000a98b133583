"""``specdec bench serve --multi-turn N``: conversations replayed through the chat API.

Turn t of a conversation POSTs (streamed) to ``/v1/chat/completions`` its messages so far:
user turn 1, the reply the server streamed back to it, ..., user turn t; the reply to turn t
becomes the assistant message before turn t+1 (as vLLM's ``benchmarks/multi_turn`` replaces a
dataset's assistant turns with the server's answers). A conversation's user turns are a
dataset's (``spec_bench``: its ``turns``; ``sharegpt``: its human turns; ``custom``: one
turn) or, for ``random``, N held-out stdlib windows of ``--prompt-len`` tokens; at most N are
sent. ``--concurrency C``: conversations in flight (vLLM's ``--max-active-conversations``:
each conversation has one request in flight at a time, so C is also the requests in flight).

Turns run in lock-step rounds: round t sends turn t of every conversation that has one, C at
a time, and waits for all of them before round t+1, so each turn index is measured on its
own: TTFT p50/p99, output tokens/s (the round's output tokens / its span), the prompt tokens
(from ``usage``), the acceptance length and the prefix-cache hit rate (deltas of /metrics over
the round: ``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``; n/a without them). A
turn the server refuses (e.g. the conversation outgrew ``max_model_len``) ends that
conversation; the round counts it as failed, with its error.
"""

import asyncio
import time

from specdec.bench import datasets, metrics
from specdec.bench import serve as bench_serve
from specdec.bench import sweep as bench_sweep

PREFIX_CACHE = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def prefix_cache_counts(scraped: dict) -> tuple[float, float] | None:
    """(queries, hits) from a /metrics scrape (a counter's sample is ``NAME_total``), or None
    when the server exports neither."""
    got = [sum(v for (n, _), v in scraped.items() if n in (name, name + "_total"))
           for name in PREFIX_CACHE]
    names = {n for n, _ in scraped}
    if not any(name in names or name + "_total" in names for name in PREFIX_CACHE):
        return None
    return got[0], got[1]


def conversations(opts: dict, tok, seed: int) -> list[datasets.Conversation]:
    """``num_prompts`` (default: the concurrency's) conversations of at most ``multi_turn``
    user turns: the dataset's (a seeded shuffle, ``datasets.pick``) or generated ones."""
    n, turns = opts["num_prompts"] or opts["_concurrency"], opts["multi_turn"]
    data = datasets.load(opts["dataset_name"], opts["dataset_path"],
                         lambda text: len(tok.encode(text).ids))
    if data is None:
        source = bench_sweep.PromptSource(tok, tok.get_vocab_size())
        windows = source.prompts(n * turns, opts["prompt_len"], seed)
        return [datasets.Conversation([tok.decode(w) for w in windows[i * turns:(i + 1) * turns]],
                                      [None] * turns, None, f"random:{i}") for i in range(n)]
    return [c._replace(turns=c.turns[:turns], max_tokens=c.max_tokens[:turns])
            for c in datasets.pick(data.conversations, n, seed)]


async def replay(base_url: str, body: dict, convs: list[datasets.Conversation],
                 concurrency: int, output_len: int, on_round) -> list[list[dict]]:
    """Lock-step rounds over the conversations; -> per round, one record per request sent:
    {conversation, turn, messages, send, chunks, output_tokens, prompt_tokens, text} or
    {conversation, turn, messages, error}. ``on_round(t)`` is called before round t starts
    and after the last one ends (t = number of rounds): the /metrics scrape points."""
    import aiohttp
    history = [[] for _ in convs]  # messages so far, per conversation
    alive = [True] * len(convs)
    rounds = []
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600.0), read_bufsize=2**20,
            connector=aiohttp.TCPConnector(limit=concurrency + 4)) as session:
        async def turn(i: int, t: int) -> dict:
            messages = history[i] + [{"role": "user", "content": convs[i].turns[t]}]
            rec = dict(conversation=i, turn=t + 1, messages=messages)
            async with sem:
                try:
                    rec.update(await bench_serve.stream_one(
                        session, f"{base_url}/v1/chat/completions",
                        {**body, "messages": messages,
                         "max_tokens": convs[i].max_tokens[t] or output_len}))
                except (RuntimeError, aiohttp.ClientError) as e:
                    rec["error"] = str(e)[:300]
            return rec

        for t in range(max(len(c.turns) for c in convs)):
            todo = [i for i, c in enumerate(convs) if alive[i] and t < len(c.turns)]
            if not todo:
                break
            on_round(t)
            recs = await asyncio.gather(*(turn(i, t) for i in todo))
            for rec in recs:
                i = rec["conversation"]
                if "error" in rec or not rec["chunks"]:
                    alive[i] = False
                    rec.setdefault("error", "no tokens streamed")
                else:
                    history[i] = rec["messages"] + [{"role": "assistant",
                                                     "content": rec["text"]}]
            rounds.append(recs)
        on_round(len(rounds))
    return rounds


def round_figures(recs: list[dict], before: dict, after: dict) -> dict:
    """One round's figures (ms; tokens/s over the round's span) from its records and the
    /metrics scrapes around it."""
    ok = [r for r in recs if "error" not in r]
    per = [bench_serve.request_figures(r) for r in ok]
    span = (max(r["chunks"][-1][0] for r in ok) - min(r["send"] for r in ok)) if ok else 0.0
    engine = bench_serve.engine_deltas(before, after)
    cache = [prefix_cache_counts(x) for x in (before, after)]
    queries, hits = ((cache[1][0] - cache[0][0], cache[1][1] - cache[0][1])
                     if None not in cache else (0.0, 0.0))
    vs = engine["verify_steps"]
    return dict(requests=len(ok), failed=len(recs) - len(ok),
                errors=[r["error"] for r in recs if "error" in r][:3],
                ttft_ms=[1e3 * p["ttft"] for p in per],
                prompt_tokens=[r["prompt_tokens"] for r in ok],
                output_tokens=sum(p["output_tokens"] for p in per), span_s=span,
                output_tokens_per_s=sum(p["output_tokens"] for p in per) / span if span else None,
                drafted=sum(engine["drafted"]), accepted=sum(engine["accepted"]),
                verify_steps=vs,
                acceptance_length=1.0 + sum(engine["accepted"]) / vs if vs else None,
                prefix_cache_queries=queries if None not in cache else None,
                prefix_cache_hits=hits if None not in cache else None)


def turn_summary(t: int, reps: list[dict]) -> dict:
    """Turn ``t`` (1-based) pooled over repeats: TTFT distribution, mean tokens/s, pooled
    acceptance length and hit rate (None: the server exports no prefix-cache counters)."""
    tps = [r["output_tokens_per_s"] for r in reps if r["output_tokens_per_s"] is not None]
    prompts = [p for r in reps for p in r["prompt_tokens"] if p is not None]
    vs = sum(r["verify_steps"] for r in reps)
    has_cache = all(r["prefix_cache_queries"] is not None for r in reps)
    queries = sum(r["prefix_cache_queries"] for r in reps) if has_cache else None
    return dict(turn=t, requests=sum(r["requests"] for r in reps),
                failed=sum(r["failed"] for r in reps),
                errors=[e for r in reps for e in r["errors"]][:3],
                ttft_ms=metrics.dist([x for r in reps for x in r["ttft_ms"]]),
                prompt_tokens_mean=sum(prompts) / len(prompts) if prompts else None,
                output_tokens=sum(r["output_tokens"] for r in reps),
                output_tokens_per_s=sum(tps) / len(tps) if tps else None,
                acceptance_length=1.0 + sum(r["accepted"] for r in reps) / vs if vs else None,
                prefix_cache_hit_rate=(sum(r["prefix_cache_hits"] for r in reps) / queries
                                       if has_cache and queries else None))


def bench(opts: dict, base_url: str, model: str, label: str, k: int, console,
          mode: str = "server", server: dict | None = None) -> dict:
    """Warm up (generated single-turn prompts: the conversations' text is not sent before
    it is measured), then per concurrency the repeats of the replay; -> results.json dict
    (``kind`` "multi_turn", a ``turns`` list per config)."""
    from pathlib import Path

    from tokenizers import Tokenizer

    from specdec.engine.llm import DEFAULT_MODEL
    tok = Tokenizer.from_file(str(Path(opts["tokenizer"] or DEFAULT_MODEL) / "tokenizer.json"))
    generated = bench_sweep.PromptSource(tok, tok.get_vocab_size())
    body = dict(model=model, temperature=0.0, stream=True, ignore_eos=True,
                stream_options=dict(include_usage=True, continuous_usage_stats=True))
    phases, t_start = {}, time.perf_counter()
    for w in range(opts["warmup"]):
        for c in opts["concurrency"]:
            records, _, _ = asyncio.run(bench_serve.run_once(
                base_url, {**body, "max_tokens": opts["output_len"]},
                generated.prompts(c, opts["prompt_len"], 10_000 + opts["seed"] + w), c, None, 0))
    phases["warmup_s"] = time.perf_counter() - t_start
    t = time.perf_counter()
    configs = []
    for c in opts["concurrency"]:
        reps = []
        for r in range(opts["repeats"]):
            convs = conversations(dict(opts, _concurrency=c), tok, opts["seed"] + r)
            scrapes = []
            rounds = asyncio.run(replay(base_url, body, convs, c, opts["output_len"],
                                        lambda _: scrapes.append(bench_serve.scrape(base_url))))
            reps.append([dict(round_figures(recs, scrapes[i], scrapes[i + 1]),
                              requests_sent=[dict(conversation=x["conversation"],
                                                  messages=len(x["messages"]),
                                                  error=x.get("error")) for x in recs])
                         for i, recs in enumerate(rounds)])
            console.print(f"repeat {r + 1}/{opts['repeats']} concurrency {c}: "
                          f"{len(convs)} conversations, {len(rounds)} turns", highlight=False)
        n_turns = max(len(x) for x in reps)
        turns = [turn_summary(i + 1, [x[i] for x in reps if i < len(x)]) for i in range(n_turns)]
        configs.append(dict(name=f"{label}-c{c}-multi_turn{opts['multi_turn']}", method=label,
                            mode=mode, k=k, concurrency=c, status="ok", turns=turns,
                            repeats=reps))
    phases["measure_s"] = time.perf_counter() - t
    sweep = {**opts, "dp": 1, "base_url": base_url, "model": model}
    return dict(schema_version=bench_serve.SCHEMA_VERSION, kind="multi_turn",
                server=server or {}, definitions=DEFINITIONS,
                environment=bench_sweep.environment({"device": "cpu"}), sweep=sweep,
                prompt_source=(f"{opts['dataset_name']} dataset {opts['dataset_path']}"
                               if opts["dataset_path"] else "generated held-out stdlib text"),
                phase_seconds=phases, configs=configs, warnings=[])


DEFINITIONS = {
    "turn": "the index of a user turn; its request holds every earlier turn with the reply "
            "the server gave to it, then this turn",
    "round": "turn t of every conversation that has one, at most concurrency in flight; the "
             "next round starts when all of them have ended",
    "ttft": "first chunk arrival - request send (client clock)",
    "output_tokens_per_s": "output tokens of the round / (its last chunk arrival - its first "
                           "send), mean over repeats",
    "prompt_tokens_mean": "usage.prompt_tokens of the turn's requests (the chat template "
                          "rendered by the server), mean",
    "acceptance_length": "1 + accepted / verifying steps over the round, from /metrics",
    "prefix_cache_hit_rate": "delta vllm:prefix_cache_hits / delta vllm:prefix_cache_queries "
                             "over the round (None: the server exports neither)",
    "failed": "requests of the turn the server refused or that streamed nothing; their "
              "conversation ends there",
}
