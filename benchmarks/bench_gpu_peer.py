"""specdec against transformers' own ``generate`` on the same GPU: what a one-GPU user picks
without a server (a static KV cache, which ``generate`` compiles with ``torch.compile``),
plain greedy, beside ``specdec.LLM`` plain and speculative, on one synthetic target.

    python -m benchmarks.bench_gpu_peer [--model llama-8b] [--device cuda] [--out DIR]

Both engines get the same target: the synthetic shape (``specdec.models.synthetic``) with zero
weights, built once as specdec's model and once as transformers' (``AutoConfig`` of the same
HF config, every parameter zeroed), so every logit ties, both decode token 0 and every draft
is accepted (speculation's best case at the real cost per step). Per concurrency C (default 1
and 16): C prompts of 16 tokens, ``--output-len`` new tokens each (no EOS), timed end to end
(prefill included, the same on both sides) after ``--warmup`` runs (which compile and capture);
tokens/s = C * output-len / seconds, the median of ``--repeats`` runs. transformers:
``generate(do_sample=False, cache_implementation="static")``, whose forward
transformers compiles itself on CUDA (``CompileConfig`` defaults: ``mode="reduce-overhead"``,
CUDA graphs; ``--no-compile`` turns it off; off the accelerators it never compiles). specdec:
the engine ``benchmarks.bench_gpu`` builds (``--backend``, K=``-k``). Printed: tokens/s per
engine and the ratios specdec / transformers plain (plain and each speculative method the
shape has heads for). ``--model llama-tiny --device cpu --dtype float32`` is a CPU smoke run
(CPU times say nothing about a GPU).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import transformers
from rich.console import Console
from rich.table import Table
from transformers import AutoConfig, AutoModelForCausalLM

from benchmarks.bench_gpu import build, device_name, prompts_for
from specdec import SamplingParams
from specdec.models.synthetic import FAMILIES, SHAPES, head_methods, synthetic_config

PROMPT_LEN = 16  # prompts_for's


def hf_model(name: str, dtype: torch.dtype, device: torch.device):
    """transformers' model of synthetic ``name``'s config, every parameter zero (buffers, e.g.
    the rotary frequencies, as transformers builds them), eval mode, greedy to the last token
    (no EOS)."""
    config = synthetic_config(name)
    d = config.to_hf_dict(FAMILIES[config.architectures[0]])
    del d["head_dim"]  # the family default (Llama's H / heads; DeepSeek's is the rope dim)
    config = AutoConfig.for_model(d.pop("model_type"), **d)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.generation_config.update(eos_token_id=None, pad_token_id=0, bos_token_id=None)
    return model.eval()


def timed(run, device: torch.device, repeats: int, warmup: int) -> float:
    """Median seconds of ``run()`` over ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        run()
    secs = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        secs.append(time.perf_counter() - t0)
    return statistics.median(secs)


def time_transformers(model, conc: int, output_len: int, device: torch.device, repeats: int,
                      warmup: int, compile: bool) -> dict:
    """tokens/s of ``generate`` over ``conc`` prompts; ``compiled``: whether transformers
    compiled its forward (it keeps the compiled call as ``_compiled_call``)."""
    ids = torch.tensor(prompts_for(conc, model.config.vocab_size), device=device)

    def run():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=output_len, min_new_tokens=output_len,
                             cache_implementation="static", disable_compile=not compile)
        assert out.shape == (conc, PROMPT_LEN + output_len), out.shape

    with torch.inference_mode():
        secs = timed(run, device, repeats, warmup)
    return dict(tokens_per_s=conc * output_len / secs,
                compiled=hasattr(model, "_compiled_call"))


def time_specdec(llm, conc: int, output_len: int, device: torch.device, repeats: int,
                 warmup: int) -> dict:
    """tokens/s of ``llm.generate`` over the same ``conc`` prompts."""
    prompts = prompts_for(conc, llm.target.config.vocab_size)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)

    def run():
        outs = llm.generate(prompts, params)
        assert all(len(o.token_ids) == output_len for o in outs)

    secs = timed(run, device, repeats, warmup)
    return dict(tokens_per_s=conc * output_len / secs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gpu_peer",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        epilog="Run it from the repository root (benchmarks/ is not installed with the "
               "package). " + " ".join(__doc__.split("\n\n", 2)[2].split()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="llama-8b", choices=list(SHAPES),
                    help="the synthetic shape both engines run")
    ap.add_argument("--device", default="cuda", help="the accelerator")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights and activations")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16],
                    help="requests decoding together")
    ap.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (median)")
    ap.add_argument("--warmup", type=int, default=2,
                    help="untimed runs first (they compile and capture)")
    ap.add_argument("-k", type=int, default=3, help="K, draft tokens per specdec step")
    ap.add_argument("--methods", nargs="+", default=["none", "eagle3", "mtp"],
                    help="specdec's: none (plain), and the speculative methods (those the "
                         "shape has heads for run)")
    ap.add_argument("--backend", default=None,
                    help="specdec's graph backend (default: cuda_graph on CUDA, else eager)")
    ap.add_argument("--no-compile", action="store_true",
                    help="transformers without torch.compile (static cache only)")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for bench_gpu_peer.json (default: %(default)s, print only)")
    args = ap.parse_args(argv)
    if PROMPT_LEN + args.output_len > 256:  # bench_gpu.build's max_model_len
        ap.error(f"--output-len {args.output_len}: at most {256 - PROMPT_LEN}")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backend = args.backend or ("cuda_graph" if device.type == "cuda" else "eager")
    methods = [m for m in args.methods if m == "none" or m in head_methods(args.model)]
    console = Console(stderr=True)
    rows = []
    model = hf_model(args.model, dtype, device)
    for conc in args.concurrency:
        r = time_transformers(model, conc, args.output_len, device, args.repeats,
                              args.warmup, not args.no_compile)
        rows.append(dict(engine="transformers", method="none", concurrency=conc, **r))
        console.print(f"transformers c{conc}: {r['tokens_per_s']:.1f} tok/s", markup=False)
    model = None
    torch.compiler.reset()  # drops the compiled forward and its CUDA graphs with the model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for method in methods:
        for conc in args.concurrency:
            llm = build(args.model, method, True, backend, conc, device, args.k, dtype)
            r = time_specdec(llm, conc, args.output_len, device, args.repeats, args.warmup)
            rows.append(dict(engine="specdec", method=method, concurrency=conc, **r))
            console.print(f"specdec {method} c{conc}: {r['tokens_per_s']:.1f} tok/s",
                          markup=False)
            llm = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
    peer = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["engine"] == "transformers"}
    for r in rows:
        r["over_transformers"] = r["tokens_per_s"] / peer[r["concurrency"]]
    compiled = all(r["compiled"] for r in rows if r["engine"] == "transformers")
    table = Table(title=f"{args.model} (zero weights) on {device_name(device)}, {args.dtype}, "
                        f"{args.output_len} tokens/request; transformers static cache, "
                        f"{'compiled' if compiled else 'not compiled'}; specdec {backend}, "
                        f"K={args.k}")
    for col in ("engine", "method", "conc", "tok/s", "x transformers"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["engine"], r["method"], str(r["concurrency"]),
                      f"{r['tokens_per_s']:.0f}", f"{r['over_transformers']:.2f}")
    out = Console(width=max(Console().width, 120))
    out.print(table)
    for r in rows:
        if r["engine"] == "specdec":
            out.print(f"specdec {r['method']} / transformers plain, c{r['concurrency']}: "
                      f"{r['over_transformers']:.2f}", highlight=False)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu_peer.json").write_text(json.dumps(
            dict(device=device_name(device), torch=torch.__version__,
                 transformers=transformers.__version__, model=args.model,
                 dtype=args.dtype, output_len=args.output_len, k=args.k, backend=backend,
                 rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
