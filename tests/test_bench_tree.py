"""benchmarks/bench_tree.py's fitted static trees: the N most often accepted nodes within a
top-k and depth bound, which form a tree (a parent is accepted whenever its child is); its
default draft model, the embedded model's first layers (benchmarks/layer_skip_draft.py)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.bench_tree import WIDE, fitted
from benchmarks.layer_skip_draft import cut
from specdec.draft_tree import StaticTree
from specdec.engine.llm import DEFAULT_MODEL

from hf_models import hf_model


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


def test_the_layer_skip_draft_is_the_targets_first_layers(tmp_path):
    """The cut folder, read by transformers, gives the logits of the target's first 2 layers
    followed by its final norm and lm_head; a cut as deep as the target is refused."""
    draft = hf_model(cut(DEFAULT_MODEL, tmp_path / "cut", 2))
    target = hf_model(DEFAULT_MODEL)
    target.model.layers = target.model.layers[:2]
    target.config.num_hidden_layers = 2
    ids = torch.tensor([[5, 17, 300, 42, 7, 1999]])
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, target(ids).logits)
    with pytest.raises(ValueError, match=r"--layers=4: allowed 1..3"):
        cut(DEFAULT_MODEL, tmp_path / "deep", 4)
