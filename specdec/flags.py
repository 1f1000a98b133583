"""What the ``specdec`` subcommands share, below all of them: the --method choices, the
speculative and engine flags, building an ``LLM`` from flags, and the one-line usage error.

A layer of its own, above the engine and below the command packages: ``specdec.commands``
(dispatch, generate), ``specdec.bench`` (the ITL harnesses) and ``specdec.entrypoints.serve``
import from here, and it imports none of them.
"""

import argparse
import json
from pathlib import Path

from specdec import config

# --method choices: "none" and config.METHODS, with "torchair-mtp" (method "mtp" with
# graph_mode "torchair") after the trained heads' methods, before "draft_model"
_AT = config.METHODS.index("draft_model")
METHODS = ("none", *config.METHODS[:_AT], "torchair-mtp", *config.METHODS[_AT:])
DEFAULT_METHOD, DEFAULT_K = "eagle3", 3
# the ITL harness sweeps the drafters that draft (extract_hidden_states never does) beside the
# target alone (a draft model needs a folder of its own: not a sweep key yet)
BENCH_METHODS = tuple(m for m in METHODS if m not in ("extract_hidden_states", "draft_model"))


class UsageError(Exception):
    """A bad flag or config: reported as one line, exit status 2."""

    def __str__(self):
        return " ".join(super().__str__().split())


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (no usage block), exit status 2.
    A flag this parser does not know, followed by a value, is reported as that flag: argparse
    would read the value as a subcommand (``specdec bench --dataset-name random`` -> "invalid
    choice: 'random' (choose from 'serve')")."""

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(args) if args is not None else None
        return super().parse_known_args(args, namespace)

    def error(self, message):
        given = getattr(self, "_given", None) or []
        if "invalid choice" in message and self._subparsers is not None:
            known = self._option_string_actions
            unknown = [a for a in given if a.startswith("-") and a.split("=")[0] not in known]
            if unknown:
                choices = next(a.choices for a in self._subparsers._group_actions)
                message = (f"unrecognized arguments: {' '.join(unknown)} (not a flag of "
                           f"{self.prog}; see {self.prog} --help; its subcommands: "
                           f"{', '.join(choices)})")
        self.exit(2, f"{self.prog}: error: {message}\n")


def document_defaults(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``parser`` and its subcommands says its default in --help: " (default:
    X)" is added where the help does not already name one (flags defined elsewhere, e.g. by
    ``specdec serve``, included); on/off switches are off unless given."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                document_defaults(sub)
            continue
        if (not action.option_strings or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction,
                                       argparse._HelpAction, argparse._VersionAction))):
            continue
        if "default" not in (action.help or ""):
            action.help = ((action.help or "").rstrip() + " (default: %(default)s)").lstrip()


def speculative_config(method: str, k: int, padded: bool, override: str | None = None,
                       draft_model: str | None = None, k_given: bool = True,
                       tree: dict | None = None) -> dict | None:
    """The vLLM-style dict for ``--method/-k/--no-padded/--draft-model``, updated by the
    ``override`` JSON (K from ``k`` when the JSON gives none, whatever the model). ``k_given``
    False (no -k): method suffix takes K = its max tree depth, as vLLM and ``LLM`` do.
    ``tree``: the draft-tree keys the flags gave (``tree_keys``); without -k a static tree's
    K is its depth.

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
        spec.setdefault("num_speculative_tokens", k)  # the JSON's K, else -k (or its default)
        k_given = k_given or "num_speculative_tokens" in extra
    if spec is not None and spec.get("method") == "suffix" and not k_given:
        depth = "suffix_decoding_max_tree_depth"  # K = the depth, as vLLM
        spec["num_speculative_tokens"] = spec.get(depth, config.SUFFIX_KEYS[depth][0])
    if tree:
        if spec is None:
            raise UsageError(f"--{next(iter(tree)).replace('_', '-')} sets the drafter's tree, "
                             "and no drafter runs here; give --method (mtp, eagle, eagle3)")
        spec.update(tree)
        if not k_given and "speculative_token_tree" in tree:
            spec["num_speculative_tokens"] = tree_depth(tree["speculative_token_tree"])
    if draft_model is not None:
        if spec is None or spec.get("method") != "draft_model":
            raise UsageError(f"--draft-model={draft_model!r} is method draft_model's folder; "
                             f"the method here is {method!r} (give --method draft_model)")
        if spec.get("model", draft_model) != draft_model:
            raise UsageError(f"--draft-model={draft_model!r} and --speculative-config's "
                             f"model={spec['model']!r} name two folders; give one")
        spec["model"] = draft_model
    if spec is not None and spec.get("method") == "draft_model" and "model" not in spec:
        raise UsageError("--method draft_model needs --draft-model DIR: the folder of a causal "
                         "LM with the target's tokenizer")
    return spec


def default_method(model: str | None) -> tuple[str, int]:
    """eagle3 with K=3 when the model folder has an ``../eagle3`` head, else none."""
    from specdec.engine.llm import DEFAULT_MODEL
    target = Path(model) if model is not None else DEFAULT_MODEL
    if (target.parent / "eagle3" / "config.json").exists():
        return DEFAULT_METHOD, DEFAULT_K
    return "none", DEFAULT_K


def default_device() -> str:
    """The accelerator when one is present (cuda, npu), else cpu: ``LLM``'s rule,
    ``specdec.platform.default_device``."""
    from specdec.platform import default_device
    return default_device()


def speculation_from_args(args) -> dict | None:
    """The speculative config of ``add_speculation_arguments``' flags and ``--model``:
    ``default_method`` when no --method is given, K from -k (else its default); ``serve``
    and ``bench serve --launch``."""
    method, k = default_method(args.model) if args.method is None else (args.method, DEFAULT_K)
    k = args.num_speculative_tokens if args.num_speculative_tokens is not None else k
    spec = speculative_config(method, k, not args.no_padded, args.speculative_config,
                              args.draft_model, args.num_speculative_tokens is not None,
                              tree_keys(args))
    refuse_drafter_flags_without_a_drafter(args, spec)
    return spec


def tree_depth(paths) -> int:
    """The depth of --speculative-token-tree's tree (its K when -k is not given); a bad tree
    is a UsageError naming the flag."""
    from specdec.draft_tree import StaticTree
    try:
        return StaticTree.from_paths(paths).max_depth
    except ValueError as e:
        raise UsageError(f"--speculative-token-tree: {e}") from None


def tree_keys(args) -> dict:
    """The speculative-config keys of the draft-tree flags given (``add_speculation_arguments``)."""
    keys = {"speculative_token_tree": args.speculative_token_tree,
            "tree_topk": args.tree_topk, "num_draft_tokens": args.num_draft_tokens,
            "tree_score_temperature": args.tree_score_temperature}
    return {key: value for key, value in keys.items() if value is not None}


def refuse_drafter_flags_without_a_drafter(args, spec: dict | None) -> None:
    """-k and --no-padded set the drafter: with none (method none, given or the default for a
    folder without an eagle3 head) they would do nothing, so they are refused."""
    if spec is not None:
        return
    why = ("--method none" if args.method == "none"
           else "no --method, and the model folder has no eagle3 head (the default is none)")
    for flag, given in ((f"-k {args.num_speculative_tokens}",
                         args.num_speculative_tokens is not None),
                        ("--no-padded", args.no_padded)):
        if given:
            raise UsageError(f"{flag} sets the drafter, and none runs here: {why}; give "
                             f"--method (allowed: {', '.join(m for m in METHODS if m != 'none')})")


def add_speculation_arguments(
        p, method_default: str = f"{DEFAULT_METHOD} if the model has an eagle3 head, else none"
) -> None:
    """--method, -k, --speculative-config, --no-padded on a parser or argument group
    (generate, serve, bench serve); ``method_default`` says what no --method means."""
    p.add_argument("--method", choices=METHODS, default=None,
                   help="drafter; torchair-mtp = mtp with graph_mode torchair; "
                        f"default: {method_default}")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help=f"K, draft tokens per step (default {DEFAULT_K}; method suffix: its "
                        "max tree depth, 24 unless the speculative config gives one, as vLLM)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help="vLLM-style dict, e.g. "
                        '\'{"method": "mtp", "num_speculative_tokens": 2}\'; '
                        "its keys override --method/-k/--no-padded; one that another flag "
                        "also sets (--draft-model, --output-dir, ...) is refused (default: none)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="method draft_model: the folder of a small causal LM with the target's "
                        "tokenizer (speculative_config.model; default: none)")
    add_tree_arguments(p, "the drafter")
    p.add_argument("--no-padded", action="store_true",
                   help="ragged drafter batch (disable_padded_drafter_batch=True, host-synced; "
                        "default: padded)")


def add_tree_arguments(p, who: str) -> None:
    """--speculative-token-tree, --tree-topk, --num-draft-tokens, --tree-score-temperature
    (``tree_keys``); ``who``
    drafts the tree (e.g. "the drafter")."""
    p.add_argument("--speculative-token-tree", default=None, metavar="PATHS",
                   help=f"{who} drafts a static tree: vLLM's paths of child ranks, e.g. "
                        "'[(0,), (1,), (0, 0)]' (the root's top 2, then the first one's top 1); "
                        "-k is its depth, its depth when -k is not given (default: a chain)")
    p.add_argument("--tree-topk", type=int, default=None, metavar="K",
                   help=f"{who} drafts a dynamic tree (EAGLE-2): each frontier node's K most "
                        "likely children ranked per depth, -k depths; with --num-draft-tokens "
                        "(default: a chain)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="a dynamic draft tree's tokens verified per request per step, the "
                        "root included (SGLang's count); alone with --method suffix: a suffix "
                        "tree of at most N - 1 drafts (default: a chain)")
    p.add_argument("--tree-score-temperature", type=float, default=None, metavar="T",
                   help="a dynamic tree scores its candidates by the head's log-softmax of "
                        "logits / T (a sampled request's: / its temperature when higher; "
                        "default: the head's config.json tree_score_temperature, else 1)")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """--device, --dtype, --graph-backend, --compile-backend, --async-scheduling,
    --enforce-eager, --gpu-memory-utilization, --tensor-parallel-size, --data-parallel-size,
    --enable-expert-parallel, --enable-prefix-caching / --no-enable-prefix-caching,
    --pack-prefill / --no-pack-prefill (generate, serve, bench serve --launch)."""
    from specdec.engine.config import DTYPE_CHOICES
    from specdec.graphs import BACKENDS
    p.add_argument("--device", default=None,
                   help="cpu, cuda, cuda:N or npu (default: cuda or npu when present, else cpu)")
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="weights and activations; auto: the checkpoint's torch_dtype, float32 "
                        "on CPU (default: auto)")
    p.add_argument("--graph-backend", default=None, choices=BACKENDS,
                   help="step wrapper of captured steps (default: the speculative config's "
                        "graph_mode, else cuda_graph on CUDA and eager elsewhere)")
    p.add_argument("--compile-backend", default=None, metavar="NAME",
                   help="torch.compile backend of a compiling graph backend (compile, "
                        "compile_dynamic, torchair): inductor, or eager to trace without "
                        "code generation (start-up in seconds, eager speed); any name "
                        "torch._dynamo.list_backends() gives (default: inductor)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="launch each decode step before the host has read the one before "
                        "(padded heads, draft models or none; one rank; default: off)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="vLLM's name for --graph-backend eager: no captured or compiled steps "
                        "(default: off)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="accelerators: the share (0, 1] of the device's memory the weights and "
                        "KV cache may take; without --max-num-seqs the KV cache gets the most "
                        "request rows that fits (at most 256); refused on cpu (default: none: "
                        "max_num_seqs rows)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="T",
                   help="tensor-parallel ranks of each data-parallel replica (vLLM's flag; "
                        "default 1)")
    p.add_argument("--data-parallel-size", "-dp", "--dp", type=int, default=None, metavar="D",
                   dest="data_parallel_size",
                   help="data-parallel ranks, each scheduling its own requests (vLLM's flag; "
                        "default 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="a MoE model's routed experts split whole over the data x tensor "
                        "parallel ranks (vLLM's flag; default: by expert over the DP ranks, by "
                        "width over the TP ranks); refused for a dense model")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="reuse the KV blocks of prompt prefixes across requests (vLLM's flag; "
                        "default: on, off for hybrid linear-attention models and "
                        "extract_hidden_states)")
    p.add_argument("--pack-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill chunks fill each step's token budget; --no-pack-prefill: a "
                        "step that ends a prompt holds no chunk of a prompt it cannot end, so "
                        "that prompt's first token waits for no later one's work (default: off "
                        "on cpu without a head or draft model, else on)")


def engine_kwargs(args) -> dict:
    """LLM keyword arguments from add_engine_arguments' flags."""
    kw = dict(device=args.device or default_device(), dtype=args.dtype or "auto",
              graph_backend=args.graph_backend, async_scheduling=args.async_scheduling)
    if args.enforce_eager:
        if args.graph_backend not in (None, "eager"):
            raise UsageError(f"--enforce-eager conflicts with --graph-backend "
                             f"{args.graph_backend}: --enforce-eager is --graph-backend eager; "
                             "give one")
        kw["graph_backend"] = "eager"
    if args.gpu_memory_utilization is not None:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    for dest, flag in (("tensor_parallel_size", "--tensor-parallel-size"),
                       ("data_parallel_size", "--data-parallel-size / --dp")):
        size = getattr(args, dest)
        if size is not None and size < 1:
            raise UsageError(f"{flag}={size}: allowed an int >= 1")
        if size is not None and size > 1:
            kw[dest] = size
    if args.enable_expert_parallel:
        kw["enable_expert_parallel"] = True
    for dest in ("enable_prefix_caching", "pack_prefill"):
        if getattr(args, dest) is not None:
            kw[dest] = getattr(args, dest)
    return kw | ({} if args.compile_backend is None else {"compile_backend": args.compile_backend})


def build_llm(model: str | None, spec: dict | None, *, seed: int = 0,
              synthetic: str | None = None, synthetic_init: str = "zeros",
              draft_acceptance: list[float] | None = None, **kw):
    """``LLM(...)``; a config or engine construction error becomes a UsageError (one line).
    ``data_parallel_size`` / ``tensor_parallel_size`` > 1: a launcher of the rank processes.
    ``synthetic``: the shape's target and head built here (``models.synthetic``; ``seed`` its
    weights' with ``synthetic_init`` "random"), drafting at ``draft_acceptance`` if given."""
    from specdec.engine.llm import LLM
    if synthetic is not None:
        kw |= synthetic_parts(synthetic, spec, model, synthetic_init, draft_acceptance, seed,
                              kw)
    elif draft_acceptance is not None:
        raise UsageError("--draft-acceptance sets a synthetic head's rates: give --synthetic")
    if model is not None and not Path(model).exists():
        raise UsageError(f"--model={model!r} does not exist (an HF-style target folder is "
                         "needed)")
    if model is not None and not (Path(model) / "config.json").exists():
        raise UsageError(f"--model={model!r} has no config.json (an HF-style target folder is needed)")
    try:
        llm = LLM(model, speculative_config=spec, seed=seed, **kw)
    except (ValueError, TypeError, NotImplementedError, OSError) as e:
        raise UsageError(f"cannot build the engine: {type(e).__name__}: {e}") from None
    return llm


def synthetic_parts(name: str, spec: dict | None, model: str | None, init: str,
                    acceptance: list[float] | None, seed: int, kw: dict) -> dict:
    """``LLM`` arguments of ``--synthetic NAME``: target, draft head and dtype (auto: the
    shapes' bfloat16 on an accelerator, float32 on a CPU); UsageError naming the flag."""
    import torch

    from specdec.engine.config import resolve_dtype
    from specdec.models.synthetic import SHAPES, SYNTHETIC_DTYPE, synthetic_engine
    if name not in SHAPES:
        raise UsageError(f"--synthetic={name!r}: allowed {', '.join(SHAPES)}")
    if model is not None:
        raise UsageError("--synthetic builds its own target: give no model folder")
    if kw.get("tensor_parallel_size", 1) > 1 or kw.get("data_parallel_size", 1) > 1:
        raise UsageError("--synthetic runs on one rank: give no --tensor-parallel-size / "
                         "--data-parallel-size")
    k = spec["num_speculative_tokens"] if spec else 0
    if acceptance is not None and len(acceptance) != k:
        raise UsageError(f"--draft-acceptance={','.join(map(str, acceptance))}: give one rate "
                         f"per draft position, {k} (num_speculative_tokens)")
    device = torch.device(kw.get("device") or default_device())
    try:
        dtype = resolve_dtype(kw.get("dtype", "auto"), SYNTHETIC_DTYPE, device)
        parts = synthetic_engine(name, spec["method"] if spec else None, dtype=dtype,
                                 device=device, seed=seed, init=init, acceptance=acceptance)
    except ValueError as e:
        raise UsageError(f"--synthetic {name}: {e}") from None
    return parts | dict(dtype=dtype)


def ints(s: str) -> list[int]:
    """argparse type: "1,4,16" -> [1, 4, 16]."""
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {s!r}") from None


def floats(s: str) -> list[float]:
    """argparse type: "0.75,0.6" -> [0.75, 0.6]."""
    try:
        return [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") \
            from None


def words(s: str) -> list[str]:
    """argparse type: "none,mtp" -> ["none", "mtp"]."""
    return [x for x in s.split(",") if x]
