"""benchmarks/profile_step.py: kernel names sorted into kinds, and a profiled CPU run whose
kinds hold the step's work (GEMMs first) within its wall time."""

import torch

from benchmarks.bench_gpu import build
from benchmarks.profile_step import COLUMNS, kind_of, profile


def test_kernel_names_sort_into_kinds():
    named = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "gemm",
        "aten::addmm": "gemm", "aten::mm": "gemm",
        "_fused_add_rms_norm_kernel": "norm", "vectorized_layer_norm_kernel": "norm",
        "_paged_attention_decode_kernel": "attention",
        "_rope_kernel": "rope",
        "void at::native::index_elementwise_kernel<128, 4>": "copy",
        "Memcpy DtoD (Device -> Device)": "copy", "aten::cat": "copy",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>":
            "other", "aten::silu": "other",
    }
    assert {name: kind_of(name) for name in named} == named


def test_a_profiled_cpu_run_accounts_for_its_steps():
    llm = build("embedded", "none", True, "eager", 2, torch.device("cpu"), 3, torch.float32)
    row = profile(llm, 2, 3, llm.vocab_size, torch.device("cpu"))
    kinds = {k: row[k] for k in COLUMNS}
    assert all(v >= 0 for v in kinds.values())
    assert kinds["gemm"] == max(kinds.values()) > 0  # a decode step is GEMMs first
    assert kinds["attention"] > 0 and kinds["norm"] > 0
    assert sum(kinds.values()) <= 1.5 * row["wall"]  # operator self times within the steps
    assert not llm.scheduler.has_unfinished()
