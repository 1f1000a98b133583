"""Suffix decoding against plain decoding on the agentic trace, served, side by side: pairs of
``specdec bench serve --launch --multi-turn`` runs (plain, suffix, plain, suffix, ...), each a
fresh server with prefix caching on, so the drift of a shared machine hits both alike.

By default each run is the command of docs/benchmarks.md "The agentic trace" (4 conversations
in flight, 5 turns, 32 output tokens, 3 repeats of 4 conversations, lock-step rounds;
``--speculative-config`` for the suffix side). ``--pacing free`` replays them as vLLM's
multi-turn benchmark does (each conversation's next turn as soon as its reply ends, a client
takes the next conversation when its own ends); ``--conversations 16 --repeats 1`` replays
the whole trace once. Tokens/s is the multi-turn report's: output tokens over the summed round
spans (rounds: a round's first request's send to its last chunk's arrival, client clock, so
it includes the turn's prefill and ends with the round's slowest conversation; free: the
whole replay). Printed per turn (rounds pacing) and over all rounds, with TTFT p50 and the
acceptance length, and the suffix / plain ratio per pair: the median and the min-max over the
pairs. Each pair's line also gives the machine's 1-minute load average: on a shared machine
a load spike in one run of a pair moves that pair's ratio (plain ran at 91-210 tok/s within
an hour on the 2-core CPU of docs/benchmarks.md), so use many pairs.

``--compare cache``: instead, pairs of one engine with prefix caching off and on (plain, or
``--cache-side spec``: the speculative config), printed per turn as TTFT p50 and p99 off /
on, their ratios and the hit rate: issue 54's "from the third turn on, p50 time to first
token at least 3x lower with the cache".

``--server-flags``: more flags for every launched server (e.g. ``"--pack-prefill"``).

    python -m benchmarks.bench_agentic [--pairs 3] [--speculative-config '{"method":"suffix"}']
        [--pacing rounds|free] [--conversations 4] [--repeats 3] [--out /tmp/bench-agentic]
        [--compare spec|cache] [--cache-side plain|spec] [--server-flags FLAGS]
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from specdec.bench import multiturn
from specdec.bench.serve import MULTI_TURN_PACINGS

TRACE = Path(__file__).resolve().parent.parent / "specdec/bench/traces/agentic.jsonl"
COMMON = ["--multi-turn", "5", "--concurrency", "4", "--output-len", "32",
          "--dataset-name", "spec_bench", "--dataset-path", str(TRACE)]


def run(side_args: list[str], out: Path, shape: list[str]) -> dict:
    """One ``specdec bench serve --launch`` run -> its config (turns and repeats)."""
    subprocess.run([sys.executable, "-m", "specdec.commands.cli", "bench", "serve", "--launch",
                    *side_args, *COMMON, *shape, "--out", str(out)], check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads((out / "results.json").read_text())["configs"][0]


def figures(config: dict) -> dict:
    """Per turn (1-based) and "all" (the report's ``overall``): tokens/s (output tokens /
    summed round spans), TTFT p50 and p99 (ms), acceptance length and prefix-cache hit rate,
    over the run's repeats (``multiturn.overall`` of the turn's rounds). Free-paced turns
    overlap: per turn only the TTFT (the rest None; "all" has them)."""
    repeats, pooled = config["repeats"], {}
    rounds_paced = config["pacing"] == "rounds"
    if rounds_paced:
        for t in range(1, max(map(len, repeats)) + 1):
            pooled[t] = multiturn.overall([[rounds[t - 1]] for rounds in repeats
                                           if t <= len(rounds)])
    else:  # the report's turns: TTFT over the repeats, the rest None
        pooled = {turn["turn"]: turn for turn in config["turns"]}
    pooled["all"] = config["overall"]

    def acceptance(key, s):  # plain verifies no drafts: 1.0
        return (s["acceptance_length"] or 1.0) if rounds_paced or key == "all" else None

    return {key: dict(tok_s=s["output_tokens_per_s"], ttft_p50=s["ttft_ms"]["p50"],
                      ttft_p99=s["ttft_ms"]["p99"], acc_len=acceptance(key, s),
                      hit=s["prefix_cache_hit_rate"]) for key, s in pooled.items()}


def spread(xs: list) -> str:
    """Median (min-max), or n/a where a run has no figure (None)."""
    if any(x is None for x in xs):
        return "n/a"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def interleaved(sides: dict, pairs: int, out: Path, shape: list[str], describe
                ) -> tuple[list[dict], list]:
    """``pairs`` rounds of one run per side (``sides``: name -> its flags, run in that order)
    -> (per round {side: figures}, the keys every run has); prints each round's line: the load
    average and ``describe(round)``."""
    runs = []
    for i in range(pairs):
        pair = {side: figures(run(flags, out / f"pair{i}-{side}", shape))
                for side, flags in sides.items()}
        runs.append(pair)
        print(f"pair {i + 1} (load average {os.getloadavg()[0]:.1f}): {describe(pair)}",
              flush=True)
    return runs, [k for k in runs[0][next(iter(sides))] if all(k in q[s] for q in runs
                                                                for s in sides)]


def compare_cache(flags: list[str], pairs: int, out: Path, shape: list[str]) -> None:
    """``pairs`` interleaved runs of one engine with prefix caching off, then on; prints each
    pair's TTFT p50 off / on per turn, then per turn the median (min-max) over the pairs."""
    sides = {"off": [*flags, "--no-enable-prefix-caching"], "on": flags}

    def ttft(pair: dict) -> str:
        return "TTFT p50 off / on: " + "  ".join(
            f"{k}: {off['ttft_p50']:.0f} / {on['ttft_p50']:.0f} ms = "
            f"{off['ttft_p50'] / on['ttft_p50']:.1f}x"
            for k, on in pair["on"].items()
            if (off := pair["off"].get(k)) and off["ttft_p50"] and on["ttft_p50"])
    runs, keys = interleaved(sides, pairs, out, shape, ttft)
    print(f"\n{' '.join(flags)}: prefix caching off vs on, {pairs} interleaved pairs; median "
          "(min-max) over pairs")
    print("turn | TTFT p50 ms off | on | off/on | TTFT p99 ms off | on | off/on | hit % | "
          "tok/s off | on")
    for k in keys:
        off, on = ([q[s][k] for q in runs] for s in sides)
        cells = [str(k)]
        for key in ("ttft_p50", "ttft_p99"):
            cells += [spread([x[key] for x in off]), spread([x[key] for x in on]),
                      spread([a[key] / b[key] if a[key] and b[key] else None
                              for a, b in zip(off, on)])]
        cells += [spread([None if x["hit"] is None else 100 * x["hit"] for x in on]),
                  spread([x["tok_s"] for x in off]), spread([x["tok_s"] for x in on])]
        print(" | ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=3, help="plain/suffix pairs (default 3)")
    p.add_argument("--speculative-config", default='{"method":"suffix"}',
                   help="the speculative side's config (default suffix, vLLM's defaults)")
    p.add_argument("--out", default="/tmp/bench-agentic", help="the runs' results folders")
    p.add_argument("--pacing", choices=MULTI_TURN_PACINGS, default="rounds",
                   help="--multi-turn-pacing of every run (default rounds)")
    p.add_argument("--conversations", type=int, default=4,
                   help="--num-prompts: conversations per repeat (default 4; the trace has 16)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per run (default 3)")
    p.add_argument("--compare", choices=["spec", "cache"], default="spec",
                   help="spec: plain against --speculative-config, the cache on (default); "
                        "cache: one engine with prefix caching off against on")
    p.add_argument("--cache-side", choices=["plain", "spec"], default="plain",
                   help="--compare cache's engine (default plain)")
    p.add_argument("--server-flags", default="", metavar="FLAGS",
                   help="more specdec serve flags for every run, one string (default none)")
    args = p.parse_args()
    for key in ("pairs", "conversations", "repeats"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key}={getattr(args, key)}: allowed an int >= 1")
    shape = ["--multi-turn-pacing", args.pacing, "--num-prompts", str(args.conversations),
             "--repeats", str(args.repeats)]
    extra = shlex.split(args.server_flags)
    sides = {"plain": ["--method", "none", *extra],
             "spec": ["--speculative-config", args.speculative_config, *extra]}
    if args.compare == "cache":
        compare_cache(sides[args.cache_side], args.pairs, Path(args.out), shape)
        return
    if args.cache_side != "plain":
        raise SystemExit(f"--cache-side {args.cache_side}: only with --compare cache")
    pairs, keys = interleaved(sides, args.pairs, Path(args.out), shape, lambda pair: "  ".join(
        f"{k}: {pair['plain'][k]['tok_s']:.0f} / {pair['spec'][k]['tok_s']:.0f} tok/s "
        f"= {pair['spec'][k]['tok_s'] / pair['plain'][k]['tok_s']:.2f}x"
        for k in pair["plain"] if pair["plain"][k]["tok_s"]
        and pair["spec"].get(k, {}).get("tok_s")))
    keys = [k for k in keys if all(q[s][k]["tok_s"] for q in pairs for s in sides)]
    print(f"\n{args.speculative_config} vs plain, {args.pairs} interleaved pairs; median "
          "(min-max) over pairs")
    print("turn | plain tok/s | spec tok/s | spec/plain tok/s | TTFT p50 ms plain | spec | "
          "spec acc len")
    for k in keys:
        col = {s: [q[s][k] for q in pairs] for s in sides}
        print(" | ".join([str(k), spread([x["tok_s"] for x in col["plain"]]),
                          spread([x["tok_s"] for x in col["spec"]]),
                          spread([b["tok_s"] / a["tok_s"] for a, b in zip(col["plain"],
                                                                         col["spec"])]),
                          spread([x["ttft_p50"] for x in col["plain"]]),
                          spread([x["ttft_p50"] for x in col["spec"]]),
                          spread([x["acc_len"] for x in col["spec"]])]))


if __name__ == "__main__":
    main()
