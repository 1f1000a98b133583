"""``specdec bench serve --multi-turn N``: conversations replayed through the chat API.

Turn t of a conversation POSTs (streamed) to ``/v1/chat/completions`` its messages so far:
user turn 1, the reply the server streamed back to it, ..., user turn t; the reply to turn t
becomes the assistant message before turn t+1 (as vLLM's ``benchmarks/multi_turn`` replaces a
dataset's assistant turns with the server's answers). A conversation's user turns are a
dataset's (``spec_bench``: its ``turns``; ``sharegpt``: its human turns; ``custom``: one
turn) or, for ``random``, N held-out stdlib windows of ``--prompt-len`` tokens; at most N are
sent. ``--concurrency C``: conversations in flight (vLLM's ``--max-active-conversations``:
each conversation has one request in flight at a time, so C is also the requests in flight).

``--multi-turn-pacing rounds`` (the default): lock-step rounds. Round t sends turn t of every
conversation that has one, C at a time, and waits for all of them before round t+1, so each
turn index is measured on its own: TTFT p50/p99, output tokens/s (the round's output tokens /
its span), the prompt tokens (from ``usage``), the acceptance length and the prefix-cache hit
rate (deltas of /metrics over the round: ``vllm:prefix_cache_hits`` /
``vllm:prefix_cache_queries``; n/a without them). ``free``: vLLM's pacing, C clients that
each send a conversation's next turn as soon as its reply ends and take the next conversation
when theirs ends; turns overlap, so per turn only TTFT and prompt tokens, and tokens/s,
acceptance length and hit rate over the whole replay (``overall``, in both pacings: output
tokens over the summed round spans). A turn the server refuses (e.g. the conversation outgrew
``max_model_len``) ends that conversation; its turn counts it as failed, with its error.
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


def conversations(data: "datasets.Dataset | None", opts: dict, tok, n: int, seed: int,
                  start: int = 0) -> list[datasets.Conversation]:
    """``n`` conversations of at most ``multi_turn`` user turns, the ``start``-th on of the
    bench's replay (the conversations its earlier runs sent: every repeat at every
    concurrency). ``data``'s: positions ``start`` to ``start + n - 1`` of one seeded shuffle
    (``datasets.pick``), so no run replays a conversation an earlier one sent while the file
    has enough, then they recur, as vLLM oversamples (a replayed conversation would find its
    prefixes in the prefix cache and its replies in a suffix drafter's cache); for ``random``
    (``data`` None) generated ones, seeded by ``seed + start``."""
    turns = opts["multi_turn"]
    if data is None:
        source = bench_sweep.PromptSource(tok, tok.get_vocab_size())
        windows = source.prompts(n * turns, opts["prompt_len"], seed + start)
        return [datasets.Conversation([tok.decode(w) for w in windows[i * turns:(i + 1) * turns]],
                                      [None] * turns, None, f"random:{start + i}")
                for i in range(n)]
    return [c._replace(turns=c.turns[:turns], max_tokens=c.max_tokens[:turns])
            for c in datasets.pick(data.conversations, start + n, seed)[start:]]


async def replay(base_url: str, body: dict, convs: list[datasets.Conversation],
                 concurrency: int, output_len: int, on_round,
                 pacing: str = "rounds") -> list[list[dict]]:
    """The conversations replayed; -> per round, one record per request sent (in send order):
    {conversation, turn, messages, send, chunks, output_tokens, prompt_tokens, text} or
    {conversation, turn, messages, error}. ``pacing`` "rounds": lock-step rounds (round t:
    turn t of every live conversation, ``concurrency`` in flight); "free" (vLLM's
    ``benchmarks/multi_turn``): ``concurrency`` clients, each takes the next conversation when
    its last one ends and sends a turn as soon as the reply before it has ended, so the whole
    replay is one round. ``on_round(t)`` is called before round t starts and after the last
    one ends (t = number of rounds): the /metrics scrape points."""
    import aiohttp
    if pacing not in bench_serve.MULTI_TURN_PACINGS:
        raise ValueError(f"pacing={pacing!r}: allowed "
                         f"{', '.join(bench_serve.MULTI_TURN_PACINGS)}")
    history = [[] for _ in convs]  # messages so far, per conversation
    alive = [True] * len(convs)
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=600.0), read_bufsize=2**20,
            connector=aiohttp.TCPConnector(limit=concurrency + 4)) as session:
        async def turn(i: int, t: int, sent: list[dict]) -> None:
            """Sends conversation i's turn t; its record joins ``sent`` when sent, and the
            reply its history when it ends (an error ends the conversation)."""
            messages = history[i] + [{"role": "user", "content": convs[i].turns[t]}]
            rec = dict(conversation=i, turn=t + 1, messages=messages)
            async with sem:
                sent.append(rec)
                try:
                    rec.update(await bench_serve.stream_one(
                        session, f"{base_url}/v1/chat/completions",
                        {**body, "messages": messages,
                         "max_tokens": convs[i].max_tokens[t] or output_len}))
                except (RuntimeError, aiohttp.ClientError) as e:
                    rec["error"] = str(e)[:300]
            if "error" not in rec and not rec["chunks"]:
                rec["error"] = "no tokens streamed"
            if "error" in rec:
                alive[i] = False
            else:
                history[i] = messages + [{"role": "assistant", "content": rec["text"]}]

        if pacing == "free":
            sent, queue = [], iter(range(len(convs)))

            async def client() -> None:
                for i in queue:  # shared: each conversation goes to the first free client
                    for t in range(len(convs[i].turns)):
                        await turn(i, t, sent)
                        if not alive[i]:
                            break

            on_round(0)
            await asyncio.gather(*(client() for _ in range(concurrency)))
            on_round(1)
            return [sent]
        rounds = []
        for t in range(max(len(c.turns) for c in convs)):
            todo = [i for i, c in enumerate(convs) if alive[i] and t < len(c.turns)]
            if not todo:
                break
            on_round(t)
            sent = []
            await asyncio.gather(*(turn(i, t, sent) for i in todo))
            rounds.append(sent)
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


def free_turns(recs: list[dict]) -> list[dict]:
    """A free-paced replay's records -> per turn index, ``round_figures`` of its requests
    without the figures that need a span or counters of their own (turns overlap: tokens/s,
    acceptance length and hit rate are the replay's, in ``overall``)."""
    by_turn: dict[int, list[dict]] = {}
    for rec in recs:
        by_turn.setdefault(rec["turn"], []).append(rec)
    return [dict(round_figures(by_turn[t], {}, {}), output_tokens_per_s=None, span_s=None)
            for t in sorted(by_turn)]


def overall(reps: list[list[dict]]) -> dict:
    """Every round of every repeat pooled: ``turn_summary``'s figures with tokens/s the output
    tokens over the summed round spans (rounds: the time a request was in flight; free: the
    replays' spans)."""
    rounds = [r for rep in reps for r in rep]
    span = sum(r["span_s"] for r in rounds)
    out = turn_summary("all", rounds)
    out["output_tokens_per_s"] = out["output_tokens"] / span if span else None
    return out


def bench(opts: dict, base_url: str, model: str, label: str, k: int, console, tok,
          data: "datasets.Dataset | None", mode: str = "server",
          server: dict | None = None) -> dict:
    """Warm up (generated single-turn prompts: the conversations' text is not sent before
    it is measured), then per concurrency the repeats of the replay; -> results.json dict
    (``kind`` "multi_turn", a ``turns`` list per config). ``tok``, ``data``:
    ``bench_serve.read_dataset``'s."""
    generated = bench_sweep.PromptSource(tok, tok.get_vocab_size())
    body = dict(model=model, temperature=0.0, stream=True, ignore_eos=True,
                stream_options=dict(include_usage=True, continuous_usage_stats=True))
    pacing = opts["multi_turn_pacing"]
    phases, t_start = {}, time.perf_counter()
    for w in range(opts["warmup"]):
        for c in opts["concurrency"]:
            records, _, _ = asyncio.run(bench_serve.run_once(
                base_url, {**body, "max_tokens": opts["output_len"]},
                generated.prompts(c, opts["prompt_len"], 10_000 + opts["seed"] + w), c, None, 0))
    phases["warmup_s"] = time.perf_counter() - t_start
    t = time.perf_counter()
    configs, sent = [], 0  # sent: conversations of the earlier runs
    for c in opts["concurrency"]:
        reps, by_turn = [], []  # by_turn: free pacing's per-turn figures, per repeat
        for r in range(opts["repeats"]):
            n = opts["num_prompts"] or c
            convs = conversations(data, opts, tok, n, opts["seed"], sent)
            sent += n
            scrapes = []
            rounds = asyncio.run(replay(base_url, body, convs, c, opts["output_len"],
                                        lambda _: scrapes.append(bench_serve.scrape(base_url)),
                                        pacing))
            reps.append([dict(round_figures(recs, scrapes[i], scrapes[i + 1]),
                              requests_sent=[dict(conversation=x["conversation"],
                                                  turn=x["turn"], messages=len(x["messages"]),
                                                  error=x.get("error")) for x in recs])
                         for i, recs in enumerate(rounds)])
            if pacing == "free":
                by_turn.append(free_turns(rounds[0]))
            console.print(f"repeat {r + 1}/{opts['repeats']} concurrency {c}: "
                          f"{len(convs)} conversations, "
                          f"{max(x['turn'] for recs in rounds for x in recs)} turns",
                          highlight=False)
        per_turn = by_turn if pacing == "free" else reps
        n_turns = max(len(x) for x in per_turn)
        turns = [turn_summary(i + 1, [x[i] for x in per_turn if i < len(x)])
                 for i in range(n_turns)]
        configs.append(dict(name=f"{label}-c{c}-multi_turn{opts['multi_turn']}", method=label,
                            mode=mode, k=k, concurrency=c, status="ok", pacing=pacing,
                            turns=turns, overall=overall(reps), repeats=reps))
    phases["measure_s"] = time.perf_counter() - t
    sweep = {**opts, "dp": 1, "base_url": base_url, "model": model}
    return dict(schema_version=bench_serve.SCHEMA_VERSION, kind="multi_turn",
                server=server or {}, definitions=DEFINITIONS,
                environment=bench_sweep.environment({"device": "cpu"}), sweep=sweep,
                prompt_source=(data.kind if data is not None
                               else "generated held-out stdlib text"),
                phase_seconds=phases, configs=configs,
                warnings=data.warnings() if data is not None else [])


DEFINITIONS = {
    "turn": "the index of a user turn; its request holds every earlier turn with the reply "
            "the server gave to it, then this turn",
    "pacing": "rounds: lock-step rounds; free: concurrency clients, each sends a "
              "conversation's next turn when its reply ends and takes the next conversation "
              "when it has none (vLLM's benchmarks/multi_turn)",
    "round": "rounds pacing: turn t of every conversation that has one, at most concurrency "
             "in flight; the next round starts when all of them have ended. free pacing: the "
             "whole replay",
    "overall": "every round of every repeat: output tokens / summed round spans, TTFT over "
               "every request, acceptance length and hit rate from the summed counters",
    "ttft": "first chunk arrival - request send (client clock)",
    "output_tokens_per_s": "output tokens of the round / (its last chunk arrival - its first "
                           "send), mean over repeats (free pacing: overall only)",
    "prompt_tokens_mean": "usage.prompt_tokens of the turn's requests (the chat template "
                          "rendered by the server), mean",
    "acceptance_length": "1 + accepted / verifying steps over the round, from /metrics "
                         "(free pacing: overall only)",
    "prefix_cache_hit_rate": "delta vllm:prefix_cache_hits / delta vllm:prefix_cache_queries "
                             "over the round (None: the server exports neither; free pacing: "
                             "overall only)",
    "failed": "requests of the turn the server refused or that streamed nothing; their "
              "conversation ends there",
}
