"""A draft tree's decode step against a chain's, by phase, at one request (issue 53's speed).

    python -m benchmarks.profile_tree [--methods eagle3 mtp] [--backends eager compile_dynamic]

For each method it builds the chain (K=5), the fitted static tree of 8 drafts
(``bench_tree.FITTED_8``: docs/benchmarks.md's) and the dynamic one (``bench_tree.DYNAMIC_8``:
top-4, 8 drafts, depth 5), decodes one request, and profiles
``--steps`` decode steps under ``torch.profiler``, the engines interleaved (chain, tree,
chain, tree ...).
Each phase is a ``record_function`` range put around the engine's own methods from here
(nothing in the engine changes): prepare (host inputs), target (forward), verify (sampling,
the tree's K/V move; on compile_dynamic the forward and verify are one range: ``step``),
chain view (its index), draft (the proposer's step) and the rest of the engine step
(schedule, the chain view's gathers, the host read, applying the tokens). Per phase: aten operators
called from Python or a compiled graph (not those inside another aten operator), and host
ms, per step; the verify's own sub-phases in eager: the tree sampler and the K/V move.
"""

import argparse
import functools
import statistics

import torch

from benchmarks.bench_tree import DYNAMIC_8, FITTED_8, engine, run
from specdec import SamplingParams
from specdec.engine import runner as runner_module

PHASES = ("prepare", "target", "verify", "step", "sampler", "kv move", "chain view", "draft",
          "engine step")


def labelled(name: str, fn):
    @functools.wraps(fn)
    def call(*args, **kw):
        with torch.profiler.record_function(f"phase:{name}"):
            return fn(*args, **kw)
    return call


def instrument(llm) -> None:
    """Phase ranges around the engine's methods (instance attributes shadow them)."""
    r, core = llm.runner, llm.core
    r.prepare = labelled("prepare", r.prepare)
    r.chain_view = labelled("chain view", r.chain_view)
    r.proposer.propose = labelled("draft", r.proposer.propose)
    core.step = labelled("engine step", core.step)
    if llm.backend.dynamic:  # the forward and verify run inside compiled code
        r.target_graph.run = labelled("step", r.target_graph.run)
    else:
        r.target_forward = labelled("target", r.target_forward)
        r.verify = labelled("verify", r.verify)
        r.kv.move = labelled("kv move", r.kv.move)


def per_phase(prof) -> dict:
    """phase -> (aten ops, host us) summed over the profile; a phase's time and ops exclude
    the phases inside it (so "engine step" is what no other phase holds)."""
    ops, us = dict.fromkeys(PHASES, 0), dict.fromkeys(PHASES, 0.0)

    def phase_of(evt):
        while evt is not None:
            if evt.name.startswith("phase:"):
                return evt.name[6:]
            evt = evt.cpu_parent
        return None

    for evt in prof.events():
        name = phase_of(evt)
        if name is None:
            continue
        if evt.name.startswith("phase:"):
            us[name] += evt.cpu_time_total
            outer = phase_of(evt.cpu_parent)
            if outer is not None:
                us[outer] -= evt.cpu_time_total
        elif evt.name.startswith("aten::") and not (
                evt.cpu_parent is not None and evt.cpu_parent.name.startswith("aten::")):
            ops[name] += 1
    return {p: (ops[p], us[p]) for p in PHASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--methods", nargs="+", default=["eagle3", "mtp"])
    ap.add_argument("--backends", nargs="+", default=["eager", "compile_dynamic"])
    ap.add_argument("--steps", type=int, default=12, help="decode steps profiled per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per engine")
    args = ap.parse_args()
    torch.set_num_threads(1)
    for name in ("tree_rejection_sample", "tree_greedy_verify"):
        setattr(runner_module, name, labelled("sampler", getattr(runner_module, name)))
    for backend in args.backends:
        for method in args.methods:
            llms = {"chain K=5": engine(method, 5, graph_backend=backend),
                    "tree 8": engine(method, 5, FITTED_8[method], graph_backend=backend),
                    "dynamic 8": engine(method, 5, DYNAMIC_8, graph_backend=backend)}
            prompt = list(range(100, 164))
            for llm in llms.values():
                instrument(llm)
                run(llm, [prompt], 32, concurrency=1)  # warm-up
            rows = {name: [] for name in llms}
            for _ in range(args.rounds):
                for name, llm in llms.items():
                    params = SamplingParams(max_tokens=8 * args.steps, ignore_eos=True)
                    req = llm.add_request(prompt, params)
                    llm.step()  # the prefill
                    first = len(llm.core.steps)
                    with torch.profiler.profile() as prof:
                        for _ in range(args.steps):
                            llm.step()
                    tokens = sum(sum(s.new_tokens.values()) for s in llm.core.steps[first:])
                    while not req.finish_reason:
                        llm.step()
                    rows[name].append((per_phase(prof), tokens / args.steps))
            print(f"\n{method} {backend}: per decode step, median of {args.rounds} rounds "
                  f"of {args.steps} steps (ops = aten operators called outside another)")
            print(f"{'phase':12s}" + "".join(f"{n + ' ops':>14s}{n + ' ms':>14s}"
                                             for n in rows))
            for phase in PHASES:
                cells = [(statistics.median(r[0][phase][0] for r in rows[name]) / args.steps,
                          statistics.median(r[0][phase][1] for r in rows[name]) / args.steps)
                         for name in rows]
                if any(ops or us for ops, us in cells):  # the phases this backend has
                    print(f"{phase:12s}" + "".join(f"{ops:14.1f}{us / 1e3:14.2f}"
                                                   for ops, us in cells))
            for name in rows:
                total = statistics.median(sum(v[1] for v in r[0].values()) for r in rows[name])
                ops = statistics.median(sum(v[0] for v in r[0].values()) for r in rows[name])
                tok = statistics.median(r[1] for r in rows[name])
                print(f"  {name}: {ops / args.steps:.0f} ops, {total / args.steps / 1e3:.2f} "
                      f"host ms (profiled) per step, {tok:.2f} tokens per step")


if __name__ == "__main__":
    main()
