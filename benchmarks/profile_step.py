"""Where a decode step's time goes, by kernel kind: GEMM, attention, norm, rope, copy, other,
and (on a GPU) the idle time between kernels, in ms per step.

    python -m benchmarks.profile_step --device cuda --model llama-8b --method none --conc 1
    python -m benchmarks.profile_step --device cpu --model llama-tiny --backend eager  # smoke

It builds the engine as ``benchmarks.bench_gpu`` does (synthetic zero-weight targets: every
draft accepted), warms it up, then runs ``--steps`` decode steps of ``--conc`` requests under
``torch.profiler``. On CUDA it sums the device kernels' time per kind (kernels on one stream
do not overlap, so idle = step wall time - kernel time); on a CPU the operators' self time
(``aten::mm`` is a GEMM, and so on). A kernel's kind comes from its name (``KINDS``: the
first pattern that matches, in order); the rest is "other". Prints the table and, with
``--json``, writes it.
"""

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.bench_gpu import build, prompts_for
from specdec import SamplingParams

# (kind, regex over the lower-cased kernel / operator name), first match wins
KINDS = (
    ("attention", r"attention|attn|flash|paged|sdpa"),
    ("norm", r"norm"),
    ("rope", r"rope|rotary"),
    # nvjet: cuBLASLt's Hopper GEMM kernels (CUDA 12.8+)
    ("gemm", r"gemm|gemv|matmul|cutlass|cublas|nvjet|sm\d+_xmma|aten::(mm|addmm|bmm|linear)\b"
             r"|splitk"),
    ("copy", r"copy|memcpy|memset|index|scatter|gather|cat\b|fill"),
)
PATTERNS = [(kind, re.compile(rx)) for kind, rx in KINDS]
TOP_OTHER = 6  # the slowest "other" names printed under the table
COLUMNS = [kind for kind, _ in KINDS] + ["other"]


def kind_of(name: str) -> str:
    """``KINDS``' first kind whose pattern matches ``name``, else "other"."""
    low = name.lower()
    return next((kind for kind, rx in PATTERNS if rx.search(low)), "other")


def kernel_times(prof, device: torch.device) -> tuple[dict[str, float], dict[str, float]]:
    """Total time (ms) per kind: device kernels on CUDA, operators' self CPU time on a CPU
    (only leaf work: an operator's time inside its children counts once, in the child); and
    the time (ms) of each kernel / operator that fell into "other", by name."""
    totals, other = dict.fromkeys(COLUMNS, 0.0), {}
    for evt in prof.key_averages():
        if device.type == "cuda":
            us = getattr(evt, "self_device_time_total", 0.0)
        else:
            us = evt.self_cpu_time_total if evt.key.startswith("aten::") else 0.0
        if us > 0:
            kind = kind_of(evt.key)
            totals[kind] += us / 1e3
            if kind == "other":
                other[evt.key] = other.get(evt.key, 0.0) + us / 1e3
    return totals, other


def profile(llm, conc: int, steps: int, vocab: int, device: torch.device) -> dict:
    """``steps`` decode steps of ``conc`` requests under the profiler -> ms per step per kind,
    ``wall`` (median step wall time), ``top_other`` (the TOP_OTHER slowest (name, ms per
    step) of "other") and, on CUDA, ``idle``."""
    # up to 1 + K tokens a step: enough for every request to decode through all ``steps``
    per_step_tokens = 1 + llm.runner.num_speculative_tokens
    params = SamplingParams(max_tokens=(steps + 8) * per_step_tokens, ignore_eos=True)
    prompts = prompts_for(conc, vocab)
    llm.generate(prompts, params)  # warm-up: captures, compiles, allocates
    for p in prompts:
        llm.add_request(p, params)
    while any(r.is_prefilling for r in [*llm.scheduler.waiting, *llm.scheduler.running]):
        llm.step()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    walls, first = [], len(llm.steps)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            start = time.perf_counter()
            llm.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
    profiled = [s.num_reqs for s in llm.steps[first:]]
    if profiled != [conc] * steps:
        raise RuntimeError(f"profiled steps decoded {profiled} requests, not {conc} each")
    while llm.step() is not None:  # finish the requests
        pass
    totals, other = kernel_times(prof, device)
    per_step = {k: v / steps for k, v in totals.items()}
    wall = 1e3 * statistics.median(walls)
    top = sorted(other.items(), key=lambda kv: -kv[1])[:TOP_OTHER]
    row = {**per_step, "wall": wall, "steps": steps,
           "top_other": [(name, ms / steps) for name, ms in top]}
    if device.type == "cuda":
        row["idle"] = max(0.0, 1e3 * sum(walls) / steps - sum(per_step.values()))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_step",
                                 description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="llama-8b",
                    help="embedded, or a synthetic shape: llama-tiny, llama-1b, llama-8b")
    ap.add_argument("--method", default="none", help="none, eagle3, mtp")
    ap.add_argument("--backend", default="cuda_graph",
                    help="the graph backend (eager, cuda_graph, replay, compile)")
    ap.add_argument("--conc", type=int, default=1, help="requests decoding together")
    ap.add_argument("-k", type=int, default=3, help="K, draft tokens per step")
    ap.add_argument("--steps", type=int, default=16, help="decode steps profiled")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", type=Path, default=None, help="write the row here too")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.conc < 1:
        ap.error(f"--steps={args.steps} and --conc={args.conc}: allowed ints >= 1")
    device = torch.device(args.device)
    llm = build(args.model, args.method, True, args.backend, args.conc, device, args.k,
                getattr(torch, args.dtype))
    row = profile(llm, args.conc, args.steps, llm.vocab_size, device)
    table = Table(title=f"{args.model} {args.method} conc {args.conc} {args.backend} "
                        f"on {device}: ms per decode step")
    cols = COLUMNS + (["idle"] if "idle" in row else []) + ["wall"]
    for c in cols:
        table.add_column(c, justify="right")
    table.add_row(*(f"{row[c]:.3f}" for c in cols))
    console = Console()
    console.print(table)
    for name, ms in row["top_other"]:
        console.print(f"  other {ms:.3f} ms/step  {name[:150]}", markup=False, highlight=False)
    if args.json:
        args.json.write_text(json.dumps({**vars(args), "json": None, **row}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
