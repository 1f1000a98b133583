"""The ``specdec`` command: ``specdec generate`` (one prompt) and ``specdec bench`` (ITL harness).

    specdec generate --prompt "def fibonacci(n):" --method eagle3 -k 3
    specdec generate --prompt "x = " --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'
    specdec bench --quick --out /tmp/bench
    specdec serve --method eagle3 -k 3 --port 8000        # needs the serve extra
    specdec bench serve --launch --quick --out /tmp/bench-serve

A bad flag or a bad speculative config prints one line on stderr and exits with status 2.
"""

import argparse
import importlib.metadata
import json
import math
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from specdec.config import default_aux_layer_ids

# --method choices; "torchair-mtp" is method "mtp" with graph_mode "torchair"
METHODS = ("none", "mtp", "eagle", "eagle3", "torchair-mtp", "extract_hidden_states")
DEFAULT_METHOD, DEFAULT_K = "eagle3", 3


class UsageError(Exception):
    """A bad flag or config: reported as one line, exit status 2."""

    def __str__(self):
        return " ".join(super().__str__().split())


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage block), exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def speculative_config(method: str, k: int, padded: bool, override: str | None = None) -> dict | None:
    """The vLLM-style dict for ``--method/-k/--no-padded``, updated by the ``override`` JSON.

    ``speculative_config("torchair-mtp", 2, True)`` ->
    ``{"method": "mtp", "num_speculative_tokens": 2, "disable_padded_drafter_batch": False,
    "graph_mode": "torchair"}``; method "none" with no override -> None (no speculation).
    """
    if method not in METHODS:
        raise UsageError(f"method={method!r} is not supported; allowed: {METHODS}")
    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": k,
                "disable_padded_drafter_batch": not padded}
        if method == "torchair-mtp":
            spec.update(method="mtp", graph_mode="torchair")
    if override is not None:
        try:
            extra = json.loads(override)
        except json.JSONDecodeError as e:
            raise UsageError(f"--speculative-config is not valid JSON ({e}): {override!r}") from None
        if not isinstance(extra, dict):
            raise UsageError(f"--speculative-config must be a JSON object, got {override!r}")
        spec = {**(spec or {}), **extra}
    return spec


def default_method(model: str | None) -> tuple[str, int]:
    """eagle3 with K=3 when the model folder has an ``../eagle3`` head, else none."""
    from specdec.engine.llm import DEFAULT_MODEL
    target = Path(model) if model is not None else DEFAULT_MODEL
    if (target.parent / "eagle3" / "config.json").exists():
        return DEFAULT_METHOD, DEFAULT_K
    return "none", DEFAULT_K


def default_device() -> str:
    """cuda when this torch has a CUDA device, else cpu."""
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--device, --dtype, --graph-backend (generate and serve)."""
    from specdec.engine.config import DTYPES
    from specdec.graphs import BACKENDS
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or npu (default: cuda when available, else cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="weights and activations (default float32)")
    p.add_argument("--graph-backend", default=None, choices=BACKENDS,
                   help="step wrapper of captured steps (default: the speculative config's "
                        "graph_mode, else eager)")


def engine_kwargs(args) -> dict:
    """LLM keyword arguments from add_engine_arguments' flags."""
    return dict(device=args.device or default_device(), dtype=args.dtype,
                graph_backend=args.graph_backend)


def build_llm(model: str | None, spec: dict | None, *, dp: int = 1, seed: int = 0, **kw):
    """``LLM(...)``; a config or engine construction error becomes a UsageError (one line)."""
    from specdec.engine.llm import LLM
    if dp < 1:
        raise UsageError(f"--dp={dp} must be >= 1")
    if dp > 1:  # the data-parallel engine launches the rank processes
        kw["data_parallel_size"] = dp
    if model is not None and not (Path(model) / "config.json").exists():
        raise UsageError(f"--model={model!r} has no config.json (an HF-style target folder is needed)")
    try:
        return LLM(model, speculative_config=spec, seed=seed, **kw)
    except (ValueError, TypeError, NotImplementedError, OSError) as e:
        raise UsageError(f"cannot build the engine: {type(e).__name__}: {e}") from None


def stats_table(out, seconds: float, spec: dict | None, engine: str) -> Table:
    """Acceptance length, per-position acceptance rate, tokens/s, drafted/accepted counts;
    ``engine`` (device, dtype, graph backend) in the title."""
    table = Table(title=f"speculative decoding ({engine})", header_style="bold",
                  caption="accept len = 1 + accepted / verifying steps; tok/s includes prefill")
    for col in ("method", "K", "batch", "tokens", "tok/s", "accept len", "drafted", "accepted",
                "accept rate per position"):
        table.add_column(col, justify="right" if col not in ("method", "batch") else "left",
                         no_wrap=True)
    n = len(out.token_ids)
    if spec is None:
        method, k, batch = "none", "-", "-"
    else:
        method, graph = spec.get("method", "?"), spec.get("graph_mode", "eager")
        method = ("torchair-mtp" if graph == "torchair" else
                  method if graph == "eager" else f"{method}/{graph}")
        k = str(spec.get("num_speculative_tokens", "?"))
        batch = "ragged" if spec.get("disable_padded_drafter_batch") else "padded"
    rates = " ".join(f"{a / d:.2f}" if d else "-" for a, d in zip(out.num_accepted, out.num_drafted))
    table.add_row(method, k, batch, str(n), f"{n / seconds:.1f}", f"{out.acceptance_length:.2f}",
                  str(sum(out.num_drafted)), str(sum(out.num_accepted)), rates or "-")
    return table


def extract_hidden_states_config(model: str | None, output_dir: str | None) -> dict:
    """draft_model_config for ``--method extract_hidden_states``: ``--output-dir`` and vLLM's
    default aux layers (2, L // 2, L - 3) of the target's L layers."""
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
    return {"output_dir": output_dir,
            "eagle_aux_hidden_state_layer_ids": list(default_aux_layer_ids(layers))}


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
    spec = speculative_config(method, k, not args.no_padded, args.speculative_config)
    if method == "extract_hidden_states":
        spec["draft_model_config"] = {**extract_hidden_states_config(args.model, args.output_dir),
                                      **spec.get("draft_model_config", {})}
    llm = build_llm(args.model, spec, dp=args.dp, seed=args.seed, **engine_kwargs(args))
    console = Console(width=max(Console().width, 120))
    try:
        if method == "torchair-mtp":  # graph compilation is not decoding: time it apart
            start = time.perf_counter()
            llm.generate(args.prompt, max_tokens=args.max_tokens, temperature=args.temperature)
            console.print(f"graph compile + warm-up: {time.perf_counter() - start:.1f} s "
                          "(not counted in tok/s)", highlight=False)
        start = time.perf_counter()
        out = llm.generate(args.prompt, max_tokens=args.max_tokens,
                           temperature=args.temperature)[0]
    except (ValueError, TypeError) as e:  # e.g. a str prompt for a model without a tokenizer
        raise UsageError(f"cannot generate: {e}") from None
    seconds = time.perf_counter() - start
    if out.finish_reason == "error":
        raise UsageError(f"the request failed: {out.error}")
    text = out.text if out.text is not None else " ".join(map(str, out.token_ids))
    console.print(args.prompt + text + "\n", markup=False, highlight=False)
    engine = f"{llm.device}, {str(llm.config.dtype).removeprefix('torch.')}, {llm.graph_backend}"
    console.print(stats_table(out, seconds, spec, engine))
    return 0


def add_generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate", help="generate text for one prompt and show the speculative statistics",
        description="Generate text for one prompt. Without --method or --speculative-config the "
                    f"method is {DEFAULT_METHOD} with K={DEFAULT_K} when the model folder has a "
                    "sibling eagle3/ head (the embedded default does), else none.")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--method", choices=METHODS, default=None,
                   help="drafter; torchair-mtp = mtp with graph_mode torchair; "
                        f"default: {DEFAULT_METHOD} if the model has an eagle3 head, else none")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help=f"K, draft tokens per step (default {DEFAULT_K})")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM-style dict, e.g. \'{"method": "mtp", "num_speculative_tokens": 2}\'; '
                        "its keys override --method/-k/--no-padded")
    p.add_argument("--no-padded", action="store_true",
                   help="ragged drafter batch (disable_padded_drafter_batch=True, host-synced)")
    p.add_argument("--model", default=None, metavar="PATH",
                   help="target folder; heads are found in its sibling mtp/, eagle/, eagle3/ "
                        "(default: the embedded model)")
    p.add_argument("--output-dir", default=None, metavar="DIR",
                   help="--method extract_hidden_states: the (empty) folder its "
                        "<request id>.safetensors files go to")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dp", type=int, default=1, help="data-parallel ranks (default 1)")
    add_engine_arguments(p)
    p.set_defaults(func=cmd_generate)


def add_bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="ITL benchmark sweep (also: python -m specdec.bench.itl)",
                       description="Inter-token-latency benchmark sweep; see specdec/bench/itl.py.")
    itl = import_bench()
    itl.add_arguments(p)
    p.set_defaults(func=itl.run_from_args)
    from specdec.bench import serve as bench_serve
    endpoint = p.add_subparsers(dest="bench_target", parser_class=OneLineParser).add_parser(
        "serve", help="measure an OpenAI-compatible endpoint (specdec serve, vllm serve)",
        description=bench_serve.__doc__.split("\n")[0])
    bench_serve.add_arguments(endpoint)
    endpoint.set_defaults(func=bench_serve.run_from_args)


def add_serve_parser(sub) -> None:
    from specdec.entrypoints import serve
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the serve extra)",
                       description=serve.__doc__.split("\n")[0])
    serve.add_arguments(p)
    p.set_defaults(func=serve.run_from_args)


def import_bench():
    """The ITL harness (``specdec/bench/itl.py``)."""
    from specdec.bench import itl
    return itl


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="specdec", description="Speculative decoding with padded drafters.")
    parser.add_argument("--version", action="version",
                        version=f"specdec {importlib.metadata.version('specdec')}")
    sub = parser.add_subparsers(dest="command", parser_class=OneLineParser)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # plain ``specdec``: say what it can do
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except UsageError as e:
        print(f"specdec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
