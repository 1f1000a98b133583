"""benchmarks/profile_step.py: kernel names sorted into kinds, and a profiled CPU run whose
kinds hold the step's work (GEMMs first) within its wall time."""

import torch

from benchmarks.bench_gpu import build
from benchmarks.profile_step import COLUMNS, kind_of, profile


def test_kernel_names_sort_into_kinds():
    named = {
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64": "gemm",
        "void cublasLt::splitKreduce_kernel<32, 16, int, float>": "gemm",
        "nvjet_hsh_128x256_64x4_1x2_h_bz_coopA_NTN": "gemm",
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
    """Five profiled runs, each kind at its least: a run that the OS preempts (a busy 2-core
    box, the suite's other worker) only adds time, to whichever op was running. GEMMs lead
    the named kinds; the many small eager ops of "other" together can outweigh them (they
    do on some 2-core machines: 1.29-1.35 ms a step against 0.74-0.82)."""
    llm = build("embedded", "none", True, "eager", 2, torch.device("cpu"), 3, torch.float32)
    rows = [profile(llm, 2, 3, llm.vocab_size, torch.device("cpu")) for _ in range(5)]
    kinds = {k: min(row[k] for row in rows) for k in COLUMNS}
    assert all(row[k] >= 0 for row in rows for k in COLUMNS)
    named = {k: v for k, v in kinds.items() if k != "other"}
    assert kinds["gemm"] == max(named.values()) > 0  # a decode step's kernels are GEMMs first
    assert kinds["attention"] > 0 and kinds["norm"] > 0
    # operator self times within the steps (in a run the OS left alone)
    assert min(sum(row[k] for k in COLUMNS) / row["wall"] for row in rows) <= 1.5
    # the slowest "other" operators by name, each within that kind's total
    assert rows[0]["top_other"] and all(0 < ms <= rows[0]["other"] + 1e-9
                                        for _, ms in rows[0]["top_other"])
    assert not llm.scheduler.has_unfinished()


def test_a_speculative_run_profiles_steps_that_decode_every_request():
    """EAGLE-3 at full acceptance emits 1 + K tokens a step: the profiled steps still decode
    every request (a run whose requests ran out of tokens would time empty steps)."""
    llm = build("llama-tiny", "eagle3", True, "eager", 2, torch.device("cpu"), 3,
                torch.float32)
    row = profile(llm, 2, 6, llm.vocab_size, torch.device("cpu"))  # raises otherwise
    assert row["gemm"] > 0 and row["wall"] > 0 and row["steps"] == 6
