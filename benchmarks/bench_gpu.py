"""Decode step time on an accelerator: plain vs EAGLE-3 / MTP, padded vs ragged, eager vs
captured, greedy vs sampled, on the embedded model, on synthetic DeepSeek-V3 shapes (MTP) and
on synthetic Llama targets (bf16); the share of captured steps under Poisson arrivals; the
issue-18 goals from those figures.

    python -m benchmarks.bench_gpu [--device cuda] [--models embedded llama-1b] [--out DIR]

Per config: ms per decode step (median over steps where every request decodes), output
tokens/s over those steps, graph replays per step, and the step time against the weight-read
limit (weight bytes / the device's measured copy bandwidth; CUDA only), and a speculative
row's tokens/s over the plain row's (same model, backend, concurrency, temperature). Each
model runs the methods it has heads for (``specdec.models.synthetic.head_methods``: a Llama
shape EAGLE-3 and MTP, a DeepSeek shape its MTP layer). Every request decodes
``--output-len`` tokens with ``ignore_eos``; the synthetic targets use zero weights, so every
draft is accepted (the best case of speculation at the real cost per step). Sampled rows
(``--temperature``, top-p 0.9) run the padded configs of the capturing backends (captured
like greedy ones: graph calls/step says so). ``--device cpu --backends eager replay --models
llama-tiny`` runs the same code on a CPU (a smoke run: CPU times say nothing about a GPU).
A backend named ``B+async`` (e.g. ``cuda_graph+async``) runs B with async scheduling (the
next decode launched before the host reads the step); its steps overlap, so its ms/step and
tokens/s come from the wall time of the whole timed run (``wall_tokens_per_s``, reported for
every row) instead of the steps' own times.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from specdec import LLM, SamplingParams
from specdec.bench.itl import copy_bandwidth
from specdec.models.synthetic import (HEAD_METHODS, SHAPES, build_synthetic, head_methods,
                                      weight_bytes)

CAPTURING = ("cuda_graph", "replay", "compile")
GOALS = {  # issue 18: (figure, goal, comparison)
    "sampled_over_greedy_step": (1.15, "<="),
    "captured_share_poisson": (0.90, ">="),
    "plain_c1_step_over_weight_read": (1.25, "<="),
    "eagle3_over_plain_tokens_per_s": (3.3, ">="),
}


def configs(backends: list[str], temperature: float) -> list[tuple[str, bool, str, float]]:
    """(method, padded, graph backend, temperature): ragged only eager (its shapes come from a
    host read); sampled only on the padded configs of the capturing backends."""
    out = []
    for method in ("none", "eagle3", "mtp"):
        for backend in backends:
            out.append((method, True, backend, 0.0))
            if backend.partition("+")[0] in CAPTURING and temperature > 0:
                out.append((method, True, backend, temperature))
            if method != "none" and backend == "eager":
                out.append((method, False, backend, 0.0))
    return out


def methods_of(model: str) -> tuple[str, ...]:
    """The speculative methods ``model`` has heads for (the embedded model: every one)."""
    return HEAD_METHODS if model == "embedded" else head_methods(model)


def over_plain(rows: list[dict]) -> None:
    """Set each speculative row's ``over_plain``: its tokens/s over the plain row's of
    the same model, backend, concurrency and temperature (None without one)."""
    plain = {(r["model"], r["backend"], r["concurrency"], r["temperature"]): r["tokens_per_s"]
             for r in rows if r["method"] == "none" and "error" not in r}
    for r in rows:
        if r["method"] != "none" and "error" not in r:
            base = plain.get((r["model"], r["backend"], r["concurrency"], r["temperature"]))
            r["over_plain"] = r["tokens_per_s"] / base if base else None


def build(model: str, method: str, padded: bool, backend: str, conc: int, device, k: int,
          dtype: torch.dtype):
    """The engine of one config (``backend``: a graph backend, + "+async" for async
    scheduling)."""
    backend, _, overlap = backend.partition("+")
    spec = None
    if method != "none":
        spec = {"method": method, "num_speculative_tokens": k,
                "disable_padded_drafter_batch": not padded}
    kw = dict(device=str(device), dtype=dtype, max_num_seqs=conc, max_model_len=256,
              max_num_batched_tokens=max(256, conc * (k + 1)), graph_backend=backend,
              check_host_syncs=False, async_scheduling=overlap == "async")
    if model == "embedded":
        return LLM(speculative_config=spec, **kw)
    target, heads = build_synthetic(model, dtype=dtype, device=device, init="zeros",
                                    methods=(method,) if method != "none" else ())
    return LLM(target=target, draft_head=heads.get(method), speculative_config=spec,
               tokenizer=None, **kw)


def graph_calls(llm: LLM) -> int:
    runner = llm.runner
    step_graph = getattr(runner.proposer, "step_graph", None)
    target = runner.target_graph.calls
    return target + (step_graph.calls if step_graph else 0)


def prompts_for(n: int, vocab: int, salt: int = 0) -> list[list[int]]:
    return [[(7 * i + j + salt) % (vocab - 2) + 1 for j in range(16)] for i in range(n)]


def measure(llm: LLM, conc: int, output_len: int, vocab: int, temperature: float) -> dict:
    """One warmed-up batch of ``conc`` 16-token prompts; the figures of its decode steps
    (after the prefill step, while all ``conc`` requests run)."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=temperature,
                            top_p=0.9 if temperature > 0 else 1.0)
    prompts = prompts_for(conc, vocab)
    for _ in range(2):  # warm-up: captures every bucket the run hits, compiles, allocates
        llm.generate(prompts, params)
    first, calls = len(llm.steps), graph_calls(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    decode = [s for s in llm.steps[first + 1:] if s.num_reqs == conc]
    secs = [s.seconds for s in decode]
    tokens = sum(sum(s.new_tokens.values()) for s in decode)
    steps = len(llm.steps) - first
    wall_tokens_per_s = sum(len(o.token_ids) for o in outs) / wall
    r = dict(ms_per_step=1e3 * statistics.median(secs), steps=len(secs),
             tokens_per_s=tokens / sum(secs), tokens_per_step=tokens / len(secs) / conc,
             graph_calls_per_step=(graph_calls(llm) - calls) / steps,
             wall_tokens_per_s=wall_tokens_per_s)
    if llm.async_scheduling:  # steps overlap: their own times double count
        r.update(ms_per_step=1e3 * wall / steps, tokens_per_s=wall_tokens_per_s,
                 overlapped_share=sum(s.overlapped for s in llm.steps[first:]) / steps)
    return r


def poisson_share(llm: LLM, rate: float, num: int, output_len: int, vocab: int) -> dict:
    """``num`` requests arriving as a Poisson process of ``rate`` requests/s (wall clock), each
    admitted at the first step after its arrival; -> steps and the share replaying a graph."""
    gaps = random.Random(0)
    arrivals = [0.0]
    for _ in range(num - 1):
        arrivals.append(arrivals[-1] + gaps.expovariate(rate))
    prompts = prompts_for(num, vocab, salt=3)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    first, t0, added = len(llm.steps), time.perf_counter(), 0
    while True:
        now = time.perf_counter() - t0
        while added < num and arrivals[added] <= now:
            llm.add_request(prompts[added], params)
            added += 1
        if llm.step() is None:
            if added == num:
                break
            time.sleep(max(0.0, arrivals[added] - (time.perf_counter() - t0)))
    steps = [s for s in llm.steps[first:] if s.num_reqs]
    k = llm.runner.num_speculative_tokens
    uniform = sum(s.num_tokens == s.num_reqs * (1 + k) for s in steps)
    return dict(steps=len(steps), captured=sum(s.captured for s in steps),
                share=sum(s.captured for s in steps) / max(len(steps), 1),
                uniform_decode_share=uniform / max(len(steps), 1))  # captured before mixed


def goals(rows: list[dict], shares: list[dict]) -> dict:
    """The issue-18 figures from the rows (None where the run lacks a row they need): the
    worst sampled/greedy step ratio, the lowest captured share, and on the largest target at
    the lowest concurrency the plain step over its weight-read limit and EAGLE-3 tokens/s over
    plain tokens/s, on the first capturing backend that has them (largest among the targets
    with EAGLE-3 rows, when any has)."""
    ok = [r for r in rows if "error" not in r]

    def find(**kw):
        return next((r for r in ok if all(r.get(k) == v for k, v in kw.items())), None)

    out = dict.fromkeys(GOALS)
    ratios = [r["ms_per_step"] / g["ms_per_step"] for r in ok if r["temperature"] > 0
              for g in [find(model=r["model"], method=r["method"], padded=True,
                             backend=r["backend"], concurrency=r["concurrency"],
                             temperature=0.0)] if g]
    if ratios:
        out["sampled_over_greedy_step"] = max(ratios)
    if shares:
        out["captured_share_poisson"] = min(s["share"] for s in shares)
    eagle3 = {r["model"] for r in ok if r["method"] == "eagle3"}
    big = max((r["weight_bytes"] for r in ok if r["model"] in eagle3 or not eagle3),
              default=None)  # the largest target's rows
    low = min((r["concurrency"] for r in ok), default=None)  # at the lowest concurrency (1)
    for backend in CAPTURING:
        plain = find(method="none", backend=backend, concurrency=low, temperature=0.0,
                     weight_bytes=big)
        eagle = find(method="eagle3", padded=True, backend=backend, concurrency=low,
                     temperature=0.0, weight_bytes=big)
        if plain and plain.get("weight_read_ms") and out["plain_c1_step_over_weight_read"] is None:
            out["plain_c1_step_over_weight_read"] = plain["ms_per_step"] / plain["weight_read_ms"]
        if plain and eagle and out["eagle3_over_plain_tokens_per_s"] is None:
            out["eagle3_over_plain_tokens_per_s"] = eagle["tokens_per_s"] / plain["tokens_per_s"]
    return out


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)


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
                         + ", ".join(SHAPES))
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 16],
                    help="requests decoding together")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    ap.add_argument("-k", type=int, default=3, help="K, draft tokens per step")
    ap.add_argument("--methods", nargs="+", default=["none", "eagle3", "mtp"],
                    help="none (plain), eagle3, mtp")
    ap.add_argument("--backends", nargs="+", default=["eager", "cuda_graph"],
                    help="eager, cuda_graph, compile (torch.compile per bucket, no graph), "
                         "replay (the capture logic without a graph: CPU smoke runs); "
                         "+async after one (cuda_graph+async): with async scheduling")
    ap.add_argument("--temperature", type=float, default=0.7,
                    help="sampled rows (top-p 0.9) beside the greedy ones; 0: greedy only")
    ap.add_argument("--request-rate", type=float, default=20.0,
                    help="Poisson arrivals (requests/s) of the captured-share run")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="weights and activations")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for results.json (default: %(default)s, print the table only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    console = Console(stderr=True)
    rows, shares = [], []
    for model in args.models:
        for conc in args.concurrency:
            for method, padded, backend, temp in [c for c in configs(args.backends,
                                                                     args.temperature)
                                                  if c[0] in args.methods and
                                                  c[0] in ("none", *methods_of(model))]:
                name = (f"{model} {method} {'padded' if padded else 'ragged'} {backend} "
                        f"T={temp} c{conc}")
                try:
                    llm = build(model, method, padded, backend, conc, device, args.k, dtype)
                    r = measure(llm, conc, args.output_len, llm.target.config.vocab_size, temp)
                    r["weight_bytes"] = weight_bytes(llm.target)
                    r["weight_read_ms"] = 1e3 * r["weight_bytes"] / bandwidth if bandwidth else None
                except Exception as e:  # one failing config must not lose the table
                    r = dict(error=f"{type(e).__name__}: {e}")
                rows.append(dict(model=model, method=method, padded=padded, backend=backend,
                                 concurrency=conc, temperature=temp, **r))
                console.print(name, r, markup=False)
                llm = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for backend in [b for b in args.backends if b in ("cuda_graph", "replay")]:
            conc = max(args.concurrency)
            method = "eagle3" if "eagle3" in methods_of(model) else "mtp"
            llm = build(model, method, True, backend, conc, device, args.k, dtype)
            share = poisson_share(llm, args.request_rate, 2 * conc, args.output_len,
                                  llm.target.config.vocab_size)
            shares.append(dict(model=model, backend=backend, rate=args.request_rate, **share))
            console.print(f"{model} {method} {backend}: Poisson {args.request_rate}/s, "
                          f"{share['captured']}/{share['steps']} steps captured (uniform "
                          f"decodes: {100 * share['uniform_decode_share']:.0f}%)", markup=False)
    over_plain(rows)
    table = Table(title=f"decode step on {device_name(device)}, {args.dtype}, K={args.k}, "
                        + (f"copy bandwidth {bandwidth / 1e12:.2f} TB/s" if bandwidth
                           else "no weight-read limit off CUDA"))
    for col in ("model", "method", "mode", "backend", "T", "conc", "ms/step", "tok/s",
                "x plain", "tok/step/req", "graph calls/step", "weight-read ms",
                "wall tok/s"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], r["method"], "", r["backend"], str(r["temperature"]),
                          str(r["concurrency"]), r["error"][:60], "", "", "", "", "", "")
            continue
        table.add_row(r["model"], r["method"], "padded" if r["padded"] else "ragged",
                      r["backend"], str(r["temperature"]), str(r["concurrency"]),
                      f"{r['ms_per_step']:.2f}", f"{r['tokens_per_s']:.0f}",
                      f"{r['over_plain']:.2f}" if r.get("over_plain") else "-",
                      f"{r['tokens_per_step']:.2f}", f"{r['graph_calls_per_step']:.2f}",
                      f"{r['weight_read_ms']:.3f}" if r["weight_read_ms"] else "-",
                      f"{r['wall_tokens_per_s']:.0f}")
    out = Console(width=max(Console().width, 150))  # every column readable in a log file
    out.print(table)
    figures = goals(rows, shares)
    for key, (goal, op) in GOALS.items():
        value = figures[key]
        met = None if value is None else (value <= goal if op == "<=" else value >= goal)
        out.print(f"{key}: {'-' if value is None else f'{value:.2f}'} (goal {op} {goal}"
                  f"{'' if met is None else ', met' if met else ', NOT met'})", highlight=False)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu.json").write_text(json.dumps(
            dict(device=device_name(device), torch=torch.__version__, dtype=args.dtype,
                 copy_bandwidth_bytes_per_s=bandwidth, k=args.k, rows=rows,
                 poisson=shares, goals=figures), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
