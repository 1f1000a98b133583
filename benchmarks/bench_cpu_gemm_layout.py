"""Row-major vs column-major linear weights on the CPU (``use_cpu_gemm_layout``), side by side.

    python -m benchmarks.bench_cpu_gemm_layout [--dtypes float32 bfloat16 float16]
        [--batch 1 4 16 64] [--concurrency 1 4 16] [--rounds 5] [--threads 1]

Two tables from one run, each figure the median over ``--rounds`` alternating rounds (A, B,
A, B, ...: this machine's speed drifts by tens of percent over minutes):

* forward: ms per decode forward + logits of the embedded target (64 cached tokens per
  request) with its weights as loaded (``[out, in]`` row-major) and moved column-major, per
  dtype and batch; ratio = row-major / column-major (> 1: the layout is faster).
* engine: in-process tokens/s of the engine (plain and EAGLE-3 K=3 padded, greedy, float32,
  32-token prompts, 32 output tokens) with the layout undone vs as the engine builds it.
"""

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

from benchmarks.bench_forward import decode_batch, time_forward
from specdec.engine.sequence import SamplingParams
from specdec.flags import build_llm
from specdec.models.layers.linear import use_cpu_gemm_layout
from specdec.models.registry import load_pretrained

TARGET = "specdec/assets/default/target"


def row_major(*models) -> None:
    """Undo ``use_cpu_gemm_layout``: every linear weight contiguous ``[out, in]`` again."""
    for model in models:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.data = m.weight.data.contiguous()


def forward_table(args) -> Table:
    table = Table(title=f"decode forward + logits, ms (median of {args.rounds} rounds), "
                        f"{torch.get_num_threads()} thread(s)")
    for col in ("dtype", "batch", "row-major", "column-major", "ratio"):
        table.add_column(col, justify="right")
    for name in args.dtypes:
        dtype = getattr(torch, name)
        rows, cols = load_pretrained(TARGET, dtype=dtype), load_pretrained(TARGET, dtype=dtype)
        row_major(rows)
        forced = not _move(cols)
        with torch.inference_mode():
            for b in args.batch:
                a_args, b_args = decode_batch(rows, b, 64), decode_batch(cols, b, 64)
                a, c = [], []
                for _ in range(args.rounds):
                    a.append(time_forward(rows, *a_args, 20))
                    c.append(time_forward(cols, *b_args, 20))
                a, c = statistics.median(a), statistics.median(c)
                table.add_row(name, str(b), f"{a:.3f}", f"{c:.3f}" + (" *" if forced else ""),
                              f"{a / c:.2f}")
    table.caption = "* forced: use_cpu_gemm_layout leaves this dtype row-major"
    return table


def _move(model) -> bool:
    """Column-major weights for ``model``; False when the engine would not move its dtype
    (the benchmark moves them anyway, to show why)."""
    if use_cpu_gemm_layout(model):
        return True
    for m in model.modules():
        if isinstance(m, nn.Linear) and m.weight.is_contiguous():
            m.weight.data = m.weight.data.t().contiguous().t()
    return False


def engine_tokens_per_s(llm, conc: int, gen: torch.Generator) -> float:
    prompts = torch.randint(1, llm.vocab_size, (conc, 32), generator=gen).tolist()
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    for p in prompts:
        llm.add_request(p, params)
    t0 = time.perf_counter()
    while llm.step() is not None:
        pass
    return conc * 32 / (time.perf_counter() - t0)


def engine_table(args) -> Table:
    table = Table(title=f"in-process engine tokens/s (median of {args.rounds} rounds), float32")
    for col in ("method", "conc", "row-major", "column-major", "ratio"):
        table.add_column(col, justify="right")
    gen = torch.Generator().manual_seed(0)
    for method in ("none", "eagle3"):
        spec = None if method == "none" else {"method": method, "num_speculative_tokens": 3}
        kw = dict(max_num_seqs=max(args.concurrency), max_model_len=80)
        rows, cols = build_llm(None, spec, **kw), build_llm(None, spec, **kw)
        row_major(rows.target, *([rows.runner.proposer.head]
                                 if hasattr(rows.runner.proposer, "head") else []))
        for conc in args.concurrency:
            engine_tokens_per_s(rows, conc, gen), engine_tokens_per_s(cols, conc, gen)  # warm
            a, c = [], []
            for _ in range(args.rounds):
                a.append(engine_tokens_per_s(rows, conc, gen))
                c.append(engine_tokens_per_s(cols, conc, gen))
            a, c = statistics.median(a), statistics.median(c)
            table.add_row(method, str(conc), f"{a:.0f}", f"{c:.0f}", f"{c / a:.2f}")
    table.caption = "ratio = column-major / row-major tokens/s (> 1: the layout is faster)"
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_cpu_gemm_layout",
                                description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "float16"],
                   choices=["float32", "bfloat16", "float16", "float64"])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = Console()
    console.print(forward_table(args))
    console.print(engine_table(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
