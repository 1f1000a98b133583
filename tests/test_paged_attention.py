"""Paged attention: the Triton kernel (under TRITON_INTERPRET=1) against the torch reference on
random paged layouts, the torch path against dense attention (sliding window, scale), and the
torch path's independence from the gather bound."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specdec.kernels as kernels
from specdec.kernels import paged_attention_torch as ref

pytest.importorskip("triton")
from triton_interpret import compile_cache_keys, launch_args, load_interpreted  # noqa: E402

PA = load_interpreted("triton_paged_attention")
FEW = settings(max_examples=25)
INTERPRETED = settings(max_examples=6)  # the interpreter runs ~2 s per example


def random_layout(seed: int, num_reqs: int, block_size: int, hkv: int, group: int, d: int,
                  dtype: torch.dtype):
    """A step of mixed prefill chunks, decode rows (1 + K tokens) and padding requests
    (no tokens, seq_len 1), then padding tokens (slot -1) past the last request."""
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
    return paged_layout(g, query_lens, seq_lens, block_size, hkv, group, d, dtype)


def paged_layout(g: torch.Generator, query_lens: list[int], seq_lens: list[int],
                 block_size: int, hkv: int, group: int, d: int, dtype: torch.dtype):
    """(q [N, Hq, D], k_cache, v_cache, query_start_loc, seq_lens, block_table) for these
    requests, N = sum(query_lens) + 0..3 padding tokens. Blocks are scattered at random in
    the cache; unallocated table entries hold -1 or 0 (read by the torch gather when its
    bound runs past a request, masked out)."""

    def rand(high, size=()):
        return torch.randint(0, high, size, generator=g)

    num_reqs = len(seq_lens)
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


# requests as (cached prefix, chunk) lengths; chunk 0 = a padding request (seq_len 1)
REQUESTS = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 4)), min_size=1, max_size=3)
WINDOWS = st.none() | st.integers(1, 30)  # up to past every sequence (<= 24 keys)
SCALES = st.none() | st.floats(0.05, 2.0)


def drawn_layout(requests, seed, block_size, hkv, group, d, dtype):
    """``paged_layout`` for hypothesis-drawn (cached, chunk) requests."""
    query_lens = [chunk for _, chunk in requests]
    seq_lens = [cached + chunk if chunk else 1 for cached, chunk in requests]
    return paged_layout(torch.Generator().manual_seed(seed), query_lens, seq_lens, block_size,
                        hkv, group, d, dtype)


def dense_attention(q, k_cache, v_cache, qsl, seq_lens, table, block_size, window, scale):
    """[T, Hq, D] float64 for the T = qsl[-1] real tokens: per request, all its keys in
    position order, a [chunk, seq_len] causal mask (``q_pos - window < j <= q_pos``), plain
    softmax."""
    hq, d = q.shape[1:]
    group = hq // k_cache.shape[1]
    scale = d ** -0.5 if scale is None else scale
    outs = []
    for r, s in enumerate(seq_lens.tolist()):
        start, end = int(qsl[r]), int(qsl[r + 1])
        pos = torch.arange(s)
        slots = table[r, pos // block_size].long() * block_size + pos % block_size
        k, v = (c[slots].double().repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
        q_pos = torch.arange(s - (end - start), s)[:, None]
        mask = pos <= q_pos
        if window is not None:
            mask &= pos > q_pos - window
        scores = torch.einsum("thd,shd->hts", q[start:end].double(), k) * scale
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hts,shd->thd", weights, v))
    return torch.cat(outs)


def own_values(v_cache, qsl, seq_lens, table, block_size, n, group):
    """[N, Hq, D]: each token's own value (position seq_len - (q_end - i); padding tokens
    take the last request's last position)."""
    rows = []
    for i in range(n):
        r = min(int((qsl[1:] <= i).sum()), len(seq_lens) - 1)
        pos = int(seq_lens[r]) - max(int(qsl[r + 1]) - i, 1)
        rows.append(v_cache[int(table[r, pos // block_size]) * block_size + pos % block_size])
    return torch.stack(rows).repeat_interleave(group, dim=1)


def both_paths(q, k_cache, v_cache, qsl, seq_lens, table, block_size, **kwargs):
    """(torch path, interpreted Triton) outputs, the torch gather bound = max(seq_lens)."""
    n, bound = q.shape[0], int(seq_lens.max())
    return [impl.paged_attention(q, k_cache, v_cache, impl.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size), **kwargs) for impl in (ref, PA)]


def test_worked_example_plan():
    qsl, seq_lens = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    req = ref.token_requests(qsl, 5)
    assert req.tolist() == [0, 0, 0, 1, 1]
    assert ref.visible_keys(req, qsl, seq_lens).tolist() == [3, 4, 5, 9, 9]
    assert ref.token_requests(torch.tensor([0, 3, 3, 4], dtype=torch.int32), 6).tolist() == [
        0, 0, 0, 2, 2, 2]


@INTERPRETED
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


@FEW
@given(requests=REQUESTS, block_size=st.sampled_from([1, 4, 16]), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 3]), window=WINDOWS, scale=SCALES,
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_torch_path_equals_dense_windowed_attention(requests, block_size, hkv, group, window,
                                                    scale, dtype, seed):
    q, k_cache, v_cache, qsl, seq_lens, table = drawn_layout(requests, seed, block_size, hkv,
                                                             group, 8, dtype)
    n, bound = q.shape[0], int(seq_lens.max()) + 5
    got = ref.paged_attention(q, k_cache, v_cache, ref.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size), sliding_window=window, scale=scale)
    want = dense_attention(q, k_cache, v_cache, qsl, seq_lens, table, block_size, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got[:int(qsl[-1])].double(), want, rtol=tol, atol=tol)


@INTERPRETED
@given(requests=REQUESTS, block_size=st.sampled_from([1, 4, 16]), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 3]), window=WINDOWS, scale=SCALES,
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_triton_kernel_equals_reference_with_window_and_scale(requests, block_size, hkv, group,
                                                              window, scale, dtype, seed):
    layout = drawn_layout(requests, seed, block_size, hkv, group, 8, dtype)
    expected, got = both_paths(*layout, block_size, sliding_window=window, scale=scale)
    assert got.dtype == dtype
    # bfloat16: both compute in float32 from the same inputs, then round (a bf16 ulp or two)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tol, atol=tol)


def test_worked_example_of_the_request_major_plan():
    qsl, seq_lens = torch.tensor([0, 3, 4], dtype=torch.int32), torch.tensor([5, 9], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    p = ref.plan_paged_attention(qsl, seq_lens, table, 5, 9, 8, max_query_len=3)
    assert p.query_rows.tolist() == [0, 1, 2, 3, 4, 4]
    assert p.visible.tolist() == [[3, 4, 5], [9, 9, 9]]
    assert p.out_rows.tolist() == [0, 1, 2, 3, 4]
    assert p.key_slots.shape == (2 * 9,)  # one gather per request, not per token
    # one token per request: token-major; a bound whose rows outnumber twice the tokens:
    # segments of ceil(5 / 2) = 3 tokens in (5 + 2 * 2) // 3 = 3 rows
    assert ref.plan_paged_attention(qsl, seq_lens, table, 5, 9, 8, 1).query_rows is None
    assert ref.plan_paged_attention(qsl, seq_lens, table, 5, 9, 8, 6).key_mask.shape[:2] == (3, 3)


def test_row_shape_examples():
    assert ref.row_shape(64, 16, 4) == (4, 16)
    assert ref.row_shape(47, 16, None) == (3, 26)
    assert ref.row_shape(47, 16, 32) == (3, 26)
    assert ref.row_shape(16, 16, None) == (1, 16)
    assert ref.row_shape(17, 16, None) == (1, 17)  # 16 rows of 2 would save too little


@given(chunks=st.lists(st.integers(0, 40), min_size=1, max_size=20), padding=st.integers(0, 8),
       known=st.booleans(), extra=st.integers(0, 3))
def test_rows_hold_every_request(chunks, padding, known, extra):
    """R rows of T hold every request's tokens (ceil(C / T) rows each), never more rows than
    tokens, and T > 1 only where it saves rows."""
    n = sum(chunks) + padding
    t, rows = ref.row_shape(n, len(chunks), max(chunks) + extra if known else None)
    assert sum(-(-c // t) for c in chunks) <= rows <= n
    assert t == 1 or 4 * rows <= 3 * n or len(chunks) * t <= 2 * n


LAYOUT_REQUESTS = st.lists(st.tuples(st.integers(0, 20), st.integers(0, 12)), min_size=1,
                           max_size=6)


@FEW
@given(requests=LAYOUT_REQUESTS, known=st.booleans(), extra=st.integers(0, 2),
       block_size=st.sampled_from([1, 4, 16]), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 3]), window=WINDOWS, scale=SCALES,
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_query_rows_equal_dense_and_token_major(requests, known, extra, block_size, hkv, group,
                                                window, scale, dtype, seed):
    """Whatever rows the plan picks (with or without a host bound on tokens per request):
    the outputs of dense attention and of the token-major layout (padding tokens: finite)."""
    q, k_cache, v_cache, qsl, seq_lens, table = drawn_layout(requests, seed, block_size, hkv,
                                                             group, 8, dtype)
    n, bound = q.shape[0], int(seq_lens.max()) + 3
    t = max(chunk for _, chunk in requests) + extra if known else None
    p = ref.plan_paged_attention(qsl, seq_lens, table, n, bound, block_size, max_query_len=t)
    assert tuple(p.key_mask.shape[:2]) == ref.row_shape(n, len(requests), t)[::-1]  # (R, T)
    got = ref.paged_attention(q, k_cache, v_cache, p, sliding_window=window, scale=scale)
    token_major = ref.paged_attention(q, k_cache, v_cache, ref.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size, max_query_len=1), sliding_window=window,
        scale=scale)
    want = dense_attention(q, k_cache, v_cache, qsl, seq_lens, table, block_size, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    real = int(qsl[-1])
    torch.testing.assert_close(got[:real].double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got[:real], token_major[:real], rtol=tol, atol=tol)
    assert got.isfinite().all()


@FEW
@given(requests=LAYOUT_REQUESTS.filter(lambda r: len(r) > 1), data=st.data(),
       block_size=st.sampled_from([1, 4, 16]),
       hkv=st.integers(1, 2), group=st.sampled_from([1, 3]), window=WINDOWS, scale=SCALES,
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**16))
def test_a_split_plan_equals_one_plan_and_dense(requests, data, block_size, hkv, group, window,
                                                scale, dtype, seed):
    """The requests cut in two groups anywhere (``QuerySplit``: the head's requests and
    tokens, a bound on its requests' tokens), each laid out in its own rows: the outputs of
    one plan over all and of dense attention, through the layers' kept masks too."""
    q, k_cache, v_cache, qsl, seq_lens, table = drawn_layout(requests, seed, block_size, hkv,
                                                             group, 8, dtype)
    n, bound = q.shape[0], int(seq_lens.max()) + 3
    head = data.draw(st.integers(1, len(requests) - 1), label="head requests")
    t = max(chunk for _, chunk in requests)
    split = ref.QuerySplit(head, int(qsl[head]), max([chunk for _, chunk in requests[:head]],
                                                     default=0) + data.draw(st.integers(0, 2)))
    kw = dict(sliding_window=window, scale=scale)
    p = ref.plan_paged_attention(qsl, seq_lens, table, n, bound, block_size, t, split=split)
    assert isinstance(p, ref.SplitPlan) and p.num_tokens == split.num_tokens
    got = ref.paged_attention(q, k_cache, v_cache, p, **kw)
    kept = ref.paged_attention(q, k_cache, v_cache, p, bias=ref.attention_bias(
        p, group, window, q.dtype), **kw)
    one = ref.paged_attention(q, k_cache, v_cache, ref.plan_paged_attention(
        qsl, seq_lens, table, n, bound, block_size, t), **kw)
    want = dense_attention(q, k_cache, v_cache, qsl, seq_lens, table, block_size, window, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    real = int(qsl[-1])
    assert got.shape == one.shape
    torch.testing.assert_close(got[:real].double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got[:real], one[:real], rtol=tol, atol=tol)
    torch.testing.assert_close(kept, got, rtol=0, atol=0)
    assert got.isfinite().all()


def small_layout(seed: int, dtype: torch.dtype):
    """A 3-token chunk after 5 cached keys, a padding request, one decode token after 20."""
    return paged_layout(torch.Generator().manual_seed(seed), [3, 0, 1], [8, 1, 21], 4, 1, 2, 8,
                        dtype)


@pytest.mark.parametrize("seed", range(2))
def test_window_past_every_sequence_is_no_window(seed):
    """W >= the longest sequence (21 keys) keeps every key: bit for bit the full result."""
    layout = small_layout(seed, torch.float32)
    full = both_paths(*layout, 4)
    for window in (21, 1000):
        for windowed, want in zip(both_paths(*layout, 4, sliding_window=window), full):
            assert torch.equal(windowed, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(2))
def test_window_of_one_is_the_tokens_own_value(seed, dtype):
    q, k_cache, v_cache, qsl, seq_lens, table = small_layout(seed, dtype)
    want = own_values(v_cache, qsl, seq_lens, table, 4, q.shape[0], 2)
    for got in both_paths(q, k_cache, v_cache, qsl, seq_lens, table, 4, sliding_window=1):
        assert torch.equal(got, want)


@pytest.mark.parametrize("window", [0, -1, 2.5, True])
@pytest.mark.parametrize("impl", [ref, PA, kernels], ids=["torch", "triton", "dispatch"])
def test_bad_sliding_window_is_rejected(impl, window):
    q, k_cache, v_cache, qsl, seq_lens, table = small_layout(0, torch.float32)
    p = impl.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 50, 4)
    with pytest.raises(ValueError, match="sliding_window"):
        impl.paged_attention(q, k_cache, v_cache, p, sliding_window=window)


def test_one_compiled_kernel_for_every_window_and_scale():
    """The window is a runtime argument: triton's default specialization (== 1, % 16 == 0)
    would compile None (0), 1, 16 and 17 apart; the kernel opts out."""
    layout = small_layout(0, torch.float32)
    launches = [(None, None), (1, 0.3), (16, None), (17, 2.0)]
    calls = launch_args(PA._paged_attention_kernel, lambda c: both_paths(
        *layout, 4, sliding_window=c[0], scale=c[1]), launches)
    assert len(set(compile_cache_keys(PA._paged_attention_kernel, calls))) == 1
    assert len(set(compile_cache_keys(PA._paged_attention_kernel, calls,
                                      do_not_specialize=None))) > 1
