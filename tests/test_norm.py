"""Residual add + RMSNorm: the Triton kernel (under TRITON_INTERPRET=1) against the torch
formula, and the torch formula against HF's RMSNorm."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdec.kernels as kernels
from specdec.kernels import norm_torch

pytest.importorskip("triton")
from triton_interpret import load_interpreted  # noqa: E402 (needs triton)

NORM = load_interpreted("triton_norm")


def test_worked_example():
    h, normed = kernels.add_rms_norm(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0]),
                                     torch.ones(2), 1e-12)
    assert h.tolist() == [3.0, 4.0]
    torch.testing.assert_close(normed, torch.tensor([0.848528, 1.131371]))


@settings(max_examples=25)
@given(rows=st.integers(0, 9), hidden=st.sampled_from([1, 8, 24, 64]),
       dtype=st.sampled_from([torch.float32, torch.float64]), strided=st.booleans(),
       seed=st.integers(0, 2**16))
def test_triton_equals_torch(rows, hidden, dtype, strided, seed):
    """Residual add + RMSNorm, and RMSNorm alone, against the torch formulas."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 2 * hidden, generator=g, dtype=dtype)
    x = x[:, :hidden] if strided else x[:, :hidden].contiguous()  # row-strided input
    res = torch.randn(rows, hidden, generator=g, dtype=dtype) * 3
    w = torch.randn(hidden, generator=g, dtype=dtype)
    want_h, want = norm_torch.add_rms_norm(x, res, w, 1e-6)
    got_h, got = NORM.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(got_h, want_h)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    # the same kernel without the residual: RMSNorm alone
    alone = NORM.rms_norm(x, w, 1e-6)
    assert alone.is_contiguous()
    torch.testing.assert_close(alone, norm_torch.rms_norm(x, w, 1e-6), rtol=tol, atol=tol)


def test_triton_falls_back_to_torch_under_autograd():
    x = torch.randn(3, 8, requires_grad=True)
    h, normed = NORM.add_rms_norm(x, torch.randn(3, 8), torch.ones(8), 1e-6)
    normed.sum().backward()
    assert x.grad is not None and h.grad_fn is not None


def test_matches_hf_rmsnorm_formula():
    g = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(4, 16, generator=g, dtype=torch.float64) for _ in range(3))
    h, normed = norm_torch.add_rms_norm(x, res, w[0], 1e-6)
    hf = w[0] * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(normed, hf, rtol=1e-14, atol=1e-14)


def test_offset_and_gated_rms_norm_worked_examples():
    """Qwen3.5's norms: ``x * (1 + w)`` (zero-centred weight) and ``w * norm(x) * silu(z)``."""
    from specdec.models.layers.norm import GatedRMSNorm, OffsetRMSNorm

    x = torch.tensor([3.0, 4.0])
    offset = OffsetRMSNorm(2, eps=0.0)
    with torch.no_grad():
        offset.weight.copy_(torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(offset(x), torch.tensor([0.8485, 2.2627]), atol=1e-4, rtol=0)
    gated = GatedRMSNorm(2, eps=0.0)
    assert gated(x, torch.zeros(2)).tolist() == [0.0, 0.0]
    torch.testing.assert_close(gated(x, torch.full((2,), 30.0)),
                               torch.tensor([0.8485, 1.1314]) * 30, atol=1e-3, rtol=0)


@pytest.mark.parametrize("family", ["llama", "moe"])
def test_a_forward_carrying_the_residual_into_the_triton_norms_equals_the_layer_by_layer_one(
        monkeypatch, family):
    """The decoder adds each layer's output in the next norm's kernel (the Triton kernel here,
    interpreted): its hidden states and aux hidden states equal the torch formula run layer
    by layer (``DecoderLayer.forward``, then the final norm), and every norm but the first
    layer's input norm is a fused one."""
    from helpers import moe_target, tiny_model

    model = tiny_model().to(torch.float64) if family == "llama" else moe_target()
    assert model.carries_residual
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2]])
    pos = torch.arange(7)[None]
    with torch.no_grad():
        x, inputs = model.embed(ids), []
        for layer, rope in zip(model.model.layers, model.layer_ropes(pos, x.dtype)):
            inputs.append(x)
            x = layer(x, rope)
        want = model.model.norm(x), torch.stack(inputs[:3], dim=-2)
        calls = []

        def counted(*args):
            calls.append(1)
            return NORM.add_rms_norm(*args)
        monkeypatch.setattr(kernels, "add_rms_norm", counted)
        got = model(ids, pos, aux_layer_ids=(0, 1, 2))
    assert len(calls) == 2 * len(model.model.layers)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_the_rms_norm_module_runs_the_kernel_dispatcher(monkeypatch):
    """``RMSNorm`` runs ``kernels.rms_norm`` (the Triton kernel where Triton runs), with or
    without SPECDEC_UNVERIFIED_GPU_PATHS (it has run on a GPU), and gives F.rms_norm's numbers."""
    from specdec.models.layers.norm import RMSNorm

    norm = RMSNorm(8, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(5, 8, dtype=torch.float64).float()
    calls = []

    def counted(*args):
        calls.append(1)
        return NORM.rms_norm(*args)
    monkeypatch.setattr(kernels, "rms_norm", counted)
    monkeypatch.delenv("SPECDEC_UNVERIFIED_GPU_PATHS", raising=False)
    with torch.no_grad():
        got = norm(x)
        assert calls == [1]
        monkeypatch.setenv("SPECDEC_UNVERIFIED_GPU_PATHS", "1")
        assert torch.equal(norm(x), got) and calls == [1, 1]
    want = torch.nn.functional.rms_norm(x, (8,), norm.weight.detach(), 1e-6)
    assert torch.equal(got, want)
