"""Draft-tree attention (issue 53's verification mask): a step whose requests end in draft
trees -- each node sees its request's prefix and its ancestors, its sliding window ending at
its depth's position -- equals dense attention over exactly those keys, on the torch path
whatever query rows the plan picks and in the Triton kernel (interpreted); a chain written as
a tree equals today's causal mask."""

import torch
from hypothesis import given, settings, strategies as st

from specdec.kernels import paged_attention_torch as ref

from test_paged_attention import PA, paged_layout
from triton_interpret import load_interpreted

# a request: (cached prefix, tree parents) -- parents[k] < k, node 0 the root (parent -1) --
# or (prefix, chunk length) for a plain causal chunk
TREES = st.integers(1, 8).flatmap(lambda n: st.tuples(*(
    [st.just(-1)] + [st.integers(0, k - 1) for k in range(1, n)])))
REQUESTS = st.lists(st.tuples(st.integers(0, 20), TREES | st.integers(1, 6)), min_size=1,
                    max_size=4)


def tree_of(parents) -> tuple[list[int], list[int]]:
    """(depth, ancestors bitmask incl. itself) of each node."""
    depth, ancestors = [], []
    for k, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        ancestors.append((1 << k) | (0 if p < 0 else ancestors[p]))
    return depth, ancestors


def step(requests, n: int):
    """The TreeMask of N tokens and, per request, (prefix, the keys each query sees as
    (key index, position)) for the dense reference."""
    node, depth, anc, seen = [], [], [], []
    for prefix, shape in requests:
        if isinstance(shape, tuple):
            d, a = tree_of(shape)
            node += range(len(shape)); depth += d; anc += a
            seen.append([[(j, j) for j in range(prefix)]
                         + [(prefix + m, prefix + d[m]) for m in range(len(shape)) if a[k] >> m & 1]
                         for k in range(len(shape))])
        else:
            node += [0] * shape; depth += [0] * shape; anc += [1] * shape
            seen.append([[(j, j) for j in range(prefix + i + 1)] for i in range(shape)])
    pad = n - len(node)
    node += [0] * pad; depth += [0] * pad; anc += [1] * pad
    mask = ref.TreeMask(*(torch.tensor(x, dtype=torch.int64) for x in (node, depth, anc)))
    return mask, seen


def dense(q, k_cache, v_cache, table, block_size, requests, seen, window):
    """[T, Hq, D] float64: each real token attends to exactly its keys (a window keeps keys of
    position > its own position - window)."""
    group = q.shape[1] // k_cache.shape[1]
    outs, i = [], 0
    for r, ((prefix, _), keys) in enumerate(zip(requests, seen)):
        for own in keys:
            pos = own[-1][1]  # its own key comes last (ancestors in node order)
            kept = [j for j, p in own if window is None or p > pos - window]
            slots = torch.tensor([int(table[r, j // block_size]) * block_size + j % block_size
                                  for j in kept])
            k, v = (c[slots].double().repeat_interleave(group, dim=1) for c in (k_cache, v_cache))
            w = (torch.einsum("hd,shd->hs", q[i].double(), k) * q.shape[-1] ** -0.5).softmax(-1)
            outs.append(torch.einsum("hs,shd->hd", w, v))
            i += 1
    return torch.stack(outs)


@settings(max_examples=40, deadline=None)
@given(requests=REQUESTS, block_size=st.sampled_from([1, 4, 16]), hkv=st.integers(1, 2),
       group=st.sampled_from([1, 3]), window=st.none() | st.integers(9, 30),
       rows=st.sampled_from(["token-major", "known", "unknown"]), seed=st.integers(0, 2**16))
def test_tree_nodes_see_their_prefix_and_ancestors(requests, block_size, hkv, group, window,
                                                   rows, seed):
    """Windows are longer than any tree is deep (8 nodes: depth <= 7), so every ancestor is
    inside its node's window."""
    query_lens = [len(s) if isinstance(s, tuple) else s for _, s in requests]
    seq_lens = [prefix + c for (prefix, _), c in zip(requests, query_lens)]
    q, k_cache, v_cache, qsl, seq, table = paged_layout(
        torch.Generator().manual_seed(seed), query_lens, seq_lens, block_size, hkv, group, 8,
        torch.float64)
    n = q.shape[0]
    tree, seen = step(requests, n)
    bound = {"token-major": 1, "known": max(query_lens), "unknown": None}[rows]
    p = ref.plan_paged_attention(qsl, seq, table, n, int(seq.max()), block_size,
                                 max_query_len=bound, tree=tree)
    got = ref.paged_attention(q, k_cache, v_cache, p, sliding_window=window)
    want = dense(q, k_cache, v_cache, table, block_size, requests, seen, window)
    torch.testing.assert_close(got[:sum(query_lens)], want, rtol=1e-12, atol=1e-12)
    assert got.isfinite().all()


@settings(max_examples=4, deadline=None)  # the interpreter: ~2.5 s an example
@given(requests=REQUESTS, block_size=st.sampled_from([1, 4]), group=st.sampled_from([1, 3]),
       window=st.none() | st.integers(9, 30), seed=st.integers(0, 2**16))
def test_triton_kernel_equals_the_torch_path_on_trees(requests, block_size, group, window, seed):
    query_lens = [len(s) if isinstance(s, tuple) else s for _, s in requests]
    seq_lens = [prefix + c for (prefix, _), c in zip(requests, query_lens)]
    q, k_cache, v_cache, qsl, seq, table = paged_layout(
        torch.Generator().manual_seed(seed), query_lens, seq_lens, block_size, 2, group, 8,
        torch.float32)
    n = q.shape[0]
    tree, _ = step(requests, n)
    want, got = (impl.paged_attention(q, k_cache, v_cache, impl.plan_paged_attention(
        qsl, seq, table, n, int(seq.max()), block_size, tree=tree), sliding_window=window)
        for impl in (ref, PA))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@settings(max_examples=3, deadline=None)
@given(requests=REQUESTS, block_size=st.sampled_from([1, 4]), seed=st.integers(0, 2**16))
def test_mla_paths_on_trees(requests, block_size, seed):
    """The latent (MLA) paths read the same tree plan: the torch one equals GQA attention over
    the same rows as keys and values (one kv head, its value the whole row), the Triton kernel
    (interpreted) the torch one."""
    from specdec.kernels import mla_attention_torch
    query_lens = [len(s) if isinstance(s, tuple) else s for _, s in requests]
    seq_lens = [prefix + c for (prefix, _), c in zip(requests, query_lens)]
    q, cache, _, qsl, seq, table = paged_layout(
        torch.Generator().manual_seed(seed), query_lens, seq_lens, block_size, 1, 4, 32,
        torch.float32)
    q, n = q.contiguous(), q.shape[0]
    tree, _ = step(requests, n)
    p = ref.plan_paged_attention(qsl, seq, table, n, int(seq.max()), block_size, tree=tree)
    latent = mla_attention_torch.mla_attention(q, cache, p, value_dim=32, scale=0.2)
    torch.testing.assert_close(latent, ref.paged_attention(q, cache, cache, p, scale=0.2),
                               rtol=1e-5, atol=1e-5)
    mla = load_interpreted("triton_mla_attention")
    got = mla.mla_attention(q, cache, PA.plan_paged_attention(
        qsl, seq, table, n, int(seq.max()), block_size, tree=tree), value_dim=24, scale=0.2)
    torch.testing.assert_close(got, mla_attention_torch.mla_attention(
        q, cache, p, value_dim=24, scale=0.2), rtol=1e-4, atol=1e-4)


def test_a_chain_as_a_tree_is_the_causal_mask():
    """1 + K tokens whose node k has every earlier node as ancestor: the plan without a tree."""
    q, k_cache, v_cache, qsl, seq, table = paged_layout(
        torch.Generator().manual_seed(0), [4, 4], [9, 13], 4, 2, 2, 8, torch.float32)
    chain = ref.TreeMask(*(torch.tensor(x * 2 + [0] * (q.shape[0] - 8)) for x in (
        [0, 1, 2, 3], [0, 1, 2, 3], [1, 3, 7, 15])))
    plain = ref.plan_paged_attention(qsl, seq, table, q.shape[0], 13, 4, max_query_len=4)
    as_tree = ref.plan_paged_attention(qsl, seq, table, q.shape[0], 13, 4, max_query_len=4,
                                       tree=chain)
    assert torch.equal(plain.key_mask, as_tree.key_mask)
    for window in (None, 5):
        assert torch.equal(ref.paged_attention(q, k_cache, v_cache, plain, sliding_window=window),
                           ref.paged_attention(q, k_cache, v_cache, as_tree,
                                               sliding_window=window))


def test_worked_example_of_the_tree_mask():
    """TreeMask's example after a 2-token prefix: b (node 2) sees the prefix, r and itself."""
    tree = ref.TreeMask(torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 1, 2]),
                        torch.tensor([0b1, 0b11, 0b101, 0b1011]))
    qsl, seq = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    p = ref.plan_paged_attention(qsl, seq, torch.tensor([[0, 1]], dtype=torch.int32), 4, 6, 4,
                                 max_query_len=1, tree=tree)
    assert p.key_mask[:, 0].int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0],
                                               [1, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 1]]
    assert p.window_end[:, 0].tolist() == [3, 4, 4, 5]  # positions 2, 3, 3, 4, plus one
