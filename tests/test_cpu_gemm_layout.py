"""use_cpu_gemm_layout: column-major CPU weights compute what the row-major ones do."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.models.layers.linear import CPU_GEMM_LAYOUT_DTYPES, use_cpu_gemm_layout

from helpers import tiny_model


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 9), inp=st.integers(2, 40), out=st.integers(2, 40),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_moved_linear_equals_row_major(rows, inp, out, bias, seed):
    torch.manual_seed(seed)
    lin = nn.Linear(inp, out, bias=bias)
    x = torch.randn(rows, inp)
    before = {k: v.clone() for k, v in lin.state_dict().items()}
    want = lin(x)
    assert use_cpu_gemm_layout(lin) == 1
    assert lin.weight.shape == (out, inp) and lin.weight.stride() == (1, out)
    for k, v in lin.state_dict().items():  # same values under the same names
        assert torch.equal(v, before[k])
    torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert use_cpu_gemm_layout(lin) == 0  # moved once


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_dtypes_stay_row_major(dtype):
    assert dtype not in CPU_GEMM_LAYOUT_DTYPES
    lin = nn.Linear(8, 16).to(dtype)
    assert use_cpu_gemm_layout(lin) == 0
    assert lin.weight.is_contiguous()


def test_tied_lm_head_keeps_the_embedding_rows():
    model = tiny_model(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    use_cpu_gemm_layout(model)
    assert model.model.embed_tokens.weight.is_contiguous()
    assert not model.model.layers[0].mlp.gate_up_proj.weight.is_contiguous()


@pytest.mark.parametrize("spec", [None, {"method": "eagle3", "num_speculative_tokens": 2}])
def test_engine_moves_weights_and_generates_what_row_major_weights_do(spec):
    """The engine's target and head run column-major on the CPU; greedy tokens equal an
    engine whose weights were put back row-major."""
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[5, 9, 200, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    moved = LLM(speculative_config=spec, max_num_seqs=2, max_model_len=64)
    linears = [m for m in moved.target.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.weight.stride() == (1, m.weight.shape[0]) for m in linears)
    head = getattr(moved.runner.proposer, "head", None)
    if spec is not None:
        assert not head.fc.weight.is_contiguous()
    plain = LLM(speculative_config=spec, max_num_seqs=2, max_model_len=64)
    for model in (plain.target, getattr(plain.runner.proposer, "head", None)):
        for m in (model.modules() if model is not None else ()):
            if isinstance(m, nn.Linear):
                m.weight.data = m.weight.data.contiguous()
    got = [o.token_ids for o in moved.generate(prompts, params)]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert got == want
