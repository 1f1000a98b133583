"""Every Triton kernel compiles to an H100 binary for the launches its wrapper makes.

The other kernel tests run the kernels in the interpreter, which accepts code the compiler
rejects (a loop-carried value that changes type, a reduction of the wrong rank, a bad cast).
Here triton's own JIT path runs ahead of time on the CPU, down to the cubin (triton ships
ptxas): bind the recorded launch, pack the signature, compile for sm_90.
"""

import pytest
import torch

pytest.importorskip("triton")

from specdec.kernels.reference import PaddedPrep  # noqa: E402
from triton_interpret import compile_for_cuda, launch_args, load_interpreted  # noqa: E402

TP = load_interpreted("triton_padded")
NORM = load_interpreted("triton_norm")
ROPE = load_interpreted("triton_rope")
ATTN = load_interpreted("triton_paged_attention")


def i32(*shape, high=4):
    return torch.randint(0, high, shape, dtype=torch.int32)


def attention(dtype, **kwargs):
    qsl, seq_lens, table = (torch.tensor(x, dtype=torch.int32) for x in
                            ([0, 2, 3], [5, 9], [[0, 1, 2], [3, 4, 5]]))
    plan = ATTN.plan_paged_attention(qsl, seq_lens, table, 3, 12, 4)
    qkv = torch.randn(3, 12, 64, dtype=dtype)
    k, v = (torch.randn(24, 2, 64, dtype=dtype) for _ in range(2))
    return lambda: ATTN.paged_attention(qkv[:, :8], k, v, plan, **kwargs)


# (kernel, one launch through its wrapper) for each variant the engine uses
LAUNCHES = [
    (TP._padded_step_kernel, lambda: TP.prepare_padded_step(
        i32(5, 4), torch.zeros(5, dtype=torch.bool), i32(2, 9), torch.zeros(5, dtype=torch.int64),
        i32(5), i32(5), i32(6), 10, out=PaddedPrep.empty(5, "cpu"))),
    (TP._prepare_inputs_kernel, lambda: TP.prepare_inputs_padded(i32(5), i32(5), i32(6))),
    (TP._shift_left_kernel, lambda: TP.shift_first_pass_input_ids(
        torch.arange(9), torch.arange(5), i32(5))),
    (TP._scatter_kernel, lambda: TP.shift_first_pass_input_ids(
        torch.arange(9), torch.arange(5), i32(5))),
    (TP._advance_draft_step_kernel, lambda: TP.advance_draft_step(
        torch.arange(5), i32(5), i32(5, 8), 3, 4, 30)),
    (TP._advance_draft_step_kernel, lambda: TP.advance_draft_step(
        torch.arange(5), i32(5), i32(5, 8), torch.tensor(3), 4, 30)),
    (NORM._add_rms_norm_kernel, lambda: NORM.add_rms_norm(
        torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(3, 64, dtype=torch.bfloat16),
        torch.ones(64, dtype=torch.bfloat16), 1e-6)),
    (NORM._add_rms_norm_kernel, lambda: NORM.rms_norm(
        torch.randn(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16), 1e-6)),
    (ROPE._rope_kernel, lambda: ROPE.apply_rope(
        torch.randn(3, 12, 64, dtype=torch.bfloat16)[:, :8],
        *(torch.randn(3, 1, 64, dtype=torch.bfloat16) for _ in range(2)))),
    (ATTN._paged_attention_kernel, attention(torch.bfloat16)),
    (ATTN._paged_attention_kernel, attention(torch.float32)),
    (ATTN._paged_attention_kernel, attention(torch.bfloat16, sliding_window=4, scale=0.1)),
]


@pytest.mark.parametrize("case", range(len(LAUNCHES)),
                         ids=[f"{k.fn.__name__}-{i}" for i, (k, _) in enumerate(LAUNCHES)])
def test_kernel_compiles_for_an_h100(case):
    kernel, launch = LAUNCHES[case]
    [(args, kwargs)] = launch_args(kernel, lambda _: launch(), [None])
    compiled = compile_for_cuda(kernel, args, kwargs)
    assert compiled.asm["cubin"]
    assert compiled.name == kernel.fn.__name__
