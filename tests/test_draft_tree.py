"""Static draft trees (``draft_tree.py``): vLLM's ``speculative_token_tree`` paths as
node arrays -- the worked example, a chain, random prefix-closed trees (parents before
children, ancestors = the path's nodes, heads = the nodes with children and their paths over
head rows; ``node_shapes`` from a dynamic tree's parents), and the errors."""

import pytest
import torch
from hypothesis import given, strategies as st

from specdec.draft_tree import MAX_TREE_NODES, StaticTree, node_shapes
from specdec.engine.tree_sampler import tree_rejection_sample


def test_worked_example():
    tree = StaticTree.from_paths("[(0,), (1,), (0, 0)]")
    assert tree.parent == (-1, 0, 0, 1) and tree.depth == (0, 1, 1, 2)
    assert tree.rank == (0, 0, 1, 0) and tree.ancestors == (0b1, 0b11, 0b101, 0b1011)
    assert tree.num_nodes == 4 and tree.max_depth == 2
    assert tree.heads == (0, 1) and tree.head_ancestors == (0b1, 0b11) and tree.head_rows == 1
    assert tree.levels() == (((1, 2), (0,), 2, ((0, 0), (0, 1)), (1,), (0,), 1),
                             ((3,), (1,), 1, ((0, 0),), (), (), 2))


def test_a_chain_is_every_earlier_node_its_ancestor():
    tree = StaticTree.chain(4)
    assert tree.parent == (-1, 0, 1, 2, 3) and tree.rank == (0,) * 5
    assert tree.ancestors == tuple(2 ** (k + 1) - 1 for k in range(5))
    assert tree.heads == (0, 1, 2, 3) and tree.head_ancestors == tree.ancestors[:4]


PATHS = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=1, max_size=20)


@given(PATHS)
def test_random_trees(raw):
    paths = {tuple(p[:i]) for p in raw for i in range(1, len(p) + 1)}  # closed under prefix
    tree = StaticTree.from_paths(sorted(paths, reverse=True))  # any order given
    assert set(tree.paths) == paths and tree.num_nodes == len(paths) + 1
    for k, path in enumerate(tree.paths, start=1):
        up = tree.parent[k]
        assert up < k and tree.depth[k] == len(path) and tree.rank[k] == path[-1]
        assert (tree.paths[up - 1] if up else ()) == path[:-1]
        assert tree.ancestors[k] == tree.ancestors[up] | 1 << k
    assert set(tree.heads) == {u for u in tree.parent if u >= 0}  # the nodes with children
    for i, k in enumerate(tree.heads):  # a head's path over head rows: its ancestors' rows
        rows = {tree.heads.index(a) for a in range(k + 1) if tree.ancestors[k] >> a & 1}
        assert tree.head_ancestors[i] == sum(1 << r for r in rows)
    for lv in tree.levels():  # a depth's parents, each node's place, its heads' rows
        assert [(lv.ups[up], rank) for up, rank in lv.picks] == [
            (tree.parent[k], tree.rank[k]) for k in lv.nodes]
        assert lv.heads == tuple(k for k in lv.nodes if k in tree.heads)
        assert lv.head_parents == tuple(tree.parent[k] for k in lv.heads)
        assert [tree.heads.index(k) for k in lv.heads] == list(
            range(lv.first_row, lv.first_row + len(lv.heads)))



def test_node_shapes_of_parents_given_per_request():
    """A dynamic tree's parents (any tree, parents first): depth and ancestors as the worked
    example's, and as a path's nodes for a deeper one."""
    assert node_shapes([-1, 0, 0, 1]) == ([0, 1, 1, 2], [0b1, 0b11, 0b101, 0b1011])
    assert node_shapes([-1, 0, 1, 1, 3]) == ([0, 1, 2, 2, 3], [1, 3, 7, 11, 27])


def test_greedy_verification_keeps_the_path_the_target_agrees_with():
    """Tree [(0,), (1,), (0, 0), (1, 0)] with tokens 5, 7 at depth 1 and 8, 9 under them;
    the target's argmax is 7 at the root, 9 after 7, then 4: the path (1,), (1, 0) and 4."""
    tree = StaticTree.from_paths([(0,), (1,), (0, 0), (1, 0)])
    tokens = torch.tensor([[0, 5, 7, 8, 9]])
    argmax = [7, 0, 9, 0, 4]  # per node: the root, (0,), (1,), (0, 0), (1, 0)
    probs = torch.nn.functional.one_hot(torch.tensor([argmax]), 10).float()
    v = tree_rejection_sample(probs, tokens, torch.tensor([tree.parent]), torch.zeros(1),
                              torch.zeros(1, dtype=torch.int64),
                              torch.zeros(1, dtype=torch.int64), depth=tree.max_depth)
    assert v.tokens.tolist() == [[7, 9, 4]] and v.path.tolist() == [[2, 4]]


@pytest.mark.parametrize("paths, says", [
    ("[(0,), (", "not a list of tuples"),
    ([], "non-empty list"),
    ([(0,), (0,)], "given twice"),
    ([(0, 1)], "has no parent path (0,)"),
    ([(0,), (-1,)], "child ranks"),
    ([(0,), ()], "child ranks"),
    ([(0,) * d for d in range(1, MAX_TREE_NODES + 1)], "allowed at most 62"),
])
def test_bad_trees_are_refused_naming_the_key(paths, says):
    with pytest.raises(ValueError, match="speculative_token_tree") as e:
        StaticTree.from_paths(paths)
    assert says in str(e.value)
