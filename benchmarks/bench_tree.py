"""Draft trees against chains on the embedded model's trained heads (issue 53), on this CPU.

fit:    one run with a wide static tree (``WIDE``: every path of child ranks summing to <= 2,
        depth <= 5, and rank 3 at depth 1; 56 drafts) counts how often each node ends on
        the accepted path; a node's rate bounds its subtree's, so the N most often accepted
        nodes form a tree (``fitted``): the static tree of N drafts with the most expected
        acceptance under the run's own statistics (restricted to top-k <= K and depth <= D
        for the shapes below). Fitted on prompts ``--fit-seed`` (held-out stdlib windows),
        measured on other ones (``--seed``).
accept: acceptance length (1 + accepted drafts per verify step) of chain K=3, K=5, of the
        fitted static trees of 8 and 16 drafts at top-k 2 / 4 and depth 3 / 5, and of the
        dynamic trees (EAGLE-2: ``tree_topk`` 2 / 4, depth 3 / 5, 8 and 16 drafts, i.e.
        num_draft_tokens 9 and 17, and SGLang's 8 with its root; scored at the head's fitted
        ``tree_score_temperature``, and three of them at 1, EAGLE-2's raw probabilities: "raw
        dynamic"), greedy, for EAGLE-3 and MTP, over ``--num-prompts`` held-out prompts (16
        running at a time).
speed:  output tokens/s at one request (``--speed-prompts`` prompts one after another),
        ``--graph-backend`` (compile_dynamic: the draft step and target step compiled) for the
        best chain and the best tree of 8 drafts of each method, interleaved (chain, tree,
        chain, tree ... ``--repeats`` rounds, after one untimed prompt each; start-up
        compiles the greedy paths only): the median of the rounds' tree / chain ratios.
        ``--speed-only``: no fit, no acceptance table; chains K=3, 4 and 5
        (``--speed-chain-k``) against ``--speed-tree``:
        ``fitted`` (``FITTED_8``, the fitted static trees of docs/benchmarks.md) or
        ``dynamic`` (``--speed-dynamic TOPK,DRAFTS,DEPTH ...``, default 4,8,5:
        ``DYNAMIC_8``, the table's best 8-draft tree for both methods), every engine in
        each round; a tree's ratio is to the chain of highest median tokens/s.

``--threads N``: torch threads (default 1, the served engine's); ``--dtype``: the engines'
(default auto: float32 on a CPU).

``--methods suffix``: suffix decoding (no head, nothing to fit): chains K=3 and K=5 against
its trees (``num_draft_tokens``: 8 and 16 drafts, depth 3 and 5), at spec factor 1 (vLLM's
default) and at the factors that let a short match draft a wide tree (``SUFFIX``); its best
8-draft tree against its best chain in the speed part.

``--methods draft_model`` runs a separate draft model: ``--draft-model DIR``, or by default
the embedded model's first 2 layers with its final norm and lm_head (``layer_skip_draft``:
LayerSkip's early exit, untrained), written to a temporary folder with its fitted
``tree_score_temperature``.

    python -m benchmarks.bench_tree [--num-prompts 64] [--prompt-len 64] [--output-len 64]
        [--methods eagle3 mtp draft_model] [--draft-model DIR] [--graph-backend
        compile_dynamic] [--skip-speed | --speed-only]
"""

import argparse
import itertools
import json
import statistics
import tempfile
import time
import unittest.mock
from pathlib import Path

import torch

from benchmarks.layer_skip_draft import cut
from specdec import LLM, SamplingParams
from specdec.bench.sweep import PromptSource
from specdec.draft_tree import StaticTree
from specdec.engine import core
from specdec.engine.llm import DEFAULT_MODEL
from specdec.train.tree_temperature import fit_draft_model

WIDE = sorted({p for d in range(1, 6) for p in itertools.product(range(3), repeat=d)
               if sum(p) <= 2} | {(3,)}, key=lambda p: (len(p), p))
SHAPES = [(8, 2, 3), (8, 4, 3), (8, 2, 5), (8, 4, 5), (16, 2, 5), (16, 4, 5), (16, 4, 3)]
DYNAMIC = [(8, 2, 3), (8, 4, 3), (8, 2, 5), (8, 4, 5), (16, 4, 5), (16, 4, 3), (7, 4, 5)]
RAW = [(8, 2, 5), (8, 4, 5), (16, 4, 5)]  # the dynamic shapes also run at score temperature 1
DYNAMIC_8 = {"tree_topk": 4, "num_draft_tokens": 9}  # depth 5
# the fitted 8-draft static trees (depth <= 5) of docs/benchmarks.md, by method
FITTED_8 = {
    "eagle3": [(0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 1, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)],
    "mtp": [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)],
}
# suffix decoding's rows: name -> (K, speculative-config keys)
SUFFIX = {f"{kind} factor {f:g}": (k, {"suffix_decoding_max_spec_factor": f} | tree)
          for f in (1.0, 2.0, 4.0)
          for kind, k, tree in (("chain K=3", 3, {}), ("chain K=5", 5, {}),
                                ("tree 8 d3", 3, {"num_draft_tokens": 9}),
                                ("tree 8 d5", 5, {"num_draft_tokens": 9}),
                                ("tree 16 d5", 5, {"num_draft_tokens": 17}))}


def engine(method: str, k: int, tree=None, draft: Path | None = None, **kw) -> LLM:
    """``tree``: a static tree's paths, or speculative-config keys (a dynamic tree's
    tree_topk and num_draft_tokens; suffix's keys); ``draft``: method draft_model's folder."""
    spec = {"method": method, "num_speculative_tokens": k}
    if method == "draft_model":
        spec["model"] = str(draft)
    if isinstance(tree, dict):
        spec.update(tree)
    elif tree is not None:
        spec["speculative_token_tree"] = [list(p) for p in tree]
    return LLM(speculative_config=spec, max_num_seqs=16, max_model_len=256, **kw)


def run(llm: LLM, prompts, output_len: int, on_step=None, concurrency: int = 16) -> dict:
    """Greedy, ``concurrency`` requests at a time (closed loop) -> acceptance figures."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    waiting, running, done = list(prompts), [], []
    start = time.perf_counter()
    while waiting or running:
        while waiting and len(running) < concurrency:
            running.append(llm.add_request(waiting.pop(0), params))
        llm.step()
        if on_step is not None:
            on_step(llm)
        done += [r for r in running if r.finish_reason]
        running = [r for r in running if not r.finish_reason]
    seconds = time.perf_counter() - start
    steps = sum(r.num_steps_decoding for r in done)
    accepted = [sum(r.num_accepted[j] for r in done if j < len(r.num_accepted))
                for j in range(max(len(r.num_accepted) for r in done))]
    return {"acceptance_length": 1 + sum(accepted) / steps,
            "accepted_per_depth": [round(a / steps, 3) for a in accepted],
            "tokens_per_s": sum(len(r.output_token_ids) for r in done) / seconds}


def fit(method: str, prompts, output_len: int, draft: Path | None = None, **kw) -> dict:
    """Node -> how often it ended on the accepted path, per verify step (``WIDE``); ``kw``:
    more LLM arguments."""
    llm = engine(method, 5, WIDE, draft, **kw)
    tree, hits, steps = llm.spec.tree, [0] * len(WIDE), [0]

    def count(llm):
        path = llm.runner.tree_path[:len(llm.scheduler.scheduled)].tolist()
        for s, nodes in zip(llm.scheduler.scheduled, path):
            if s.spec_token_ids:
                steps[0] += 1
                for node in nodes:
                    if node > 0:
                        hits[node - 1] += 1
    run(llm, prompts, output_len, count)
    return {p: h / steps[0] for p, h in zip(tree.paths, hits)}


def fitted(rates: dict, size: int, top_k: int, depth: int) -> list[tuple[int, ...]]:
    """The ``size`` most accepted paths with ranks < top_k and at most ``depth`` long (their
    parents come first: a parent is accepted whenever its child is)."""
    allowed = [p for p in rates if len(p) <= depth and max(p) < top_k]
    chosen = sorted(allowed, key=lambda p: (-rates[p], len(p), p))[:size]
    StaticTree.from_paths(chosen)  # a tree: every parent chosen
    return sorted(chosen, key=lambda p: (len(p), p))


def head_rows(rates: dict) -> dict:
    """A head's (or draft model's) rows, name -> (K, tree): chains K=3 and K=5, the trees
    fitted to ``rates`` (``SHAPES``), the dynamic trees (``DYNAMIC``, ``RAW``)."""
    rows = {f"chain K={k}": (k, None) for k in (3, 5)}
    for size, top_k, depth in SHAPES:
        tree = fitted(rates, size, top_k, depth)
        rows[f"tree {size} top-{top_k} depth<={depth}"] = (max(map(len, tree)), tree)
    for size, top_k, depth in DYNAMIC:
        rows[f"dynamic {size} top-{top_k} depth {depth}"] = (
            depth, {"tree_topk": top_k, "num_draft_tokens": size + 1})
    for size, top_k, depth in RAW:
        rows[f"raw dynamic {size} top-{top_k} depth {depth}"] = (
            depth, {"tree_topk": top_k, "num_draft_tokens": size + 1,
                    "tree_score_temperature": 1.0})
    return rows


def speed(method: str, chains: dict, trees: dict, prompts, output_len: int,
          graph_backend: str, repeats: int, draft: Path | None = None, **kw) -> dict:
    """Tokens/s at one request of each chain and tree (name -> (depth, tree)), every engine
    once per round, ``repeats`` rounds -> per engine its runs and acceptance length (greedy:
    the same every run), and per tree the median over the rounds of its tokens/s over the
    best chain's in the same round (the chain of highest median tokens/s: a per-round
    maximum over noisy chains would favour the chains). ``kw``: more LLM arguments
    (dtype)."""
    # greedy rows only: start-up compiles the greedy paths alone (a third of its compiles);
    # one untimed prompt per engine then meets any shape start-up did not
    with unittest.mock.patch.object(core, "WARMUP_SAMPLING", ({},)):
        llms = {name: engine(method, k, t, draft, graph_backend=graph_backend, **kw)
                for name, (k, t) in {**chains, **trees}.items()}
    for llm in llms.values():
        run(llm, prompts[:1], output_len, concurrency=1)
    runs, accept = {name: [] for name in llms}, {}
    for _ in range(repeats):
        for name, llm in llms.items():
            figures = run(llm, prompts, output_len, concurrency=1)
            runs[name].append(figures["tokens_per_s"])
            accept[name] = figures["acceptance_length"]
    best = runs[max(chains, key=lambda c: statistics.median(runs[c]))]
    out = {name: {"tokens_per_s": runs[name], "acceptance_length": accept[name]}
           for name in llms}
    for name in llms:
        line = (f"{method}: 1 request, {graph_backend}, {name}: "
                f"{statistics.median(runs[name]):.0f} tok/s ({min(runs[name]):.0f}-"
                f"{max(runs[name]):.0f}), AL {accept[name]:.2f}")
        if name in trees:
            out[name]["ratio"] = statistics.median(t / b for t, b in zip(runs[name], best))
            line += f", / the best chain: median {out[name]['ratio']:.3f}"
        print(line, flush=True)
    return out


def dynamic_shape(text: str) -> tuple[int, dict]:
    """"TOPK,DRAFTS,DEPTH" -> (depth, a dynamic tree's keys)."""
    top_k, drafts, depth = (int(v) for v in text.split(","))
    return depth, {"tree_topk": top_k, "num_draft_tokens": drafts + 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fit-seed", type=int, default=2)
    ap.add_argument("--methods", nargs="+", default=["eagle3", "mtp"])
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="method draft_model's folder (default: the embedded model's first 2 "
                         "layers, layer_skip_draft)")
    ap.add_argument("--graph-backend", default="compile_dynamic")
    ap.add_argument("--speed-prompts", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--speed-only", action="store_true")
    ap.add_argument("--speed-chain-k", type=int, nargs="+", default=[3, 4, 5])
    ap.add_argument("--speed-tree", choices=["fitted", "dynamic"], default="dynamic")
    ap.add_argument("--speed-dynamic", nargs="+", default=["4,8,5"],
                    metavar="TOPK,DRAFTS,DEPTH", help="--speed-tree dynamic's trees")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: the served engine's)")
    ap.add_argument("--dtype", default="auto", help="the engines' (auto: float32 on a CPU)")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = LLM(speculative_config=None, max_model_len=256)
    source = PromptSource(base.tokenizer, base.vocab_size)
    prompts = source.prompts(args.num_prompts, args.prompt_len, args.seed)
    fit_prompts = source.prompts(args.num_prompts, args.prompt_len, args.fit_seed)
    draft, scratch = args.draft_model, tempfile.TemporaryDirectory()  # removed at exit
    if draft is None and "draft_model" in args.methods:
        draft = cut(DEFAULT_MODEL, Path(scratch.name) / "layer-skip-2", 2)
        fit_draft_model(DEFAULT_MODEL, draft)
    if args.speed_only and "suffix" in args.methods:
        ap.error("--speed-only runs a head's trees; suffix's speed part follows its rows "
                 "(run it without --speed-only)")
    if args.speed_only and args.speed_tree == "fitted" and set(args.methods) - set(FITTED_8):
        ap.error(f"--speed-tree fitted has trees for {sorted(FITTED_8)} only; "
                 "use --speed-tree dynamic")
    out = {}
    for method in args.methods:
        if args.speed_only:
            trees = ({"fitted": (5, FITTED_8[method])} if args.speed_tree == "fitted" else
                     {f"dynamic {v}": dynamic_shape(v) for v in args.speed_dynamic})
            out[method] = {"speed_1_request": speed(
                method, {f"chain K={k}": (k, None) for k in args.speed_chain_k}, trees,
                prompts[:args.speed_prompts], args.output_len, args.graph_backend,
                args.repeats, draft, dtype=args.dtype)}
            continue
        rows = SUFFIX if method == "suffix" else head_rows(
            fit(method, fit_prompts, args.output_len, draft, dtype=args.dtype))
        figures = {}
        for name, (k, tree) in rows.items():
            figures[name] = run(engine(method, k, tree, draft, dtype=args.dtype), prompts,
                                args.output_len)
            figures[name].update(tree=tree, depth=k)
            print(f"{method:7s} {name:26s} AL {figures[name]['acceptance_length']:.2f} "
                  f"per depth {figures[name]['accepted_per_depth']} "
                  f"({figures[name]['tokens_per_s']:.0f} tok/s at 16, eager)", flush=True)
        chain = max((f for n, f in figures.items() if n.startswith("chain")),
                    key=lambda f: f["acceptance_length"])
        # suffix: against its best chain (any factor); a head: against chain K=3
        base, base_name = ((chain, "best chain") if method == "suffix"
                           else (figures["chain K=3"], "chain K=3"))
        for kind in ("tree", "dynamic"):
            for size in (8, 16):
                shown = [f for n, f in figures.items() if n.startswith(f"{kind} {size} ")]
                if not shown:  # suffix: no dynamic trees
                    continue
                best = max(shown, key=lambda f: f["acceptance_length"])
                ratio = best["acceptance_length"] / base["acceptance_length"]
                print(f"{method}: best {kind} of {size} drafts / {base_name} AL {ratio:.2f}")
        best = max((f for n, f in figures.items() if n.split()[1] == "8"),
                   key=lambda f: f["acceptance_length"])
        out[method] = {"rows": figures}
        if args.skip_speed:
            continue
        out[method]["speed_1_request"] = speed(
            method, {"best chain": (chain["depth"], chain["tree"])},
            {"best tree of 8": (best["depth"], best["tree"])}, prompts[:args.speed_prompts],
            args.output_len, args.graph_backend, args.repeats, draft, dtype=args.dtype)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=list)


if __name__ == "__main__":
    main()
