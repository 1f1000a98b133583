"""ITL harness, metrics: per-repeat figures from one run's raw timings, and the pooling of
repeats into a configuration's summary (latencies in ms). Pure numpy: no engine, no torch."""

import numpy as np

DEFINITIONS = {
    "itl": "per output token after a request's first chunk: (gap to the previous chunk) / "
           "(tokens in the chunk); per request they add up to e2e - ttft",
    "ttft": "first chunk arrival - the request's add (one batch: every request added at t0; "
            "num_prompts: a closed loop, concurrency requests at t0, then one as one finishes)",
    "e2e": "last chunk arrival - the request's add",
    "tpot": "(e2e - ttft) / (output tokens - 1), per request",
    "output_tokens_per_s": "output tokens of the run / (last step end - t0)",
    "acceptance_length": "1 + accepted / verify_steps, pooled over requests; verify_steps = "
                         "(request, step) pairs that verified drafts (the engine's "
                         "RequestOutput.acceptance_length, pooled)",
    "acceptance_rate": "accepted / drafted tokens",
    "per_position_acceptance_rate": "accepted[j] / drafted[j] for draft position j",
    "drafter_share": "sum of drafter host wall time / sum of step wall time (on an accelerator "
                     "the drafter's launch time only)",
    "step_over_weight_read": "mean step time / weights.weight_read_ms (CUDA): 1 = the floor",
    "host_syncs_per_step": "host-device syncs inside the device part of a step (padded: 0), "
                           "from one separate untimed pass per config with the check on",
    "collectives_per_step": "DP collectives issued per step",
    "prefix_cache": "prefix_cache_queries: prompt tokens of the requests admitted (looked up in "
                    "the prefix cache), prefix_cache_hits: how many it held (vLLM's "
                    "prefix_cache_queries / _hits); hit rate = hits / queries",
    "captured_share": "steps whose target step replayed a captured (or compiled) graph / steps",
    "mean_step_k": "mean over steps of the step's K (with a K schedule, its batch size's; 0 "
                   "for plain decoding)",
    "dp": "with dp > 1 each rank runs its share of the requests (round-robin); its chunk "
          "arrivals are its cumulative step seconds; steps and requests are pooled over ranks",
    "spread": "std / min / max / p10 / p90 over repeats of the per-repeat value",
    "warnings": "load on the machine during the run, and padded/ragged pairs whose "
                "difference in mean ITL is smaller than the spread of either",
}



def _ms(xs) -> list[float]:
    return [1e3 * x for x in xs]


def _dist(xs_ms: list[float]) -> dict:
    a = np.asarray(xs_ms, dtype=np.float64)
    if a.size == 0:
        return dict(n=0, mean=None, p50=None, p90=None, p99=None, min=None, max=None)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return dict(n=int(a.size), mean=float(a.mean()), p50=float(p50), p90=float(p90),
                p99=float(p99), min=float(a.min()), max=float(a.max()))


def repeat_figures(raw: dict) -> dict:
    """The JSON record of one repeat (latencies in ms)."""
    drafted, accepted, vs = sum(raw["drafted"]), sum(raw["accepted"]), raw["verify_steps"]
    steps = max(raw["num_steps"], 1)
    return dict(
        itl_ms=_ms(raw["itl_s"]), ttft_ms=_ms(raw["ttft_s"]), e2e_ms=_ms(raw["e2e_s"]),
        tpot_ms=_ms(raw["tpot_s"]), decode_time_s=raw["decode_time_s"], wall_s=raw["wall_s"],
        output_tokens=raw["output_tokens"], output_tokens_per_s=raw["output_tokens"] / raw["wall_s"],
        num_steps=raw["num_steps"], step_seconds=raw["step_seconds"],
        draft_seconds=raw["draft_seconds"], collectives=raw["collectives"],
        captured_steps=raw["captured_steps"], captured_share=raw["captured_steps"] / steps,
        spec_tokens=raw["spec_tokens"], mean_step_k=raw["spec_tokens"] / steps,
        collectives_per_step=raw["collectives"] / steps,
        drafter_share=raw["draft_seconds"] / raw["step_seconds"] if raw["step_seconds"] else 0.0,
        prefix_cache_queries=raw["prefix_cache_queries"],
        prefix_cache_hits=raw["prefix_cache_hits"],
        num_drafted=raw["drafted"], num_accepted=raw["accepted"], verify_steps=vs,
        acceptance_length=1.0 + sum(raw["accepted"]) / vs if vs else 1.0,
        acceptance_rate=accepted / drafted if drafted else None,
        itl_mean_ms=float(np.mean(_ms(raw["itl_s"]))) if raw["itl_s"] else None)


def _spread(values: list) -> dict:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if v.size == 0:
        return dict(mean=None, std=None, min=None, max=None, p10=None, p90=None)
    p10, p90 = np.percentile(v, [10, 90])
    return dict(mean=float(v.mean()), std=float(v.std(ddof=1)) if v.size > 1 else 0.0,
                min=float(v.min()), max=float(v.max()), p10=float(p10), p90=float(p90))


def summarize(reps: list[dict]) -> dict:
    """Pool the repeats of one configuration; ``spread`` = variation of per-repeat values."""
    pool = lambda key: [x for r in reps for x in r[key]]  # noqa: E731
    k = max(len(r["num_drafted"]) for r in reps)
    drafted = [sum(r["num_drafted"][j] for r in reps if j < len(r["num_drafted"])) for j in range(k)]
    accepted = [sum(r["num_accepted"][j] for r in reps if j < len(r["num_accepted"]))
                for j in range(k)]
    vs = sum(r["verify_steps"] for r in reps)
    steps = sum(r["num_steps"] for r in reps)
    step_s = sum(r["step_seconds"] for r in reps)
    return dict(
        itl_ms=_dist(pool("itl_ms")), tpot_ms=_dist(pool("tpot_ms")),
        ttft_ms=_dist(pool("ttft_ms")), e2e_ms=_dist(pool("e2e_ms")),
        output_tokens_per_s=float(np.mean([r["output_tokens_per_s"] for r in reps])),
        output_tokens=sum(r["output_tokens"] for r in reps),
        decode_time_s=sum(r["decode_time_s"] for r in reps),
        num_steps=steps, ms_per_step=1e3 * step_s / max(steps, 1),
        captured_share=sum(r["captured_steps"] for r in reps) / max(steps, 1),
        mean_step_k=sum(r["spec_tokens"] for r in reps) / max(steps, 1),
        collectives=sum(r["collectives"] for r in reps),
        collectives_per_step=sum(r["collectives"] for r in reps) / max(steps, 1),
        drafter_share=sum(r["draft_seconds"] for r in reps) / step_s if step_s else 0.0,
        prefix_cache_queries=(queries := sum(r["prefix_cache_queries"] for r in reps)),
        prefix_cache_hits=(hits := sum(r["prefix_cache_hits"] for r in reps)),
        prefix_cache_hit_rate=hits / queries if queries else None,
        num_drafted=sum(drafted), num_accepted=sum(accepted), verify_steps=vs,
        num_drafted_per_position=drafted, num_accepted_per_position=accepted,
        acceptance_length=1.0 + sum(accepted) / vs if vs else 1.0,
        acceptance_rate=sum(accepted) / sum(drafted) if sum(drafted) else None,
        per_position_acceptance_rate=[a / d if d else None for a, d in zip(accepted, drafted)],
        spread={key: _spread([r[key] for r in reps]) for key in (
            "itl_mean_ms", "output_tokens_per_s", "acceptance_length", "drafter_share")})


# public names (specdec.bench.serve uses them)
ms, dist, spread = _ms, _dist, _spread
