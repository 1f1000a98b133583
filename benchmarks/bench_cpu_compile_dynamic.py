"""The CPU engine with ``graph_backend="compile_dynamic"`` against eager, side by side.

    python -m benchmarks.bench_cpu_compile_dynamic [--concurrency 4 16] [--rounds 5]
        [--threads 1]

``compile_dynamic``: every target step and padded draft step runs ``torch.compile(dynamic=True)``
(inductor's C++ kernels fuse the norms, rotary, activations and indexing that dominate a
small-batch CPU step; one graph per code path, compiled while the LLM is built, untimed);
``rows``: the same engine eager. The workloads, fresh child processes and alternating order
are ``bench_cpu_attention_layout``'s; ratio = compile_dynamic / eager tokens/s per round,
then the median.
"""

from benchmarks.bench_cpu_attention_layout import compare

if __name__ == "__main__":
    compare(("compile_dynamic", "rows"), "CPU engine: compile_dynamic vs eager")
