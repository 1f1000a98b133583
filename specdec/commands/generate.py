"""``specdec generate``: one prompt, its text, and a table of the speculative statistics
(or, for ``--method extract_hidden_states``, what was written)."""

import json
import math
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.config import default_aux_layer_ids
from specdec.flags import (DEFAULT_K, DEFAULT_METHOD, UsageError, add_engine_arguments,
                           add_speculation_arguments, build_llm, default_method, engine_kwargs,
                           ints, refuse_drafter_flags_without_a_drafter, speculative_config,
                           tree_keys)


def method_label(spec: dict | None) -> tuple[str, str, str]:
    """(method, K, batch) as the tables show them: torchair-mtp for mtp with graph_mode
    torchair, ``method/graph`` for other graph modes, ``-`` for no speculation."""
    if spec is None:
        return "none", "-", "-"
    method, graph = spec.get("method", "?"), spec.get("graph_mode", "eager")
    method = ("torchair-mtp" if graph == "torchair" else
              method if graph == "eager" else f"{method}/{graph}")
    return (method, str(spec.get("num_speculative_tokens", "?")),
            "ragged" if spec.get("disable_padded_drafter_batch") else "padded")


DEFAULT_BATCHED_TOKENS = 256  # LLM's default max_num_batched_tokens
STATS_COLUMNS = ("method", "K", "batch", "tokens", "tok/s", "accept\nlen", "drafted", "accepted")


COLD = ("tok/s: this process's first run, cold (it includes one-time start-up work: first "
        "kernels, lazy compiles); --compare-plain times every row warm")
WARM = "tok/s: timed warm (after a first run of the prompt)"


def stats_table(rows: list[tuple], engine: str, warm: bool = False) -> Table:
    """One row per run: method, K, batch (padded/ragged), output tokens, tok/s, acceptance
    length, drafted/accepted counts; ``engine`` (device, dtype, graph backend) in the title.
    ``rows``: (out, seconds, spec). ``warm``: the rows were timed after a first run (else the
    caption says tok/s is cold). Fits 80 columns whatever K is: the per-position rates are
    printed below it (rate_lines)."""
    table = Table(title=f"speculative decoding ({engine})", header_style="bold",
                  caption="accept len = 1 + accepted / verifying steps; tok/s includes "
                          f"prefill. {WARM if warm else COLD}")
    for col in STATS_COLUMNS:
        table.add_column(col, justify="left" if col in ("method", "batch") else "right",
                         no_wrap=True)
    for out, seconds, spec in rows:
        n = len(out.token_ids)
        table.add_row(*method_label(spec), str(n), f"{n / seconds:.1f}",
                      f"{out.acceptance_length:.2f}", str(sum(out.num_drafted)),
                      str(sum(out.num_accepted)))
    return table


def rate_lines(rows: list[tuple]) -> list[str]:
    """Per speculative row: its acceptance rate at each draft position (1st, 2nd, ...), one
    line that the console folds at its width (so K = 20 reads as well as K = 3)."""
    lines = []
    for out, _, spec in rows:
        if spec is None or not out.num_drafted:
            continue
        rates = " ".join(f"{a / d:.2f}" if d else "-"
                         for a, d in zip(out.num_accepted, out.num_drafted))
        lines.append(f"{method_label(spec)[0]} accept rate per draft position 1-"
                     f"{len(out.num_drafted)}: {rates}")
    return lines


def compare_hint(rows: list[tuple]) -> str | None:
    """One line when this run measured speculation and plain decoding (``--compare-plain``)
    and speculation gave fewer tokens/s; None otherwise (one row measured: no guess)."""
    spec_rows = [(len(o.token_ids) / s, spec) for o, s, spec in rows if spec is not None]
    plain_rows = [len(o.token_ids) / s for o, s, spec in rows if spec is None]
    if not spec_rows or not plain_rows or spec_rows[0][0] >= plain_rows[0]:
        return None
    return (f"hint: {method_label(spec_rows[0][1])[0]} was slower than plain decoding in this "
            f"run ({spec_rows[0][0]:.1f} vs {plain_rows[0]:.1f} tok/s): it wins only when the "
            "acceptance length exceeds the time of a speculative step over a plain one, which "
            "on a CPU the drafter's forwards make large (docs/benchmarks.md).")


def hidden_states_summary(out, output_dir: str) -> list[str]:
    """What ``--method extract_hidden_states`` wrote for one request: the file, its tensors
    and their shapes (T = the prompt's tokens; generated tokens are not written)."""
    from safetensors import safe_open
    path = Path(output_dir) / f"{out.request_id}.safetensors"
    if not path.exists():
        return [f"no file written at {path} (finish_reason {out.finish_reason})"]
    with safe_open(str(path), "pt") as f:
        shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    lines = [f"wrote {path}:"]
    lines += [f"  {name} {shape}" for name, shape in shapes.items()]
    t = shapes.get("token_ids", ["?"])[0]
    lines.append(f"  T = {t}: the prompt's {len(out.prompt_token_ids)} tokens (the "
                 f"{len(out.token_ids)} generated tokens are not written); "
                 "hidden_states [T, aux layers, hidden size]")
    return lines


def extract_hidden_states_config(model: str | None, output_dir: str | None,
                                 aux_layer_ids: list[int] | None = None) -> dict:
    """draft_model_config for ``--method extract_hidden_states``: ``--output-dir`` and the
    aux layers: ``--aux-layer-ids``, else vLLM's default (2, L // 2, L - 3) of the target's L
    layers (held inside [0, L))."""
    from specdec.engine.llm import DEFAULT_MODEL
    from specdec.models.checkpoint import load_config
    if output_dir is None:
        raise UsageError("--method extract_hidden_states needs --output-dir DIR (where the "
                         "hidden-state files are written)")
    try:
        layers = load_config(Path(model) if model is not None else DEFAULT_MODEL)[
            "num_hidden_layers"]
    except (ValueError, KeyError) as e:
        raise UsageError(f"--model={model!r}: cannot read num_hidden_layers ({e})") from None
    ids = aux_layer_ids if aux_layer_ids is not None else list(default_aux_layer_ids(layers))
    if bad := [i for i in ids if not 0 <= i < layers]:
        raise UsageError(f"--aux-layer-ids={','.join(map(str, ids))}: {bad} outside the "
                         f"target's layers [0, {layers})")
    return {"output_dir": output_dir, "eagle_aux_hidden_state_layer_ids": ids}


def cmd_generate(args) -> int:
    if args.max_tokens < 1:
        raise UsageError(f"--max-tokens={args.max_tokens} must be >= 1")
    if not args.temperature >= 0 or math.isinf(args.temperature):  # NaN fails ">= 0"
        raise UsageError(f"--temperature={args.temperature} must be finite and >= 0 "
                         "(0 = greedy)")
    method, k = default_method(args.model) if args.method is None else (args.method, DEFAULT_K)
    if method == "extract_hidden_states":
        k = 1  # the only K it runs with
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else k
    spec = speculative_config(method, k, not args.no_padded, args.speculative_config,
                              args.draft_model, args.num_speculative_tokens is not None,
                              tree_keys(args))
    refuse_drafter_flags_without_a_drafter(args, spec)
    extracting = spec is not None and spec.get("method") == "extract_hidden_states"
    for flag, given in (("--output-dir", args.output_dir is not None),
                        ("--aux-layer-ids", args.aux_layer_ids is not None),
                        ("--overwrite-output-dir", args.overwrite_output_dir)):
        if given and not extracting:
            raise UsageError(f"{flag} applies to --method extract_hidden_states only; the "
                             f"method here is {spec['method'] if spec else 'none'!r}")
    if extracting and args.num_speculative_tokens is None and "num_speculative_tokens" not in (
            json.loads(args.speculative_config) if args.speculative_config else {}):
        spec["num_speculative_tokens"] = 1  # the method implies it
    if extracting:
        from specdec.proposers.extract_hidden_states import holds_hidden_states
        given = spec.get("draft_model_config", {})
        for flag, key, value in (
                ("--output-dir", "output_dir", args.output_dir),
                ("--aux-layer-ids", "eagle_aux_hidden_state_layer_ids", args.aux_layer_ids),
                ("--overwrite-output-dir", "overwrite_output_dir",
                 True if args.overwrite_output_dir else None)):
            if value is not None and key in given:
                raise UsageError(f"{flag} and --speculative-config's draft_model_config."
                                 f"{key}={given[key]!r} both set it; give one")
        dmc = extract_hidden_states_config(args.model, args.output_dir, args.aux_layer_ids)
        if args.overwrite_output_dir:
            dmc["overwrite_output_dir"] = True
        dmc = spec["draft_model_config"] = {**dmc, **spec.get("draft_model_config", {})}
        if not dmc.get("overwrite_output_dir") and holds_hidden_states(Path(dmc["output_dir"])):
            raise UsageError(f"--output-dir={dmc['output_dir']} already holds *.safetensors "
                             "files; pick an empty folder or add --overwrite-output-dir")
    k = spec["num_speculative_tokens"] if spec else 0
    budget = args.max_num_batched_tokens
    if budget is None:  # one step verifies 1 + K tokens: the default budget grows to fit
        budget = max(DEFAULT_BATCHED_TOKENS, 1 + k)
    # one prompt, one request slot by default: a capturing or compiling backend warms up the
    # graphs of one running request, not of LLM's default 16 (--compare-plain's: the same)
    if args.max_num_seqs < 1:
        raise UsageError(f"--max-num-seqs={args.max_num_seqs}: allowed an int >= 1")
    engine_args = dict(seed=args.seed, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=budget, **engine_kwargs(args))
    llm = build_llm(args.model, spec, **engine_args)
    console = Console()
    engine = f"{llm.device}, {str(llm.config.dtype).removeprefix('torch.')}, {llm.graph_backend}"

    def timed(llm):
        start = time.perf_counter()
        try:
            out = llm.generate(args.prompt, max_tokens=args.max_tokens,
                               temperature=args.temperature)[0]
        except (ValueError, TypeError) as e:  # e.g. a str prompt, no tokenizer in the model
            raise UsageError(f"cannot generate: {e}") from None
        if out.finish_reason == "error":
            raise UsageError(f"the request failed: {out.error}")
        return out, time.perf_counter() - start

    if method == "torchair-mtp":  # graph compilation is not decoding: time it apart
        start = time.perf_counter()
        timed(llm)
        console.print(f"graph compile + warm-up: {time.perf_counter() - start:.1f} s "
                      "(not counted in tok/s)", highlight=False)
    out, seconds = timed(llm)
    text = out.text if out.text is not None else " ".join(map(str, out.token_ids))
    console.print(args.prompt + text + "\n", markup=False, highlight=False, soft_wrap=True)
    if extracting:  # no drafts, so no acceptance: say what was written instead
        for line in hidden_states_summary(out, spec["draft_model_config"]["output_dir"]):
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        return 0
    rows = [(out, seconds, spec)]
    warm = method == "torchair-mtp"  # its first run was the warm-up above
    if args.compare_plain and spec is not None:  # the same prompt without a drafter
        plain = build_llm(args.model, None, **engine_args)
        timed(plain)  # warm-up, as the speculative engine had (its first call above or here)
        rows.append((*timed(plain), None))
        if method != "torchair-mtp":  # time the speculative run warm too, as plain's
            rows[0] = (*timed(llm), spec)
        warm = True
    console.print(f"engine: {llm.config.describe(args.device is None)}", markup=False,
                  highlight=False)
    console.print(stats_table(rows, engine, warm))
    for line in rate_lines(rows):
        console.print(line, markup=False, highlight=False)
    if (hint := compare_hint(rows)) is not None:
        console.print(hint, markup=False, highlight=False, soft_wrap=True)
    if llm.startup is not None:  # what the captured / compiled backends spent before step 1
        console.print(f"start-up: {llm.startup}", markup=False, highlight=False)
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text for one prompt and show the speculative statistics",
        description="Generate text for one prompt. Without --method or --speculative-config the "
                    f"method is {DEFAULT_METHOD} with K={DEFAULT_K} when the model folder has a "
                    "sibling eagle3/ head (the embedded default does), else none.")
    p.add_argument("--prompt", required=True,
                   help="the prompt text (required; run through the model's tokenizer)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    add_speculation_arguments(p)
    p.add_argument("--model", default=None, metavar="PATH",
                   help="target folder; heads are found in its sibling mtp/, eagle/, eagle3/ "
                        "(default: the embedded model)")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="--method extract_hidden_states: the (empty) folder its "
                        "<request id>.safetensors files go to (no default: required with "
                        "that method)")
    p.add_argument("--aux-layer-ids", type=ints, default=None, metavar="IDS",
                   help="extract_hidden_states: comma list of the target layers whose hidden "
                        "states are written (default: vLLM's 2, L/2, L-3, held inside the "
                        "target's L layers)")
    p.add_argument("--overwrite-output-dir", action="store_true",
                   help="--method extract_hidden_states: write into --output-dir even if it "
                        "already holds *.safetensors files (default: refuse)")
    p.add_argument("--compare-plain", action="store_true",
                   help="also run the prompt without a drafter and show both rows, timed warm, "
                        "with a hint when speculation was slower (default: off)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="tokens per engine step (default: 256, or 1 + K when K is larger)")
    p.add_argument("--max-num-seqs", type=int, default=1, metavar="N",
                   help="request rows of the engine (its KV cache and captured batch sizes; "
                        "one prompt runs here: default 1)")
    p.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_generate)
