"""ITL harness, plots: the ITL distribution per configuration and ITL / throughput vs
concurrency, each with a footer naming the machine, its load and the torch version."""

from pathlib import Path

import numpy as np

def series_style(method: str, mode: str, hue: int, palette) -> dict:
    """Padded and ragged differ in colour (dark / light shade of the method's hue), line and
    marker; the no-speculation baseline is black."""
    ragged = mode == "ragged"
    return dict(color="black" if method == "none" else palette[2 * hue + ragged],
                linestyle="--" if ragged else "-", marker="s" if ragged else "o")


def percentile_band(spreads: list[dict]) -> tuple[list[float], list[list[float]]]:
    """-> (means, [below, above]): the asymmetric p10-p90 band of the per-repeat values as
    errorbar offsets, e.g. mean 5, p10 4, p90 9 -> below 1, above 4 (never a negative
    offset, so never a bar below the smallest repeat)."""
    mid = [sp["mean"] if sp["mean"] is not None else np.nan for sp in spreads]
    below = [max(m - sp["p10"], 0.0) if sp["p10"] is not None else 0.0
             for m, sp in zip(mid, spreads)]
    above = [max(sp["p90"] - m, 0.0) if sp["p90"] is not None else 0.0
             for m, sp in zip(mid, spreads)]
    return mid, [below, above]


def row_label(c: dict, varying: set[str]) -> str:
    """A plot row's label in words, e.g. ``mtp padded K=3, concurrency 4`` (prompt and output
    lengths only when they vary: else they are in the title)."""
    head = c["method"] if c["mode"] in ("-", None) else f"{c['method']} {c['mode']}"
    if c["k"]:
        head += f" K={c['k']}"
    if c.get("tree"):
        head += f" ({c['tree']})"
    parts = [head, f"concurrency {c['concurrency']}"]
    if c.get("category") is not None:
        parts.append(f"category {c['category']}")
    if "prompt_len" in varying:
        parts.append(f"prompt {c['prompt_len']} tok")
    if "output_len" in varying:
        parts.append(f"output {c['output_len']} tok")
    return ", ".join(parts)


def plot_footer(results: dict) -> str:
    """Machine, load average and torch version: the context every plot's figures depend on."""
    env = results.get("environment") or {}
    load = env.get("load_average_at_start_1_5_15min") or env.get("load_average_1_5_15min")
    load_end = env.get("load_average_1_5_15min")
    machine = env.get("device_name") or "?"
    if machine == "cpu":
        machine = f"CPU {env.get('processor') or env.get('machine') or '?'}"
    parts = [f"{machine}, {env.get('cpu_count', '?')} CPUs, {env.get('torch_threads', '?')} "
             f"torch threads", f"torch {env.get('torch', '?')}"]
    if load:
        parts.append("load average (1 min) " + (f"{load[0]:.1f} at start, {load_end[0]:.1f} at end"
                                                 if load_end and load_end is not load
                                                 else f"{load[0]:.1f}"))
    if results.get("kind") == "endpoint":
        server = results.get("server") or {}
        parts.append(f"server: {server.get('name', '?')} at {results['sweep'].get('base_url')}")
    return "; ".join(parts)


def _readable_log_axis(axis) -> None:
    """Log-scale ticks at 1, 2, 5 x 10^n, written as plain numbers (0.5, 1, 2, 5, 10, ...)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def write_plots(results: dict, out: Path) -> list[str]:
    """ITL distribution per config; ITL and output tok/s vs concurrency (padded solid, ragged
    dashed). Every plot has a footer with the machine, load average and torch version, and
    its legend outside the axes. -> file names written under ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ok = [c for c in results["configs"] if c["status"] == "ok"]
    if not ok:
        return []
    endpoint = results.get("kind") == "endpoint"
    where = ""
    if endpoint:
        server = results.get("server") or {}
        where = (f"\nfrom a server: {server.get('name', '?')} serving "
                 f"{results['sweep'].get('model')!r} (client clock)")
    footer = plot_footer(results)
    varying = {key for key in ("prompt_len", "output_len") if len({c[key] for c in ok}) > 1}
    fixed = ", ".join(f"{'prompt' if key == 'prompt_len' else 'output'} {ok[0][key]} tokens"
                      for key in ("prompt_len", "output_len") if key not in varying)

    def finish(fig, name):
        fig.text(0.005, 0.005, footer, fontsize=6, color="0.35", ha="left", va="bottom")
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        names.append(name)

    names = []
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(ok) + 2.2))
    data = [[x for r in c["repeats"] for x in r["itl_ms"]] or [float("nan")] for c in ok]
    ax.boxplot(data, orientation="horizontal", showfliers=True, flierprops=dict(markersize=2),
               medianprops=dict(color="tab:orange", linewidth=1.5))
    ax.set_yticks(range(1, len(ok) + 1), [row_label(c, varying) for c in ok], fontsize=7)
    ax.invert_yaxis()  # first config on top, as in the table
    ax.set_xlabel("ITL per output token (ms)")
    ax.set_title("ITL distribution per configuration (all repeats"
                 + (f"; {fixed}" if fixed else "") + ")" + where, fontsize=10)
    if all(np.isfinite(d).any() and np.nanmin(d) > 0 for d in data) and np.nanmax(
            [np.nanmax(d) for d in data]) / np.nanmin([np.nanmin(d) for d in data]) > 30:
        ax.set_xscale("log")
        _readable_log_axis(ax.xaxis)
    ax.grid(axis="x", alpha=0.3, which="major")
    ax.legend(handles=[Line2D([], [], color="tab:orange", linewidth=1.5,
                              label="median (half the tokens waited longer)"),
                       Patch(facecolor="white", edgecolor="black",
                             label="box: middle half (p25 to p75)"),
                       Line2D([], [], color="black", label="whiskers: up to 1.5 box lengths"),
                       Line2D([], [], color="black", marker="o", linestyle="", markersize=3,
                              markerfacecolor="none", label="circles: tokens beyond the whiskers")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    finish(fig, "itl_distribution.png")

    groups: dict[tuple, list[dict]] = {}
    for c in ok:
        groups.setdefault((c["method"], c["k"], c["prompt_len"], c["output_len"],
                           c.get("category"), c["mode"]), []).append(c)
    palette = plt.get_cmap("tab20").colors  # pairs: dark (padded), light (ragged) of a hue
    for fname, ylabel, key in (("itl_vs_concurrency.png", "mean ITL (ms)", "itl_mean_ms"),
                               ("throughput_vs_concurrency.png", "output tokens/s",
                                "output_tokens_per_s")):
        fig, ax = plt.subplots(figsize=(9, 5))
        hues = {}
        for (method, k, p, o, category, mode), cs in groups.items():
            cs = sorted(cs, key=lambda c: c["concurrency"])
            hue = hues.setdefault((method, k, category), len(hues) % 10)
            label = row_label(dict(cs[0], concurrency=0), varying).replace(", concurrency 0", "")
            mid, band = percentile_band([c["summary"]["spread"][key] for c in cs])
            ax.errorbar([c["concurrency"] for c in cs], mid, yerr=band, capsize=3, label=label,
                        **series_style(method, mode, hue, palette))
        ax.set_xscale("log", base=2)
        concs = sorted({c["concurrency"] for c in ok})
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        modes = {c["mode"] for c in ok}
        style = ("\npadded: solid, circles; ragged: dashed, squares"
                 if {"padded", "ragged"} <= modes else "")
        ax.set_title(f"{ylabel} vs concurrency (bars: p10-p90 over repeats"
                     + (f"; {fixed}" if fixed else "") + ")" + style + where, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
        fig.tight_layout()
        finish(fig, fname)
    return names


def write_turn_plots(results: dict, out: Path) -> list[str]:
    """``bench serve --multi-turn``: TTFT p50 (solid) and p99 (dashed), and output tokens/s,
    by turn index, one colour per concurrency; -> the file name written under ``out``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = [c for c in results["configs"] if c["status"] == "ok" and c["turns"]]
    if not configs:
        return []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(configs):
        color = f"C{i % 10}"
        turns = [row["turn"] for row in c["turns"]]
        label = f"{c['method']}, {c['concurrency']} conversations"
        ax1.plot(turns, [row["ttft_ms"]["p50"] for row in c["turns"]], "-o", color=color,
                 label=f"{label}: p50")
        ax1.plot(turns, [row["ttft_ms"]["p99"] for row in c["turns"]], "--s", color=color,
                 label=f"{label}: p99")
        if c.get("pacing") == "free":  # turns overlap: the whole replay's rate
            ax2.axhline(c["overall"]["output_tokens_per_s"], color=color, ls="--",
                        label=f"{label} (free pacing: the whole replay)")
        else:
            ax2.plot(turns, [row["output_tokens_per_s"] for row in c["turns"]], "-o",
                     color=color, label=label)
    turns = sorted({row["turn"] for c in configs for row in c["turns"]})
    for ax, ylabel in ((ax1, "TTFT (ms)"), (ax2, "output tokens/s (the turn's round)")):
        ax.set_xticks(turns)
        ax.set_xlabel("turn (its request holds every earlier turn and reply)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    server = results.get("server") or {}
    fig.suptitle(f"multi-turn replay: {server.get('name', '?')} serving "
                 f"{results['sweep'].get('model')!r} (client clock)", fontsize=10)
    fig.tight_layout()
    fig.text(0.005, 0.005, plot_footer(results), fontsize=6, color="0.35", ha="left",
             va="bottom")
    fig.savefig(out / "turns.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return ["turns.png"]
