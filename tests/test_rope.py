"""Rotary embedding: the Triton kernel (under TRITON_INTERPRET=1) against the torch formula on
the paged forward's layout (full, partial and interleaved rotary; float32, float64, bfloat16),
its torch fallbacks, its sm_90 compile for the partial/interleaved variants, and the formula
against HF's rotate_half."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.kernels import rope_torch
from specdec.models.layers.rotary import RotaryEmbedding

pytest.importorskip("triton")
from triton_interpret import compile_for_cuda, launch_args, load_interpreted  # noqa: E402

ROPE = load_interpreted("triton_rope")


def rotary_dim(d: int, fraction: float) -> int:
    """An even rotary width <= d: 12 * 0.25 -> 2, 16 * 0.5 -> 8."""
    return max(2, int(d * fraction) // 2 * 2)


@settings(max_examples=40)
@given(n=st.integers(0, 5), heads=st.integers(1, 4), d=st.sampled_from([2, 8, 12, 16]),
       fraction=st.sampled_from([1.0, 0.5, 0.25]), interleaved=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_triton_equals_torch_on_a_qkv_view(n, heads, d, fraction, interleaved, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    r = rotary_dim(d, fraction)
    qkv = torch.randn(n, heads + 2, d, generator=g).to(dtype)
    x = qkv[:, :heads]  # the q and k heads of a qkv output: strided rows
    cos, sin = (torch.randn(n, 1, r, generator=g).to(dtype) for _ in range(2))
    got = ROPE.apply_rope(x, cos, sin, interleaved=interleaved)
    assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.bfloat16:  # the kernel works in float32 and rounds once
        want = rope_torch.apply_rope(x.float(), cos.float(), sin.float(), interleaved).to(dtype)
        torch.testing.assert_close(got, want)
    else:
        tol = 1e-6 if dtype == torch.float32 else 1e-14
        want = rope_torch.apply_rope(x, cos, sin, interleaved)
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got[..., r:], x[..., r:])  # the channels past rotary_dim are copied


def test_triton_wrapper_falls_back_for_dense_layout_and_autograd():
    rope = RotaryEmbedding.default(8, 1e4).tables(torch.arange(5), torch.float32)
    x = torch.randn(2, 5, 3, 8)  # dense [B, T, H, D] with cos [T, 1, D]
    assert torch.equal(ROPE.apply_rope(x, rope.cos, rope.sin),
                       rope_torch.apply_rope(x, rope.cos, rope.sin))
    y = torch.randn(5, 3, 8, requires_grad=True)
    ROPE.apply_rope(y, rope.cos, rope.sin).sum().backward()
    assert y.grad is not None


@pytest.mark.parametrize("rot,interleaved", [(64, True), (16, False), (16, True)])
def test_partial_and_interleaved_variants_compile_for_an_h100(rot, interleaved):
    x = torch.randn(3, 12, 64, dtype=torch.bfloat16)[:, :8]
    cos, sin = (torch.randn(3, 1, rot, dtype=torch.bfloat16) for _ in range(2))
    [(args, kwargs)] = launch_args(
        ROPE._rope_kernel, lambda _: ROPE.apply_rope(x, cos, sin, interleaved=interleaved), [None])
    assert (kwargs["ROT_DIM"], kwargs["INTERLEAVED"]) == (rot, interleaved)
    assert compile_for_cuda(ROPE._rope_kernel, args, kwargs).asm["cubin"]


def test_formula_is_hf_rotate_half():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 16, generator=g, dtype=torch.float64)
    pos = torch.tensor([0, 1, 7, 300])
    inv_freq = 1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ang = torch.cat([pos[:, None] * inv_freq] * 2, -1)[:, None, :]
    hf = x * ang.cos() + torch.cat((-x[..., 8:], x[..., :8]), -1) * ang.sin()
    rope = RotaryEmbedding.default(16, 1e4).tables(pos, torch.float64)
    torch.testing.assert_close(rope.apply(x), hf, rtol=1e-6, atol=1e-6)  # float32 angles


@settings(max_examples=30)
@given(n=st.integers(0, 5), hq=st.integers(1, 4), hkv=st.integers(1, 2),
       d=st.sampled_from([2, 8, 16]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_fused_rope_and_cache_write_equals_rope_then_index_copy(n, hq, hkv, d, dtype, seed):
    """The attention layer's rotary + K/V cache write as one kernel: the same rotated q, the
    same cache rows written (rotated k, v as given), every other row untouched."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=g).to(dtype)
    cos, sin = (torch.randn(n, 1, d, generator=g).to(dtype) for _ in range(2))
    slots = torch.randperm(2 * n + 1, generator=g)[:n]
    cache = [torch.randn(2 * n + 1, hkv, d, generator=g).to(dtype) for _ in range(2)]
    got_k, got_v = (c.clone() for c in cache)
    q = ROPE.rope_write_kv(qkv, cos, sin, slots, got_k, got_v, hq)
    exact = dtype != torch.bfloat16  # bf16: the kernel works in float32 and rounds once
    want_k, want_v = (c.clone() if exact else c.float() for c in cache)
    args = (qkv, cos, sin) if exact else (qkv.float(), cos.float(), sin.float())
    want_q = rope_torch.rope_write_kv(*args, slots, want_k, want_v, hq)
    tol = {torch.float32: 1e-6, torch.float64: 1e-14, torch.bfloat16: None}[dtype]
    for got, want in ((q, want_q), (got_k, want_k), (got_v, want_v)):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want.to(dtype), rtol=tol, atol=tol)
    untouched = torch.ones(2 * n + 1, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_k[untouched], cache[0][untouched])
    assert torch.equal(got_v[untouched], cache[1][untouched])


def test_fused_rope_and_cache_write_compiles_for_an_h100():
    """bf16, Llama-3-8B's head layout (32 q heads, 8 KV heads, D 128), a 64-token step."""
    qkv = torch.randn(64, 48, 128, dtype=torch.bfloat16)
    cos, sin = (torch.randn(64, 1, 128, dtype=torch.bfloat16) for _ in range(2))
    k_cache, v_cache = (torch.zeros(257, 8, 128, dtype=torch.bfloat16) for _ in range(2))
    slots = torch.arange(64)
    [(args, kwargs)] = launch_args(
        ROPE._rope_write_kv_kernel,
        lambda _: ROPE.rope_write_kv(qkv, cos, sin, slots, k_cache, v_cache, 32), [None])
    assert (kwargs["HQ"], kwargs["HKV"], kwargs["HEAD_DIM"]) == (32, 8, 128)
    assert compile_for_cuda(ROPE._rope_write_kv_kernel, args, kwargs).asm["cubin"]
