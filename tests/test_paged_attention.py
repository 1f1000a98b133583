"""Paged attention: the Triton kernel (under TRITON_INTERPRET=1) against the torch reference on
random paged layouts, and the torch path's independence from the gather bound."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdec.kernels as kernels
from specdec.kernels import paged_attention_torch as ref

pytest.importorskip("triton")
from triton_interpret import load_interpreted  # noqa: E402 (needs triton)

PA = load_interpreted("triton_paged_attention")
FEW = settings(max_examples=25)


def random_layout(seed: int, num_reqs: int, block_size: int, hkv: int, group: int, d: int,
                  dtype: torch.dtype):
    """A step of mixed prefill chunks, decode rows (1 + K tokens) and padding requests
    (no tokens, seq_len 1), then padding tokens (slot -1) past the last request. Blocks are
    scattered at random in the cache; unallocated table entries hold -1 or 0 (read by the
    torch gather when its bound runs past a request, masked out)."""
    g = torch.Generator().manual_seed(seed)

    def rand(high, size=()):
        return torch.randint(0, high, size, generator=g)

    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        kind = int(rand(3))
        if kind == 0:  # padding request
            query_lens.append(0); seq_lens.append(1)
            continue
        t = int(rand(9)) + 1 if kind == 1 else int(rand(4)) + 1  # prefill chunk / 1 + K
        query_lens.append(t); seq_lens.append(int(rand(40)) + t)
    width = max(-(-s // block_size) for s in seq_lens) + int(rand(3))
    num_blocks = num_reqs * width + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.where(rand(2, (num_reqs, width)).bool(), -1, 0).to(torch.int32)
    for r, s in enumerate(seq_lens):
        used = -(-s // block_size)
        table[r, :used] = perm[r * width:r * width + used]
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    n = int(qsl[-1]) + int(rand(4))
    slots = num_blocks * block_size + 1
    k_cache = torch.randn(slots, hkv, d, generator=g, dtype=dtype)
    v_cache = torch.randn(slots, hkv, d, generator=g, dtype=dtype)
    # q is a strided view, as the model hands it over (the q part of one qkv output)
    q = torch.randn(n, hkv * group + 2 * hkv, d, generator=g, dtype=dtype)[:, :hkv * group]
    return q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), table


def test_worked_example_plan():
    qsl, seq_lens = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    req = ref.token_requests(qsl, 5)
    assert req.tolist() == [0, 0, 0, 1, 1]
    assert ref.visible_keys(req, qsl, seq_lens).tolist() == [3, 4, 5, 9, 9]
    assert ref.token_requests(torch.tensor([0, 3, 3, 4], dtype=torch.int32), 6).tolist() == [
        0, 0, 0, 2, 2, 2]


@FEW
@given(num_reqs=st.integers(1, 5), block_size=st.sampled_from([1, 4, 16]),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 3, 4]), d=st.sampled_from([8, 12]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_triton_kernel_equals_reference(num_reqs, block_size, hkv, group, d, dtype, seed):
    q, k_cache, v_cache, qsl, seq_lens, table = random_layout(seed, num_reqs, block_size, hkv,
                                                              group, d, dtype)
    n, bound = q.shape[0], int(seq_lens.max())
    expected = ref.paged_attention(q, k_cache, v_cache, ref.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size))
    got = PA.paged_attention(q, k_cache, v_cache, PA.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size))
    assert got.dtype == dtype and got.shape == expected.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


@FEW
@given(num_reqs=st.integers(1, 5), block_size=st.sampled_from([1, 4, 16]),
       extra=st.integers(1, 500), dtype=st.sampled_from([torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
def test_torch_path_does_not_depend_on_the_bound(num_reqs, block_size, extra, dtype, seed):
    """max_seq_len = the true max vs any larger static bound: the same result up to the
    rounding of SDPA's length-dependent summation order (an ulp or two, measured 2.4e-7 in
    float32 and 2.8e-16 in float64), never a different set of keys."""
    q, k_cache, v_cache, qsl, seq_lens, table = random_layout(seed, num_reqs, block_size, 2, 2,
                                                              8, dtype)
    n, true_max = q.shape[0], int(seq_lens.max())
    outs = [ref.paged_attention(q, k_cache, v_cache, ref.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size)) for bound in (true_max, true_max + extra)]
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


def test_reference_is_dense_attention_over_the_visible_keys():
    """One request, 3 cached keys + a 2-token chunk, block_size 2 with blocks [3, 1, 0]:
    token 0 sees keys 0..3, token 1 sees 0..4 (plain softmax over gathered keys)."""
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(5, 1, 4, generator=g), torch.randn(5, 1, 4, generator=g)
    table = torch.tensor([[3, 1, 0]], dtype=torch.int32)
    k_cache, v_cache = torch.zeros(9, 1, 4), torch.zeros(9, 1, 4)
    slots = torch.tensor([6, 7, 2, 3, 0])  # position p -> table[p // 2] * 2 + p % 2
    k_cache[slots], v_cache[slots] = keys, values
    q = torch.randn(2, 2, 4, generator=g)
    p = ref.plan_paged_attention(torch.tensor([0, 2], dtype=torch.int32),
                                 torch.tensor([5], dtype=torch.int32), table, 2, 6, 2)
    out = ref.paged_attention(q, k_cache, v_cache, p)
    for i, seen in enumerate((4, 5)):
        w = (q[i] @ keys[:seen, 0].T / 2).softmax(-1)  # [Hq, seen]; scale 1/sqrt(4)
        torch.testing.assert_close(out[i], w @ values[:seen, 0])


def test_importing_the_triton_modules_keeps_the_dispatchers():
    """A submodule named like a dispatched function would replace it on import."""
    import importlib
    for name, module in kernels.TRITON_MODULES.items():
        importlib.import_module(f"specdec.kernels.{module}")
    for name in kernels.TORCH_IMPLS:
        assert getattr(kernels, name).__wrapped__ is kernels.TORCH_IMPLS[name], name


def test_cpu_dispatches_to_the_torch_path():
    q, k_cache, v_cache, qsl, seq_lens, table = random_layout(1, 3, 4, 2, 2, 8, torch.float32)
    p = kernels.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 50, 4)
    assert isinstance(p, ref.PagedPlan)
    assert torch.equal(kernels.paged_attention(q, k_cache, v_cache, p),
                       ref.paged_attention(q, k_cache, v_cache, p))
