"""Suffix decoding (``method: "suffix"``): the tree's counts and proposals against brute force
over the token lists, the config keys, and the engine (greedy equal plain decoding, padded
and ragged; a finished request's tokens drafting for the next)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.proposers.suffix import SuffixTree, TokenIndex, index_drafts, tree_drafts

SEQ = st.lists(st.integers(0, 3), min_size=1, max_size=24)


def count(seqs: list[list[int]], s: list[int], depth: int) -> int:
    """Occurrences of ``s`` in the sequences (0 past the tree's depth), by scanning."""
    if len(s) > depth:
        return 0
    return sum(q[i:i + len(s)] == s for q in seqs for i in range(len(q) - len(s) + 1))


def reference(seqs, tokens, k, factor, min_prob, depth, own) -> tuple[float, list[int]]:
    """The module docstring's rule by brute force over ``seqs`` (``tokens`` among them when
    ``own``)."""
    alphabet = sorted({t for q in seqs for t in q})
    best = (0.0, [])
    for m in range(1, min(depth, len(tokens)) + 1):
        cur = tokens[len(tokens) - m:]
        if count(seqs, cur, depth) < 1 + own:
            break
        prob, score, out = 1.0, 0.0, []
        while len(out) < min(k, int(m * factor)):
            counts = {x: count(seqs, cur + [x], depth) for x in alphabet}
            counts = {x: c for x, c in counts.items() if c}
            if not counts:
                break
            x = min(counts, key=lambda t: (-counts[t], t))
            prob *= counts[x] / count(seqs, cur, depth)
            if prob < min_prob:
                break
            score += prob
            out.append(x)
            cur = cur + [x]
        if out and score >= best[0]:
            best = (score, out)
    return best


def tree_of(seqs: list[list[int]], depth: int, chunk: int = 3) -> SuffixTree:
    tree = SuffixTree(depth)
    for key, q in enumerate(seqs):
        for start in range(0, len(q), chunk):  # tokens arrive a few at a time
            tree.extend(key, q[start:start + chunk])
        tree.close(key)
    return tree


@given(st.lists(SEQ, min_size=1, max_size=4), st.integers(1, 6), st.integers(1, 4))
def test_the_tree_counts_every_string_up_to_its_depth(seqs, depth, chunk):
    tree = tree_of(seqs, depth, chunk)
    for q in seqs:
        for i in range(len(q)):
            for j in range(i + 1, min(len(q), i + depth) + 1):
                assert tree.counts[tree.find(q[i:j])] == count(seqs, q[i:j], depth)


@given(st.lists(SEQ, min_size=2, max_size=4), st.integers(1, 6))
def test_removing_a_sequence_leaves_the_counts_of_the_others(seqs, depth):
    tree = tree_of(seqs, depth)
    tree.remove(seqs[0])
    rest = tree_of(seqs[1:], depth)

    def as_dict(tree, node=0):
        return {t: (tree.counts[c], as_dict(tree, c)) for t, c in tree.children[node].items()}
    assert as_dict(tree) == as_dict(rest)
    # the freed nodes are reused: adding the sequence back takes no node more than before
    size = len(tree.counts)
    for start in range(0, len(seqs[0]), 3):
        tree.extend("again", seqs[0][start:start + 3])
    assert as_dict(tree) == as_dict(tree_of(seqs[1:] + seqs[:1], depth))
    assert len(tree.counts) == size


def test_the_garbage_collector_tracks_no_node():
    """A full collection walks every tracked object: the trie keeps ints only, so its nodes
    are none of them, however many tokens it holds."""
    import gc

    import random

    rng = random.Random(0)
    tree = tree_of([[rng.randrange(50) for _ in range(2000)]], 24)
    assert len(tree.counts) > 10_000
    assert not any(gc.is_tracked(c) for c in tree.children)


@given(SEQ, st.lists(SEQ, max_size=3), st.integers(1, 6), st.integers(1, 5),
       st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from([0.0, 0.1, 0.4]))
def test_proposals_equal_the_brute_force_rule(tokens, others, depth, k, factor, min_prob):
    """In the request's own index (its tokens, a match must occur once more; taken a few
    tokens at a time) and in a tree of other sequences."""
    index = TokenIndex()
    for end in range(1, len(tokens) + 1, 3):
        index.extend(tokens[:end])
    index.extend(tokens)
    got = index_drafts(index, depth, k, factor, min_prob)
    want = reference([tokens], tokens, k, factor, min_prob, depth, own=True)
    assert got[1] == want[1] and got[0] == pytest.approx(want[0])
    if others:
        got = tree_drafts(tree_of(others, depth), tokens, k, factor, min_prob)
        want = reference(others, tokens, k, factor, min_prob, depth, own=False)
        assert got[1] == want[1] and got[0] == pytest.approx(want[0])


def test_docstring_example():
    tokens = [1, 2, 3, 1, 2]
    index = TokenIndex()
    index.extend(tokens)
    assert index_drafts(index, 24, 2, 1.0, 0.1) == (1.0, [3, 1])


def test_suffix_keys_default_to_vllms_and_are_checked():
    spec = SpeculativeConfig.from_dict({"method": "suffix"})
    assert (spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth,
            spec.suffix_decoding_max_cached_requests, spec.suffix_decoding_max_spec_factor,
            spec.suffix_decoding_min_token_prob) == (24, 24, 10000, 1.0, 0.1)
    with pytest.raises(ValueError, match=r"suffix_decoding_min_token_prob=1.5: allowed a "
                                         r"number in \[0.0, 1.0\]"):
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_min_token_prob": 1.5})
    with pytest.raises(ValueError, match="suffix_decoding_max_tree_depth=0: allowed an int"):
        SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3,
                                     "suffix_decoding_max_tree_depth": 0})
    with pytest.raises(ValueError, match="^suffix_decoding_max_tree_depth=0: allowed an int"):
        SpeculativeConfig.from_dict({"method": "suffix", "suffix_decoding_max_tree_depth": 0})
    with pytest.raises(ValueError, match="is a key of method='suffix', not method='ngram'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "suffix_decoding_max_spec_factor": 2.0})


PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
           "import os\nimport sys\nimport os\nimport sys\nimport",
           "class Stack:\n    def push(self, x):\n", "x = 1\ny = 2\nx = 1\ny ="]


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
def test_suffix_greedy_equals_plain_and_finished_requests_draft_for_the_next(padded):
    """Greedy suffix decoding gives plain decoding's tokens; the same prompts a second time
    draft from the first round's cached outputs, so more of their drafts are accepted."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LLM(max_num_seqs=4).generate(PROMPTS, params)]
    llm = LLM(speculative_config={"method": "suffix", "num_speculative_tokens": 3,
                                  "disable_padded_drafter_batch": not padded},
              max_num_seqs=4, graph_backend="replay" if padded else "eager",
              check_host_syncs=True)
    accepted = []
    for _ in range(2):
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == plain
        accepted.append(sum(sum(o.num_accepted) for o in outs))
    assert 0 < accepted[0] < accepted[1]
    assert len(llm.core.proposer.cached_order) == 2 * len(PROMPTS) and not llm.core.proposer.own
    # the cached tree holds the outputs alone (vLLM's global tree: responses, no prompts)
    cached = llm.core.proposer.cached  # its 1-token strings count every token it holds
    assert sum(cached.counts[c] for c in cached.children[0].values()) == 2 * sum(
        len(o.token_ids) for o in outs)


@pytest.mark.parametrize("spec, blocks", [
    ({"method": "suffix", "num_speculative_tokens": 8}, 1),
    ({"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 3}, 1),
    ({"method": "eagle3", "num_speculative_tokens": 3}, 2)], ids=["suffix", "ngram", "eagle3"])
def test_host_drafters_reserve_no_draft_rows(spec, blocks):
    """A 16-token prompt's prefill step holds one 16-token KV block with a host drafter (its
    drafts take slots only when a step verifies them); a draft head's loop writes K rows past
    the step, so the step reserves a second block. Fewer reserved blocks evict fewer cached
    prefixes when the pool is full."""
    llm = LLM(speculative_config=spec, max_num_seqs=1, max_model_len=128)
    req = llm.add_request(list(range(1, 17)), SamplingParams(max_tokens=4, ignore_eos=True))
    llm.step()
    assert len(req.block_ids) == blocks
