"""Decode step time on an accelerator: plain vs EAGLE-3 / MTP, padded vs ragged, eager vs
captured, on the embedded model and on a synthetic ~0.85B target (bf16).

    python -m benchmarks.bench_gpu [--device cuda] [--models embedded llama-1b] [--out DIR]

Per config: ms per decode step (median over steps where every request decodes), output
tokens/s over those steps, graph replays per step, and the step time against the weight-read
limit (weight bytes / the device's measured copy bandwidth). Every request decodes
``--output-len`` tokens with ``ignore_eos``; the synthetic target uses zero weights, so every
draft is accepted (the best case of speculation at the real cost per step).
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdec import LLM
from specdec.bench.itl import copy_bandwidth
from specdec.models.synthetic import build_synthetic, weight_bytes

def configs(backends: list[str]) -> list[tuple[str, bool, str]]:
    """(method, padded, graph backend): ragged only eager (its shapes come from a host read)."""
    out = []
    for method in ("none", "eagle3", "mtp"):
        for backend in backends:
            out.append((method, True, backend))
            if method != "none" and backend == "eager":
                out.append((method, False, backend))
    return out


def build(model: str, method: str, padded: bool, backend: str, conc: int, device, k: int):
    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": k,
                "disable_padded_drafter_batch": not padded}
    kw = dict(device=str(device), dtype=torch.bfloat16, max_num_seqs=conc, max_model_len=256,
              max_num_batched_tokens=max(256, conc * (k + 1)), graph_backend=backend,
              check_host_syncs=False, capture_sizes=[1, 2, 4, 8, 16, 32])
    if model == "embedded":
        return LLM(speculative_config=spec, **kw)
    target, heads = build_synthetic(model, dtype=torch.bfloat16, device=device, init="zeros",
                                    methods=(method,) if method != "none" else ())
    return LLM(target=target, draft_head=heads.get(method), speculative_config=spec,
               tokenizer=None, **kw)


def graph_calls(llm: LLM) -> int:
    runner = llm.runner
    step_graph = getattr(runner.proposer, "step_graph", None)
    target = runner.target_graph.calls
    return target + (step_graph.calls if step_graph else 0)


def measure(llm: LLM, conc: int, output_len: int, vocab: int) -> dict:
    """One warmed-up batch of ``conc`` 16-token prompts; the figures of its decode steps
    (after the prefill step, while all ``conc`` requests run)."""
    prompts = [[(7 * i + j) % (vocab - 2) + 1 for j in range(16)] for i in range(conc)]
    for _ in range(2):  # warm-up: captures every bucket the run hits, compiles, allocates
        llm.generate(prompts, max_tokens=output_len, ignore_eos=True)
    first, calls = len(llm.steps), graph_calls(llm)
    llm.generate(prompts, max_tokens=output_len, ignore_eos=True)
    decode = [s for s in llm.steps[first + 1:] if s.num_reqs == conc]
    secs = [s.seconds for s in decode]
    tokens = sum(sum(s.new_tokens.values()) for s in decode)
    return dict(ms_per_step=1e3 * statistics.median(secs), steps=len(secs),
                tokens_per_s=tokens / sum(secs), tokens_per_step=tokens / len(secs) / conc,
                graph_calls_per_step=(graph_calls(llm) - calls) / (len(llm.steps) - first))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Run it from the repository root (benchmarks/ is not installed with the "
               "package). " + " ".join(__doc__.split("\n\n", 2)[2].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="cuda", help="the accelerator")
    ap.add_argument("--models", nargs="+", default=["embedded", "llama-1b"],
                    help="embedded, or a synthetic shape (zero weights, every draft accepted): "
                         "llama-tiny, llama-1b, llama-8b")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16],
                    help="requests decoding together")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    ap.add_argument("-k", type=int, default=3, help="K, draft tokens per step")
    ap.add_argument("--methods", nargs="+", default=["none", "eagle3", "mtp"],
                    help="none (plain), eagle3, mtp")
    ap.add_argument("--backends", nargs="+", default=["eager", "cuda_graph"],
                    help="eager, cuda_graph, compile (torch.compile per bucket, no graph)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for results.json (default: %(default)s, print the table only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    bandwidth = copy_bandwidth(device)
    rows = []
    for model in args.models:
        for conc in args.concurrency:
            for method, padded, backend in [c for c in configs(args.backends)
                                            if c[0] in args.methods]:
                name = f"{model} {method} {'padded' if padded else 'ragged'} {backend} c{conc}"
                try:
                    llm = build(model, method, padded, backend, conc, device, args.k)
                    r = measure(llm, conc, args.output_len, llm.target.config.vocab_size)
                    r["weight_bytes"] = weight_bytes(llm.target)
                    r["weight_read_ms"] = 1e3 * r["weight_bytes"] / bandwidth
                except Exception as e:  # one failing config must not lose the table
                    r = dict(error=f"{type(e).__name__}: {e}")
                rows.append(dict(model=model, method=method, padded=padded, backend=backend,
                                 concurrency=conc, **r))
                Console(stderr=True).print(name, r, markup=False)
                llm = None
                torch.cuda.empty_cache()
    table = Table(title=f"decode step on {torch.cuda.get_device_name(device)}, bf16, "
                        f"K={args.k}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    for col in ("model", "method", "mode", "backend", "conc", "ms/step", "tok/s",
                "tok/step/req", "graph calls/step", "weight-read ms"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["method"], "", r["backend"], str(r["concurrency"]),
                          r["error"][:60], "", "", "", "")
            continue
        table.add_row(r["model"], r["method"], "padded" if r["padded"] else "ragged",
                      r["backend"], str(r["concurrency"]), f"{r['ms_per_step']:.2f}",
                      f"{r['tokens_per_s']:.0f}", f"{r['tokens_per_step']:.2f}",
                      f"{r['graph_calls_per_step']:.2f}", f"{r['weight_read_ms']:.3f}")
    Console().print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu.json").write_text(json.dumps(
            dict(device=torch.cuda.get_device_name(device), torch=torch.__version__,
                 copy_bandwidth_bytes_per_s=bandwidth, k=args.k, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
