"""Latent (MLA) paged attention: the torch path against expanded dense attention, the Triton
kernel (under TRITON_INTERPRET=1) against the torch path on random paged layouts, the kernel
compiling for an H100, and the latent cache's size (one row of L + R per token per layer)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specdec.kernels as kernels
from specdec.attention import AttentionMetadata, KVCache, KVCacheSpec
from specdec.kernels import mla_attention_torch as ref
from specdec.kernels import paged_attention_torch as paged_ref

pytest.importorskip("triton")
from triton_interpret import compile_for_cuda, launch_args, load_interpreted  # noqa: E402

MLA = load_interpreted("triton_mla_attention")
PA = load_interpreted("triton_paged_attention")
FEW = settings(max_examples=12, deadline=None)
INTERPRETED = settings(max_examples=6, deadline=None)  # the Triton interpreter: ~1-2 s each


def latent_layout(seed: int, num_reqs: int, block_size: int, heads: int, latent: int,
                  rope: int, dtype: torch.dtype):
    """(q [N, H, L+R], cache [S, 1, L+R], query_start_loc, seq_lens, block_table): prefill
    chunks, 1 + K decode rows and empty padding requests, blocks scattered in the cache, then
    0..3 padding tokens past the last request."""
    g = torch.Generator().manual_seed(seed)

    def rand(high, size=()):
        return torch.randint(0, high, size, generator=g)

    query_lens, seq_lens = [], []
    for _ in range(num_reqs):
        kind = int(rand(3))
        t = 0 if kind == 0 else int(rand(9)) + 1 if kind == 1 else int(rand(4)) + 1
        query_lens.append(t)
        seq_lens.append(1 if t == 0 else int(rand(40)) + t)
    width = max(-(-s // block_size) for s in seq_lens) + 1
    num_blocks = num_reqs * width + 2
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    for r, s in enumerate(seq_lens):
        used = -(-s // block_size)
        table[r, :used] = perm[r * width:r * width + used]
    qsl = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    n = int(qsl[-1]) + int(rand(4))
    d = latent + rope
    cache = torch.randn(num_blocks * block_size + 1, 1, d, generator=g, dtype=dtype)
    q = torch.randn(n, heads, d, generator=g, dtype=dtype)
    return q, cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), table


def test_torch_path_equals_expanded_attention():
    """One request of 7 tokens after 5 cached: each query sees its visible rows; the output is
    softmax(scale q.row) @ row[:V], head by head, written out as plain matmuls."""
    torch.manual_seed(0)
    h, lat, rope, bs = 3, 8, 4, 4
    table = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    rows = torch.randn(12, lat + rope, dtype=torch.float64)
    cache = torch.zeros(4 * bs + 1, 1, lat + rope, dtype=torch.float64)
    for j in range(12):
        cache[int(table[0, j // bs]) * bs + j % bs, 0] = rows[j]
    qsl, seq_lens = torch.tensor([0, 7], dtype=torch.int32), torch.tensor([12], dtype=torch.int32)
    q = torch.randn(7, h, lat + rope, dtype=torch.float64)
    plan = paged_ref.plan_paged_attention(qsl, seq_lens, table, 7, 16, bs)
    out = ref.mla_attention(q, cache, plan, value_dim=lat, scale=0.3)
    for i in range(7):
        seen = rows[:6 + i]
        w = (0.3 * q[i] @ seen.T).softmax(-1)
        torch.testing.assert_close(out[i], w @ seen[:, :lat])


@FEW
@given(seed=st.integers(0, 2**16), num_reqs=st.integers(1, 6), known=st.booleans(),
       extra=st.integers(0, 2))
def test_query_rows_equal_token_major(seed, num_reqs, known, extra):
    """Whatever rows the plan picks (request-major, segments), the token-major outputs
    (padding tokens: finite)."""
    q, cache, qsl, seq_lens, table = latent_layout(seed, num_reqs, 4, 3, 8, 4, torch.float64)
    n, bound = q.shape[0], int(seq_lens.max()) + 2
    t = max(1, int((qsl[1:] - qsl[:-1]).max())) + extra if known else None
    plans = [paged_ref.plan_paged_attention(qsl, seq_lens, table, n, bound, 4, max_query_len=m)
             for m in (1, t)]
    got, want = (ref.mla_attention(q, cache, p, value_dim=8, scale=0.4) for p in plans[::-1])
    real = int(qsl[-1])
    torch.testing.assert_close(got[:real], want[:real], rtol=1e-12, atol=1e-12)
    assert got.isfinite().all()


def test_worked_example_of_the_docstring():
    cache = torch.tensor([[[1.0, 0, 0]], [[0, 1.0, 0]], [[0, 0, 0]]])
    plan = paged_ref.plan_paged_attention(torch.tensor([0, 1], dtype=torch.int32),
                                          torch.tensor([2], dtype=torch.int32),
                                          torch.tensor([[0]], dtype=torch.int32), 1, 2, 2)
    q = torch.tensor([[[torch.log(torch.tensor(3.0)), 0, 0]]])
    out = ref.mla_attention(q, cache, plan, value_dim=2, scale=1.0)
    torch.testing.assert_close(out, torch.tensor([[[0.75, 0.25]]]))


@INTERPRETED
@given(seed=st.integers(0, 2**16), num_reqs=st.integers(1, 4),
       block_size=st.sampled_from([1, 4, 16]), heads=st.sampled_from([1, 4, 20]),
       dims=st.sampled_from([(32, 16), (24, 8), (16, 0)]))
def test_triton_kernel_equals_the_torch_path(seed, num_reqs, block_size, heads, dims):
    q, cache, qsl, seq_lens, table = latent_layout(seed, num_reqs, block_size, heads, *dims,
                                                   torch.float64)
    n = q.shape[0]
    want = ref.mla_attention(q, cache, paged_ref.plan_paged_attention(
        qsl, seq_lens, table, n, int(seq_lens.max()), block_size), value_dim=dims[0], scale=0.2)
    plan = PA.plan_paged_attention(qsl, seq_lens, table, n, 0, block_size)
    got = MLA.mla_attention(q, cache, plan, value_dim=dims[0], scale=0.2)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_triton_kernel_float32_and_strided_queries():
    q, cache, qsl, seq_lens, table = latent_layout(3, 3, 4, 4, 32, 16, torch.float32)
    wide = torch.randn(q.shape[0], 6, 48)
    wide[:, :4] = q
    plan_t = paged_ref.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 60, 4)
    want = ref.mla_attention(q, cache, plan_t, value_dim=32, scale=0.15)
    got = MLA.mla_attention(wide[:, :4], cache, PA.plan_paged_attention(
        qsl, seq_lens, table, q.shape[0], 0, 4), value_dim=32, scale=0.15)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_cpu_dispatches_to_the_torch_path():
    q, cache, qsl, seq_lens, table = latent_layout(1, 2, 4, 4, 16, 8, torch.float32)
    p = kernels.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 50, 4)
    assert torch.equal(kernels.mla_attention(q, cache, p, value_dim=16, scale=0.1),
                       ref.mla_attention(q, cache, p, value_dim=16, scale=0.1))


def test_bad_shapes_name_the_problem():
    q, cache, qsl, seq_lens, table = latent_layout(1, 2, 4, 4, 16, 8, torch.float32)
    p = kernels.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 50, 4)
    with pytest.raises(ValueError, match="value_dim=30"):
        ref.mla_attention(q, cache, p, value_dim=30, scale=0.1)
    with pytest.raises(ValueError, match=r"\[S, 1, D\]"):
        ref.mla_attention(q, cache.expand(-1, 2, -1), p, value_dim=16, scale=0.1)


# ---- the latent cache ---------------------------------------------------------------------
def test_latent_cache_keeps_one_row_per_token():
    """DeepSeek-V3's layer: 512 + 64 values per token, no V tensor: 1152 bytes in bf16, vs
    2 * 8 * 128 * 2 = 4096 for a GQA layer with 8 kv heads of 128."""
    spec = KVCacheSpec(1, 512 + 64, value_dim=512)
    assert spec.bytes_per_token(torch.bfloat16) == 1152
    assert KVCacheSpec(8, 128).bytes_per_token(torch.bfloat16) == 4096
    cache = KVCache([KVCacheSpec(1, 48, value_dim=32)] * 2, 3, 4, torch.float32, "cpu")
    assert cache.k[0].shape == (13, 1, 48)
    assert cache.v[0].data_ptr() == cache.k[0].data_ptr() and cache.v[0].shape == (13, 1, 32)
    with pytest.raises(ValueError, match="value_dim=60"):
        KVCacheSpec(1, 48, value_dim=60)


def test_paged_kv_attend_latent_writes_then_attends():
    """Two requests' prefills through ``PagedKV.attend_latent`` equal the torch path over the
    rows written; a GQA layer refuses it."""
    torch.manual_seed(1)
    cache = KVCache([KVCacheSpec(1, 24, value_dim=16), KVCacheSpec(2, 8)], 4, 4,
                    torch.float64, "cpu")
    meta = AttentionMetadata(slot_mapping=torch.tensor([4, 5, 6, 0, 1, -1]),
                             query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32),
                             seq_lens=torch.tensor([3, 2], dtype=torch.int32),
                             block_table=torch.tensor([[1, 2], [0, 3]], dtype=torch.int32),
                             max_seq_len=3)
    kv = cache.bind(meta)
    q, rows = torch.randn(6, 3, 24, dtype=torch.float64), torch.randn(6, 24, dtype=torch.float64)
    out = kv.attend_latent(0, q, rows, 0.5)
    for i, seen in enumerate([[0], [0, 1], [0, 1, 2], [3], [3, 4], [3, 4]]):
        w = (0.5 * q[i] @ rows[seen].T).softmax(-1)
        torch.testing.assert_close(out[i], w @ rows[seen, :16])
    with pytest.raises(ValueError, match="layer 1 has no latent cache"):
        kv.attend_latent(1, q, rows, 0.5)


# ---- compiles for an H100 ---------------------------------------------------------------------
def _launch(dtype, heads, latent, rope):
    q, cache, qsl, seq_lens, table = latent_layout(2, 3, 16, heads, latent, rope, dtype)
    plan = PA.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 0, 16)
    return lambda: MLA.mla_attention(q, cache, plan, value_dim=latent, scale=0.1)


@pytest.mark.parametrize("dtype,heads,latent,rope", [
    (torch.bfloat16, 16, 512, 64), (torch.float32, 4, 32, 16), (torch.float16, 20, 24, 8)])
def test_kernel_compiles_for_an_h100(dtype, heads, latent, rope):
    kernel = MLA._mla_attention_kernel
    [(args, kwargs)] = launch_args(kernel, lambda _: _launch(dtype, heads, latent, rope)(),
                                   [None])
    compiled = compile_for_cuda(kernel, args, kwargs)
    assert compiled.asm["cubin"]
