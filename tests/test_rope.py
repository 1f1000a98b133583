"""Rotary embedding: the Triton kernel (under TRITON_INTERPRET=1) against the torch formula on
the paged forward's layout, its torch fallbacks, and the formula against HF's rotate_half."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.kernels import rope_torch
from specdec.models.llama import Rope

pytest.importorskip("triton")
from triton_interpret import load_interpreted  # noqa: E402 (needs triton)

ROPE = load_interpreted("triton_rope")


@settings(max_examples=25)
@given(n=st.integers(0, 7), heads=st.integers(1, 6), d=st.sampled_from([2, 8, 12]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_triton_equals_torch_on_a_qkv_view(n, heads, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, heads + 2, d, generator=g, dtype=dtype)
    x = qkv[:, :heads]  # the q and k heads of a qkv output: strided rows
    rope = Rope.at(torch.randint(0, 1000, (n,), generator=g), d, 1e4, dtype)
    want = rope_torch.apply_rope(x, rope.cos, rope.sin)
    got = ROPE.apply_rope(x, rope.cos, rope.sin)
    assert got.shape == want.shape and got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_triton_wrapper_falls_back_for_dense_layout_and_autograd():
    rope = Rope.at(torch.arange(5), 8, 1e4, torch.float32)
    x = torch.randn(2, 5, 3, 8)  # dense [B, T, H, D] with cos [T, 1, D]
    assert torch.equal(ROPE.apply_rope(x, rope.cos, rope.sin),
                       rope_torch.apply_rope(x, rope.cos, rope.sin))
    y = torch.randn(5, 3, 8, requires_grad=True)
    ROPE.apply_rope(y, rope.cos, rope.sin).sum().backward()
    assert y.grad is not None


def test_formula_is_hf_rotate_half():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 16, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 300])
    inv_freq = 1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ang = torch.cat([pos[:, None] * inv_freq] * 2, -1)[:, None, :]
    hf = x * ang.cos() + torch.cat((-x[..., 8:], x[..., :8]), -1) * ang.sin()
    rope = Rope.at(pos, 16, 1e4, torch.float64)
    torch.testing.assert_close(rope.apply(x), hf, rtol=1e-6, atol=1e-6)  # float32 angles
