"""benchmarks/bench_tree.py's fitted static trees: the N most often accepted nodes within a
top-k and depth bound, which form a tree (a parent is accepted whenever its child is)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.bench_tree import WIDE, fitted
from specdec.draft_tree import StaticTree


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0.0, 1.0), min_size=len(WIDE), max_size=len(WIDE)),
       st.integers(1, 16), st.sampled_from([2, 4]), st.sampled_from([3, 5]))
def test_fitted_trees_keep_the_most_accepted_nodes(draws, size, top_k, depth):
    # rates as an accept walk gives them: a child's rate is at most its parent's
    rates = {}
    for path, u in zip(WIDE, draws):
        rates[path] = u * rates.get(path[:-1], 1.0)
    tree = fitted(rates, size, top_k, depth)
    StaticTree.from_paths(tree)  # every parent chosen
    allowed = [p for p in WIDE if len(p) <= depth and max(p) < top_k]
    assert len(tree) == min(size, len(allowed))
    assert all(len(p) <= depth and max(p) < top_k for p in tree)
    left = [rates[p] for p in allowed if p not in tree]
    assert not left or min(rates[p] for p in tree) >= max(left)
