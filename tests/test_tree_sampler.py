"""The tree rejection sampler (``engine/tree_sampler.py``): its worked example; a chain as a
tree emits exactly what the chain sampler emits (greedy and sampled, the same random numbers);
the greedy verify is the sampler's greedy rows over random trees;
over a branching tree every emitted token follows the target's distribution (chi-square, with
top-k candidates and with siblings drawn from a draft distribution); no host sync."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from specdec.engine.rejection_sampler import rejection_sample, target_probs
from specdec.engine.tree_sampler import tree_greedy_verify, tree_rejection_sample
from specdec.syncs import forbid_host_sync

from test_rejection_sampler import P_MIN, chi_square_pvalue, rng


def test_worked_example():
    probs = torch.nn.functional.one_hot(torch.tensor([[2, 1, 3, 0]]), 4).float()
    v = tree_rejection_sample(probs, torch.tensor([[0, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 1]]),
                              torch.zeros(1), *rng(1), depth=2)
    assert v.tokens.tolist() == [[2, 3, -1]] and v.path.tolist() == [[2, -1]]
    assert v.num_accepted.tolist() == [1]
    g = tree_greedy_verify(probs, torch.tensor([[0, 1, 2, 3]]), torch.tensor([[-1, 0, 0, 1]]),
                           depth=2)
    assert g.tokens.tolist() == [[2, 3, -1]] and g.path.tolist() == [[2, -1]]


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 6), n=st.integers(1, 9), vocab=st.integers(2, 5), data=st.data(),
       seed=st.integers(0, 2**16))
def test_greedy_verify_is_the_samplers_greedy_rows(b, n, vocab, data, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, n, vocab, generator=g)
    parents = torch.tensor([[-1] + [data.draw(st.integers(-1, k - 1)) for k in range(1, n)]
                            for _ in range(b)])
    # a node's token: often its parent's argmax (accepted), else any id, -1 or past V
    hit = logits.argmax(dim=-1).gather(1, parents.clamp(min=0))
    tokens = torch.where(torch.rand(b, n, generator=g) < 0.6, hit,
                         torch.randint(-1, vocab + 1, (b, n), generator=g))
    depth = max(1, n - 1)
    want = tree_rejection_sample(logits.softmax(dim=-1), tokens, parents, torch.zeros(b),
                                 *rng(b, seed), depth=depth)
    got = tree_greedy_verify(logits, tokens, parents, depth)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.path, want.path)
    assert torch.equal(got.num_accepted, want.num_accepted)


@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 6), k=st.integers(1, 4), vocab=st.integers(2, 8),
       data=st.data(), seed=st.integers(0, 2**16))
def test_a_chain_is_the_chain_sampler(b, k, vocab, data, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, vocab, generator=g) * 2
    drafts = torch.randint(0, vocab, (b, k), generator=g)
    num_draft = torch.tensor(data.draw(st.lists(st.integers(0, k), min_size=b, max_size=b)))
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.7, 1.0]),
                                                  min_size=b, max_size=b)))
    keys, counters = rng(b, seed)
    chain = rejection_sample(logits, drafts, num_draft, temperature, keys, counters)
    greedy = temperature < 1e-5
    probs = target_probs(logits.float(), torch.where(greedy, 1.0, temperature))
    nodes = torch.arange(k + 1)
    parents = torch.where(nodes[None] <= num_draft[:, None], nodes[None] - 1, -1)
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.int64), drafts], dim=1)
    tree = tree_rejection_sample(probs, tokens, parents, temperature, keys, counters, depth=k)
    assert torch.equal(tree.tokens, chain)


N = 20_000
VOCAB = 6
# root 0 with candidates 1, 2, 3; node 1 with candidates 4, 5 (tokens below)
PARENTS = [-1, 0, 0, 0, 1, 1]
TOKENS = [0, 4, 0, 2, 1, 3]
P = torch.softmax(torch.tensor([[1.0, 0.5, -0.3, 0.2, 1.2, -1.0],
                                [0.0, 1.5, 0.3, -0.5, 0.8, 0.1],
                                [0.4, -0.2, 1.1, 0.0, 0.3, 0.9],
                                [0.2, 0.2, 0.2, 0.9, -0.4, 0.0],
                                [1.1, -0.6, 0.0, 0.5, 0.2, 0.3],
                                [-0.2, 0.7, 0.1, 0.0, 0.4, 1.0]]).double() / 0.8, dim=-1)


def sampled_tree(tokens: torch.Tensor, parents: list[int], draft_probs=None):
    probs = P[:len(parents)].float()
    return tree_rejection_sample(probs.expand(N, *probs.shape), tokens,
                                 torch.tensor(parents).expand(N, len(parents)),
                                 torch.full((N,), 0.8), *rng(N, 3), depth=2,
                                 draft_probs=draft_probs)


def test_top_k_candidates_keep_the_target_distribution():
    """Three candidates at the root, two under the first: the first token follows P[0]; given
    it is node 1's token (node 1 accepted), the second follows P[1]."""
    v = sampled_tree(torch.tensor(TOKENS).expand(N, len(TOKENS)), PARENTS)
    assert chi_square_pvalue(v.tokens[:, 0], P[0]) > P_MIN
    first = v.tokens[:, 0] == TOKENS[1]
    assert first.sum() > N * 0.1 and (v.path[first, 0] == 1).all()
    assert chi_square_pvalue(v.tokens[first, 1], P[1]) > P_MIN
    assert (v.tokens[~first, 2] == -1).all()  # only node 1 has children: depth 2 needs it


def test_siblings_drawn_from_a_draft_distribution_keep_the_target_distribution():
    """Each request's three root candidates drawn independently from q (repeats possible):
    with q's probabilities the first token follows P[0], and the first candidate is accepted
    at speculative sampling's rate sum_x min(p(x), q(x)) (one-hot candidates would be
    accepted at sum_x q(x) p(x))."""
    q = torch.softmax(torch.tensor([0.3, 1.0, -0.5, 0.0, 0.8, 0.2]), dim=-1)
    g = torch.Generator().manual_seed(7)
    drawn = torch.multinomial(q, N * 3, replacement=True, generator=g).view(N, 3)
    tokens = torch.cat([torch.zeros(N, 1, dtype=torch.int64), drawn], dim=1)
    draft_probs = q.expand(N, 4, VOCAB)
    v = sampled_tree(tokens, [-1, 0, 0, 0], draft_probs)
    assert chi_square_pvalue(v.tokens[:, 0], P[0]) > P_MIN
    rate = float(torch.minimum(P[0], q.double()).sum())
    assert abs(float((v.path[:, 0] == 1).double().mean()) - rate) < 4 * (rate / N) ** 0.5
    assert abs(rate - float((P[0] * q.double()).sum())) > 0.1  # the two rates differ


def test_no_host_sync():
    args = (P.float().expand(8, *P.shape), torch.tensor(TOKENS).expand(8, len(TOKENS)),
            torch.tensor(PARENTS).expand(8, len(PARENTS)), torch.tensor([0.0, 0.8] * 4),
            *rng(8))
    with forbid_host_sync():
        v = tree_rejection_sample(*args, depth=2)
        g = tree_greedy_verify(*args[:3], depth=2)
    assert ((v.tokens >= 0).sum(dim=1) == v.num_accepted + 1).all()
    assert ((g.tokens >= 0).sum(dim=1) == g.num_accepted + 1).all()
