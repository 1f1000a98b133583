"""Issue 53's accelerator figures: a verify's cost against its tokens, and trees against
chains on the embedded model.

    python -m benchmarks.bench_tree_gpu [--device cuda] [--backend cuda_graph] [--out FILE]

verify: ms per decode step of a synthetic target (``--model``, default Llama-3.1-8B's shape,
zero weights, bf16) verifying n tokens per request, n in ``--tokens`` (1: plain decoding;
n > 1: the root and a static tree of n - 1 children of the root, depth 1, so the draft side is
one first pass whatever n), at each ``--concurrency``; the step's median over its decode
steps (``bench_gpu.measure``). The goal: at one request, 8 tokens within 1.1x of 4.
trees: tokens/s of the embedded model's trained heads (EAGLE-3, MTP), greedy, on held-out
prompts, at each concurrency (closed loop): chain K=5, the fitted static 8-draft tree and the
calibrated dynamic one (``bench_tree.FITTED_8``, ``DYNAMIC_8``), interleaved over
``--repeats`` rounds after a warm-up; each tree's median ratio to the chain. The goal: 1.25x at
one request.

``--device cpu --backend replay --model llama-tiny --output-len 8`` runs the same code on a
CPU (a smoke run: CPU times say nothing about an accelerator).
"""

import argparse
import gc
import json
import statistics

import torch

from benchmarks.bench_gpu import measure
from benchmarks.bench_tree import DYNAMIC_8, FITTED_8, engine, run
from specdec import LLM
from specdec.bench.sweep import PromptSource
from specdec.models.synthetic import build_synthetic


def free(device: torch.device) -> None:
    """Let the last engine's KV cache and graphs go before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def verify_curve(model: str, tokens: list[int], concurrency: list[int], device, backend: str,
                 output_len: int) -> list[dict]:
    """ms per decode step verifying n tokens per request -> one row per (n, concurrency)."""
    target, heads = build_synthetic(model, device=device, init="zeros", methods=("eagle3",))
    rows = []
    for n in tokens:
        spec = None if n == 1 else {"method": "eagle3", "num_speculative_tokens": 1,
                                    "speculative_token_tree": [(i,) for i in range(n - 1)]}
        llm = LLM(target=target, draft_head=heads["eagle3"] if spec else None,
                  speculative_config=spec, tokenizer=None, device=str(device),
                  dtype=torch.bfloat16, max_num_seqs=max(concurrency), max_model_len=256,
                  max_num_batched_tokens=max(256, max(concurrency) * n),
                  graph_backend=backend)
        for conc in concurrency:
            r = measure(llm, conc, output_len, target.config.vocab_size, 0.0)
            rows.append(dict(tokens=n, concurrency=conc, ms_per_step=r["ms_per_step"]))
            print(f"verify {model}: {n} tokens x {conc} requests: {r['ms_per_step']:.3f} ms "
                  "per step", flush=True)
        llm = None
        free(device)
    return rows


def trees(methods: list[str], concurrency: list[int], device, backend: str, output_len: int,
          repeats: int, num_prompts: int) -> list[dict]:
    """Chain K=5 against the 8-draft trees, interleaved -> one row per (method, shape,
    concurrency) with its tokens/s runs, acceptance length and median ratio to the chain."""
    rows = []
    for method in methods:
        shapes = {"chain K=5": None, "static 8": FITTED_8[method], "dynamic 8": DYNAMIC_8}
        for conc in concurrency:
            llms = {name: engine(method, 5, tree, device=str(device), graph_backend=backend)
                    for name, tree in shapes.items()}
            source = PromptSource(llms["chain K=5"].tokenizer, llms["chain K=5"].vocab_size)
            prompts = source.prompts(max(num_prompts, conc), 64, 1)
            for llm in llms.values():  # warm-up: captures, compiles, allocates
                run(llm, prompts[:conc], output_len, concurrency=conc)
            figures = {name: [] for name in llms}
            for _ in range(repeats):
                for name, llm in llms.items():
                    figures[name].append(run(llm, prompts, output_len, concurrency=conc))
            chain = [f["tokens_per_s"] for f in figures["chain K=5"]]
            for name, runs in figures.items():
                tps = [f["tokens_per_s"] for f in runs]
                row = dict(method=method, shape=name, concurrency=conc, tokens_per_s=tps,
                           acceptance_length=runs[-1]["acceptance_length"],
                           over_chain=statistics.median(t / c for t, c in zip(tps, chain)))
                rows.append(row)
                print(f"trees {method} c{conc} {name}: {statistics.median(tps):.0f} tok/s, "
                      f"AL {row['acceptance_length']:.2f}, / chain {row['over_chain']:.3f}",
                      flush=True)
            llms = None
            free(device)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backend", default="cuda_graph", help="the graph backend")
    ap.add_argument("--model", default="llama-8b", help="the verify curve's synthetic shape")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 8, 16, 32, 63],
                    help="tokens verified per request (at most 63: the root and 62 drafts)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--methods", nargs="+", default=["eagle3", "mtp"])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=16, help="trees: prompts per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", choices=["verify", "trees"], default=None)
    ap.add_argument("--out", default=None, help="write the figures here (JSON)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    out = {}
    if args.skip != "verify":
        out["verify"] = verify_curve(args.model, args.tokens, args.concurrency, device,
                                     args.backend, args.output_len)
        ms = {(r["tokens"], r["concurrency"]): r["ms_per_step"] for r in out["verify"]}
        if (8, 1) in ms and (4, 1) in ms:
            out["verify_8_over_4_at_1"] = ms[8, 1] / ms[4, 1]
            print(f"verify: 8 tokens / 4 tokens at one request {ms[8, 1] / ms[4, 1]:.3f} "
                  "(goal <= 1.1)")
    if args.skip != "trees":
        out["trees"] = trees(args.methods, args.concurrency, device, args.backend,
                             args.output_len, args.repeats, args.num_prompts)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
