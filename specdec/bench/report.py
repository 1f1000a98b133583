"""ITL harness, report: the summary table (it fits 80 columns), the slower-than-plain hint,
and the skipped/failed lines."""

from rich import box
from rich.console import Console, Group
from rich.table import Table

def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


# headers stack on two lines so the numbers set the widths; every other figure is in results.json
TABLE_COLUMNS = ("method", "mode", "K", "conc", "ITL\nmean", "ITL\np99", "TTFT\nmean", "tok/s",
                 "acc\nlen", "acc rate per\nposition", "syncs\n/step", "capt\n%", "hit\n%")
RATES = "acc rate per\nposition"
HIT = "hit\n%"
NUMERIC = ("K", "conc", "ITL\nmean", "ITL\np99", "TTFT\nmean", "tok/s", "acc\nlen", "syncs\n/step",
           "capt\n%", "hit\n%")


def _row(c: dict) -> dict:
    """One ok config's table cells, by column."""
    s = c["summary"]
    itl = s["itl_ms"]
    mode = c["mode"] if c.get("tree") is None else f"{c['mode']}, {c['tree']}"
    hit = s.get("prefix_cache_hit_rate")  # (a results file from before prefix caching: none)
    return {"method": c["method"], "mode": mode, "K": str(c["k"] or "-"),
            "conc": str(c["concurrency"]), "category": c.get("category") or "-",
            "ITL\nmean": _f(itl["mean"]),
            "ITL\np99": _f(itl["p99"]), "TTFT\nmean": _f(s["ttft_ms"]["mean"], ".1f"),
            "tok/s": f"{s['output_tokens_per_s']:.0f}", "acc\nlen": _f(s["acceptance_length"]),
            RATES: " ".join(_f(x) for x in s["per_position_acceptance_rate"]) or "-",
            "syncs\n/step": _f(s["host_syncs_per_step"], ".1f"),
            "capt\n%": _f(100 * s["captured_share"], ".0f"),
            # prefix-cache hit rate: hit prompt tokens / prompt tokens looked up
            "hit\n%": _f(hit and 100 * hit, ".0f")}


def table_title(results: dict) -> str:
    """In-process sweep, or (results of ``specdec bench serve``) which server, model and URL."""
    sw = results["sweep"]
    if results.get("kind") == "endpoint":
        server = results.get("server") or {}
        return (f"endpoint ITL: {server.get('name', 'server')} serving {sw['model']!r} at "
                f"{sw['base_url']}, {sw['repeats']} repeats, client clock, latencies in ms")
    return f"ITL sweep: {sw['repeats']} repeats, dp={sw['dp']}, latencies in ms"


def _table(results: dict, columns, title: str | None, caption: str | None) -> Table:
    t = Table(title=title, caption=caption, header_style="bold", box=box.SIMPLE_HEAD,
              pad_edge=False, show_edge=False, collapse_padding=True)
    for col in columns:
        # method and mode never wrap or shrink: they name the row; the rates may wrap
        t.add_column(col, justify="right" if col in NUMERIC else "left",
                     no_wrap=col != RATES,
                     min_width=max(map(len, col.split("\n"))) if col != RATES else None)
    for c in results["configs"]:
        if c["status"] == "ok":
            row = _row(c)
            t.add_row(*(row[col] for col in columns))
    return t


def results_table(results: dict, width: int | None = None):
    """The summary table. With ``width`` (the console's columns) and a table wider than that,
    the per-position acceptance rates move to a second table below, keyed by method, mode, K
    and concurrency, so every column stays readable at 80 columns and in a redirected file."""
    caption = ("tok/s: mean over repeats; acc len = 1 + accepted / verifying steps; syncs: "
               "host-device syncs per step; capt: steps that replayed a captured or compiled graph; "
               "mode -: no drafter; all figures in results.json")
    if results.get("kind") == "endpoint":
        caption = ("tok/s: mean over repeats; acc len = 1 + accepted / verifying steps, from the "
                   "server's /metrics; mode: the drafter batch of a server the bench launched "
                   "(server: started elsewhere, not known); all figures in results.json")
    title = table_title(results)
    columns = with_category(results, TABLE_COLUMNS)
    full = _table(results, columns, title, caption)
    if width is None or Console(width=10_000).measure(full).maximum <= width:
        return full
    second = (HIT, RATES)  # the per-position rates and the hit rate: a table of their own
    main = _table(results, [c for c in columns if c not in second], title, caption)
    rates = _table(results, with_category(results, ("method", "mode", "K", "conc", *second)),
                   None, None)
    return Group(main, rates)


def with_category(results: dict, columns) -> tuple:
    """``columns`` with a category column after conc when a config has a category (a
    dataset's rows grouped by category: each category is its own run)."""
    if not any(c.get("category") is not None for c in results["configs"]):
        return tuple(columns)
    at = list(columns).index("conc") + 1
    return (*columns[:at], "category", *columns[at:])


def slower_hint(results: dict) -> str | None:
    """One line when a speculative config had a higher mean ITL than plain decoding (method
    none) at the same concurrency and lengths in this run; None otherwise."""
    ok = [c for c in results["configs"] if c["status"] == "ok"]
    def run(c):
        return c["concurrency"], c["prompt_len"], c["output_len"], c.get("category")

    plain = {run(c): c["summary"]["itl_ms"]["mean"] for c in ok if c["method"] == "none"}
    slower = [(c, plain[key]) for c in ok if c["method"] != "none"
              for key in [run(c)]
              if plain.get(key) is not None and c["summary"]["itl_ms"]["mean"] is not None
              and c["summary"]["itl_ms"]["mean"] > plain[key]]
    if not slower:
        return None
    c, base = max(slower, key=lambda x: x[0]["summary"]["itl_ms"]["mean"] / x[1])
    return (f"hint: {len(slower)} of {sum(c['method'] != 'none' for c in ok)} speculative "
            f"configs were slower than plain decoding here (worst: {c['method']} {c['mode']} "
            f"K={c['k']} at concurrency {c['concurrency']}, {c['summary']['itl_ms']['mean']:.2f} "
            f"vs {base:.2f} ms ITL): speculation wins only when the acceptance length exceeds "
            "the time of a speculative step over a plain one, which on a CPU the drafter's "
            "forwards make large (docs/benchmarks.md).")


def best_k_schedule(tok_s: dict[int, dict[int, float]]) -> list[list[int]]:
    """A K schedule (num_speculative_tokens_per_batch_size) from measured tokens/s:
    ``tok_s[concurrency][K]`` (K 0: plain decoding). Each measured concurrency takes the K of
    the most tokens/s and covers the batch sizes up to the next one; neighbours with the same
    K merge. E.g. {1: {0: 90, 3: 150}, 4: {0: 300, 3: 310}, 16: {0: 800, 3: 600}} ->
    [[1, 15, 3], [16, 16, 0]]."""
    concs = sorted(tok_s)
    schedule = []
    for i, c in enumerate(concs):
        k = max(tok_s[c], key=lambda kk: (tok_s[c][kk], -kk))
        hi = concs[i + 1] - 1 if i + 1 < len(concs) else c
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = hi
        else:
            schedule.append([c, hi, k])
    return schedule


def k_schedule_lines(results: dict) -> list[str]:
    """For a sweep run without a K schedule: per method and mode (and lengths), the schedule
    that picks this run's fastest K at each measured concurrency (plain decoding as K 0), as a
    ``--k-schedule`` value; nothing when plain decoding was not measured."""
    if results["sweep"].get("tree") is not None:  # a tree has one shape: no K schedule
        return []
    if results["sweep"].get("k_schedule") is not None or any(
            c.get("category") is not None for c in results["configs"]):
        return []  # (per category, one schedule each would be noise: none is derived)
    dp = results["sweep"].get("dp", 1)
    ok = [c for c in results["configs"] if c["status"] == "ok"]

    def run(c) -> tuple:
        return c["concurrency"], c["prompt_len"], c["output_len"], c.get("category")

    def batch(c) -> int:  # each rank picks K for its own batch: up to ceil(c / dp) requests
        return -(-c["concurrency"] // dp)

    plain = {run(c): c["summary"]["output_tokens_per_s"] for c in ok if c["method"] == "none"}
    measured = [c for c in ok if c["method"] != "none" and run(c) in plain]
    # of the concurrencies that give one batch size, the largest (every rank's batch that
    # full) speaks for it
    largest: dict[tuple, int] = {}
    for c in measured:
        key = (c["method"], c["mode"], c["prompt_len"], c["output_len"], batch(c))
        largest[key] = max(largest.get(key, 0), c["concurrency"])
    groups: dict[tuple, dict[int, dict[int, float]]] = {}
    for c in measured:
        *group, b = key = (c["method"], c["mode"], c["prompt_len"], c["output_len"], batch(c))
        if c["concurrency"] == largest[key]:
            groups.setdefault(tuple(group), {}).setdefault(b, {0: plain[run(c)]})[c["k"]] = \
                c["summary"]["output_tokens_per_s"]
    per = "per rank batch size" if dp > 1 else "per concurrency"
    return [f"hint: K schedule from this run for {m} {mode} (prompt {p}, output {o}; the fastest K "
            f"{per}, 0 = plain): --k-schedule '{best_k_schedule(g)}' -k "
            f"{max(k for ks in g.values() for k in ks)}"
            for (m, mode, p, o), g in groups.items()]


def skipped_lines(results: dict) -> list[str]:
    """One line per skipped (method, mode, K) with the reason, and per failed config with its
    error (the other configs were still measured)."""
    seen = {}
    for c in results["configs"]:
        if c["status"] == "skipped":
            seen.setdefault((c["method"], c["mode"], c["k"]), c["reason"])
    lines = [f"skipped {m} {mode} K={k}: {reason}" for (m, mode, k), reason in seen.items()]
    return lines + [f"failed {c['name']}: {c['error']}" for c in results["configs"]
                    if c["status"] == "failed"]


def turns_table(results: dict) -> Table:
    """``bench serve --multi-turn``: one row per (concurrency, turn) and an "all" row per
    concurrency: requests, mean prompt tokens, TTFT p50/p99, tokens/s, acceptance length and
    prefix-cache hit rate (n/a: the server exports no prefix-cache counters; "-": free pacing
    measures it over the whole replay only)."""
    sw = results["sweep"]
    server = results.get("server") or {}
    free = sw.get("multi_turn_pacing") == "free"
    t = Table(title=f"multi-turn: {server.get('name', 'server')} serving {sw['model']!r}, up "
                    f"to {sw['multi_turn']} turns, {sw['repeats']} repeats, "
                    f"{'free' if free else 'rounds'} pacing, client clock, ms",
              caption="a turn's request holds every earlier turn and its reply; "
                      + ("each conversation's next turn is sent when its reply ends (turns "
                         "overlap); all: the whole replay" if free else
                         "each turn index is one round (every conversation's turn t, then the "
                         "next); all: output tokens / summed round spans")
                      + "; hit %: prefix-cache hits / queries; all figures in results.json",
              header_style="bold", box=box.SIMPLE_HEAD,
              pad_edge=False, show_edge=False, collapse_padding=True)
    for col in ("method", "conc", "turn", "reqs", "prompt\ntok", "TTFT\np50", "TTFT\np99",
                "tok/s", "acc\nlen", "hit\n%"):
        t.add_column(col, justify="left" if col == "method" else "right", no_wrap=True)
    for c in results["configs"]:
        rows = c["turns"] + [c["overall"]]
        for i, row in enumerate(rows):
            hit = row["prefix_cache_hit_rate"]
            reqs = str(row["requests"]) + (f" ({row['failed']} failed)" if row["failed"] else "")
            # a free-paced turn's tokens/s, acceptance and hit rate: the replay's ("all")
            t.add_row(c["method"], str(c["concurrency"]), str(row["turn"]), reqs,
                      _f(row["prompt_tokens_mean"], ".0f"), _f(row["ttft_ms"]["p50"], ".1f"),
                      _f(row["ttft_ms"]["p99"], ".1f"), _f(row["output_tokens_per_s"], ".0f"),
                      _f(row["acceptance_length"]),
                      "-" if free and i < len(rows) - 1
                      else "n/a" if hit is None else f"{100 * hit:.0f}",
                      end_section=i == len(rows) - 2)
    return t


def failed_turn_lines(results: dict) -> list[str]:
    """One line per turn index with failed requests, with the first errors."""
    return [f"concurrency {c['concurrency']} turn {row['turn']}: {row['failed']} requests "
            f"failed (their conversations ended): {'; '.join(row['errors'])}"
            for c in results["configs"] for row in c["turns"] if row["failed"]]
