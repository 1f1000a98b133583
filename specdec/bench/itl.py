"""ITL (inter-token latency) harness: speculative methods x padded/ragged x K x concurrency.

    specdec bench --quick --out /tmp/bench           # or: python -m specdec.bench.itl --quick ...
    specdec bench --sweep specdec/bench/sweeps/concurrency.yaml --out /tmp/bench
    specdec bench --methods none,eagle3 --modes padded,ragged -k 1,3 --concurrency 1,4,16

How one run is measured: ``concurrency`` requests (held-out prompts of ``prompt_len`` tokens,
``ignore_eos``, exactly ``output_len`` output tokens) are added at t0, then ``llm.step()`` is
called until the engine is idle. A request's *chunks* are the steps that emitted tokens for it,
stamped when ``step()`` returns. Per request: TTFT = first chunk - t0; E2E = last chunk - t0;
TPOT = (E2E - TTFT) / (tokens - 1); every token of a later chunk gets ITL = (chunk gap) /
(tokens in the chunk), so the ITL samples of a request add up to its decode time E2E - TTFT.
Acceptance length = 1 + accepted drafts / verifying steps (the engine's per-request
definition, pooled over requests: a verifying step is one request in one step that verified
drafts). Engines are built once per (method, mode, K), warmed up (warm-up runs excluded), then
the repeats are interleaved across configurations (odd repeats in reverse order) so drift of
the machine hits every configuration alike.

Output: a rich table, ``OUT/results.json`` (every figure, per repeat and pooled, and the
environment) and PNG plots (ITL distribution per config, ITL and throughput vs concurrency).

The code is split along these steps: ``specdec.bench.sweep`` (configurations, prompts, runs,
the sweep), ``specdec.bench.metrics`` (figures and summaries), ``specdec.bench.report`` (the
table and hints), ``specdec.bench.plots``; this module is the command line, and every name
of those modules stays importable from here.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console

from specdec.bench.datasets import NAMES as DATASET_NAMES
from specdec.bench.metrics import (DEFINITIONS, _dist, _ms, _spread, dist,  # noqa: F401
                                   repeat_figures, summarize)
from specdec.bench.plots import (percentile_band, plot_footer, row_label,  # noqa: F401
                                 series_style, write_plots)
from specdec.bench.report import (TABLE_COLUMNS, _f, k_schedule_lines,  # noqa: F401
                                  results_table, skipped_lines, slower_hint, table_title)
from specdec.bench.sweep import (DEFAULT_SWEEP, LIST_KEYS, METHODS, MODES,  # noqa: F401
                                 OPT_IN_METHODS, QUICK_SWEEP, SCHEMA_VERSION, WORKLOADS, BenchConfig,
                                 DatasetPrompts, Engine, PromptSource, ReqStats,
                                 build_engines, check_sweep, check_syncs,
                                 comparison_warnings, copy_bandwidth, environment, expand, load_sweep, load_warnings, measure,
                                 measure_dp, merge_ranks, run_figures, run_round, run_sweep,
                                 synthetic_model, weight_read)
from specdec.config import TREE_METHODS
from specdec.engine.config import DTYPE_ALIASES, DTYPE_CHOICES, auto_dtype
from specdec.engine.inputs import checkpoint_dtype
from specdec.flags import (UsageError, add_tree_arguments, default_device, floats, ints,
                           tree_depth, tree_keys, words)
from specdec.graphs import BACKENDS
from specdec.models.synthetic import SHAPES, SYNTHETIC_DTYPE

# ---- command line -----------------------------------------------------------------------------
_ints, _words = ints, words  # the older private names (now in specdec.flags)


def json_list(text: str) -> list:
    """An argparse type: a JSON list, e.g. '[[1, 4, 3], [5, 64, 0]]'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"must be a JSON list, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_SWEEP

    def csv(key):
        return ",".join(map(str, d[key]))

    p.add_argument("--quick", action="store_true",
                   help="the quick sweep: every method and mode, K=3, concurrency 1,4, "
                        "32-token prompts, 32 output tokens, 4 repeats (see docs/benchmarks.md for "
                        "its measured duration; default: the full sweep below)")
    p.add_argument("--sweep", metavar="FILE", help="YAML or JSON sweep file (keys: "
                   + ", ".join(DEFAULT_SWEEP) + "); flags given on the command line override "
                   "it (default: none)")
    p.add_argument("--out", default="bench-results", metavar="DIR",
                   help="where results.json and the PNGs go (default: bench-results)")
    p.add_argument("--methods", type=words,
                   help=f"comma list of {','.join(METHODS)} (default: all of them), and "
                        "draft_model (with --draft-model)")
    p.add_argument("--modes", type=words, help="comma list of padded,ragged (default: both)")
    p.add_argument("-k", "--num-speculative-tokens", type=ints, dest="k",
                   help=f"comma list of K values (default {csv('k')})")
    p.add_argument("--concurrency", type=ints,
                   help=f"comma list of requests in flight (default {csv('concurrency')})")
    p.add_argument("--prompt-len", type=ints, dest="prompt_len",
                   help=f"comma list of prompt tokens (default {csv('prompt_len')})")
    p.add_argument("--output-len", type=ints, dest="output_len",
                   help=f"comma list of output tokens (default {csv('output_len')})")
    p.add_argument("--repeats", type=int,
                   help=f"measured runs per configuration (default {d['repeats']})")
    p.add_argument("--warmup", type=int,
                   help=f"warm-up runs per configuration, excluded (default {d['warmup']})")
    p.add_argument("--seed", type=int, help=f"engine and prompt seed (default {d['seed']})")
    p.add_argument("--temperature", type=float, help="0 = greedy (default 0)")
    p.add_argument("--model", metavar="PATH", help="target folder (default: the embedded model)")
    p.add_argument("--dp", type=int, help="data-parallel ranks (default 1)")
    p.add_argument("--device", help="cpu, cuda or npu (default: cuda or npu when present, "
                                    "else cpu)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES,
                   help="auto: the checkpoint's torch_dtype, float32 on CPU (default: auto)")
    p.add_argument("--synthetic", help=f"a synthetic target instead of --model: "
                   f"{', '.join(SHAPES)} (zero weights, heads to match: every draft accepted; "
                   "default: none)")
    p.add_argument("--draft-acceptance", type=floats, dest="draft_acceptance", metavar="R,..",
                   help="with --synthetic: the head's drafts accepted at these rates per "
                        "position (e.g. 0.75,0.6,0.45, EAGLE-3 on Llama-3.1-8B), one per "
                        "draft position up to the largest K (default: every draft accepted)")
    p.add_argument("--graph-backend", dest="graph_backend",
                   help=f"step wrapper of padded steps: {', '.join(BACKENDS)} (default: cuda_graph "
                        "on CUDA, else eager; ragged steps always run eager)")
    p.add_argument("--workload", choices=WORKLOADS,
                   help="prompts: stdlib (held-out stdlib windows) or repeat (a window, then "
                        "its start again: a rewrite-this-code request; default: stdlib)")
    p.add_argument("--draft-model", dest="draft_model", metavar="DIR",
                   help="the folder of method draft_model's causal LM (with --methods "
                        "...,draft_model; default: none)")
    p.add_argument("--k-schedule", type=json_list, dest="k_schedule", metavar="JSON",
                   help="K per step for every speculative config: speculative_config's "
                        "num_speculative_tokens_per_batch_size, e.g. '[[1, 4, 3], [5, 64, 0]]' "
                        "(batch sizes 1-4 draft 3, 5-64 none; default: K every step)")
    p.add_argument("--num-prompts", type=int, dest="num_prompts", metavar="N",
                   help="requests per run, sent as bench serve sends them: a closed loop of "
                        "--concurrency in flight, a new one as one finishes (default: one "
                        "batch of --concurrency requests)")
    p.add_argument("--dataset-name", dest="dataset_name", choices=DATASET_NAMES,
                   help="prompts: random (generated, --workload) or a file's: custom (vLLM's "
                        "JSONL: prompt, output_tokens, category), sharegpt (the first human "
                        "turn; its reply's length as the output length), spec_bench "
                        "(SpecBench's question.jsonl: category, turns); rows with a category "
                        "run as one config per category (default: random)")
    p.add_argument("--dataset-path", dest="dataset_path", metavar="FILE",
                   help="the file of --dataset-name custom, sharegpt or spec_bench "
                        "(default: none)")
    add_tree_arguments(p, "every speculative engine (methods: none and the tree drafters "
                          "unless given; modes: padded)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV blocks of prompt prefixes across requests "
                   "(the engines' default: on)")
    p.add_argument("--pack-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill chunks fill each step's token budget (the engines' default: "
                        "off on cpu without a head or draft model, else on; specdec serve's "
                        "flag)")
    p.add_argument("--max-num-batched-tokens", type=int, dest="max_num_batched_tokens",
                   help="token budget of a step (default: max(256, concurrency x (K + 1)); "
                        "give specdec serve's to compare with a server)")


def sweep_from_args(args) -> dict:
    sweep = dict(QUICK_SWEEP) if args.quick else {}
    if args.sweep:
        sweep.update(load_sweep(args.sweep))
    for key in DEFAULT_SWEEP:
        v = getattr(args, key, None)
        if v is not None:
            sweep[key] = v
    tree = tree_keys(args)
    if tree:  # the drafters that draft trees (draft_model when named), padded; a static
        sweep["tree"] = tree  # tree's depth as K
        sweep.setdefault("methods",
                         ["none", *(m for m in TREE_METHODS if m not in OPT_IN_METHODS)])
        sweep.setdefault("modes", ["padded"])
        if "speculative_token_tree" in tree and "k" not in sweep:
            sweep["k"] = [tree_depth(tree["speculative_token_tree"])]
    sweep.setdefault("device", default_device())  # LLM's rule: the accelerator if present
    sweep["dtype"] = resolve_dtype(sweep)
    return check_sweep(sweep)


def resolve_dtype(sweep: dict) -> str:
    """The sweep's dtype name: "auto" (the default) resolved as ``LLM`` does (the model's
    checkpoint dtype or a synthetic target's bfloat16; float32 on CPU), vLLM's aliases to their
    names; any other value is left for ``check_sweep`` to judge."""
    import torch
    dtype = sweep.get("dtype", "auto")
    if dtype != "auto":
        return DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    try:
        device = torch.device(sweep["device"])
    except (RuntimeError, TypeError):  # check_sweep names the bad device
        device = torch.device("cpu")
    ckpt = SYNTHETIC_DTYPE if sweep.get("synthetic") else checkpoint_dtype(sweep.get("model"))
    try:
        return str(auto_dtype(ckpt, device)).removeprefix("torch.")
    except ValueError as e:
        raise UsageError(f"--dtype auto: {e}") from None


def run_from_args(args) -> int:
    sweep = sweep_from_args(args)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out={args.out!r} cannot be created: {e}") from None
    start = time.perf_counter()
    err = Console(stderr=True)
    err.print(f"specdec bench: device {sweep['device']}, dtype {sweep['dtype']}", highlight=False)
    results = run_sweep(sweep, err)
    t = time.perf_counter()
    results["plots"] = write_plots(results, out)
    results["phase_seconds"]["plots_s"] = time.perf_counter() - t
    results["wall_seconds"] = time.perf_counter() - start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    console = Console()
    console.print(results_table(results, console.width))
    for line in results["warnings"]:
        console.print(f"warning: {line}", markup=False, highlight=False, soft_wrap=True)
    for line in skipped_lines(results):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if (hint := slower_hint(results)) is not None:
        console.print(hint, markup=False, highlight=False, soft_wrap=True)
    for line in k_schedule_lines(results):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    console.print(f"wrote {out / 'results.json'} and {', '.join(results['plots']) or 'no plots'} "
                  f"in {results['wall_seconds']:.1f} s", markup=False, highlight=False,
                  soft_wrap=True)
    if not any(c["status"] == "ok" for c in results["configs"]):
        raise UsageError("nothing was measured: every config was skipped or failed (the "
                         "reasons are above)")
    return 0


def main(argv: list[str] | None = None) -> int:
    from specdec.flags import OneLineParser, document_defaults
    p = OneLineParser(prog="specdec bench", description=__doc__.split("\n")[0])
    add_arguments(p)
    document_defaults(p)
    args = p.parse_args(argv)
    try:
        return run_from_args(args)
    except UsageError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
