"""Suffix decoding (``method: "suffix"``): the tree's counts and proposals (paths, and trees
with num_draft_tokens) against brute force over the token lists, the config keys, and the
engine (greedy equal plain decoding, padded and ragged, chains and trees; a finished
request's tokens drafting for the next; a tree step accepts its longest path that plain
decoding continues)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.proposers.suffix import (SuffixTree, TokenIndex, index_draft_tree, index_drafts,
                                      tree_draft_tree, tree_drafts)

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


def reference_tree(seqs, tokens, n, max_depth, factor, min_prob, depth, own
                   ) -> tuple[float, list[int], list[int]]:
    """The module docstring's tree rule by brute force over ``seqs``: candidates in a list,
    each string's count by scanning."""
    alphabet = sorted({t for q in seqs for t in q})
    best = (0.0, [], [])
    for m in range(1, min(depth, len(tokens)) + 1):
        root = tokens[len(tokens) - m:]
        if count(seqs, root, depth) < 1 + own:
            break
        deep, found, candidates = min(max_depth, depth - m), [0], []

        def offer(string, prob, parent, level):
            if level >= deep:
                return
            kids = [(x, count(seqs, string + [x], depth)) for x in alphabet]
            for x, c in sorted((kid for kid in kids if kid[1]), key=lambda kid: (-kid[1], kid[0])):
                p = prob * c / count(seqs, string, depth)
                if p >= min_prob:
                    candidates.append((-p, found[0], x, string + [x], parent, level + 1))
                    found[0] += 1

        offer(root, 1.0, 0, 0)
        score, drafts, parents = 0.0, [], []
        while candidates and len(drafts) < min(n, int(m * factor)):
            take = min(candidates)
            candidates.remove(take)
            score -= take[0]
            drafts.append(take[2])
            parents.append(take[4])
            offer(take[3], -take[0], len(drafts), take[5])
        if drafts and score >= best[0]:
            best = (score, drafts, parents)
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


@given(SEQ, st.lists(SEQ, max_size=3), st.integers(1, 6), st.integers(1, 9),
       st.integers(1, 6), st.sampled_from([0.5, 1.0, 3.0]), st.sampled_from([0.0, 0.1, 0.4]))
def test_trees_equal_the_brute_force_rule(tokens, others, depth, n, max_depth, factor,
                                          min_prob):
    """Trees (num_draft_tokens): in the request's own index and in a tree of other
    sequences, equal to brute force; each a tree of at most ``n`` drafts, parents first,
    at most ``max_depth`` deep, siblings distinct."""
    index = TokenIndex()
    for end in range(1, len(tokens) + 1, 3):
        index.extend(tokens[:end])
    index.extend(tokens)
    got = [index_draft_tree(index, depth, n, max_depth, factor, min_prob)]
    want = [reference_tree([tokens], tokens, n, max_depth, factor, min_prob, depth, own=True)]
    if others:
        got.append(tree_draft_tree(tree_of(others, depth), tokens, n, max_depth, factor,
                                   min_prob))
        want.append(reference_tree(others, tokens, n, max_depth, factor, min_prob, depth,
                                   own=False))
    for (score, drafts, parents), (want_score, *want_tree) in zip(got, want):
        assert [drafts, parents] == want_tree and score == pytest.approx(want_score)
        assert len(drafts) <= n and all(0 <= up <= k for k, up in enumerate(parents))
        level = [0]
        for up in parents:
            level.append(level[up] + 1)
        assert max(level) <= max_depth
        siblings = [(up, x) for up, x in zip(parents, drafts)]
        assert len(set(siblings)) == len(siblings)


def test_tree_docstring_example():
    index = TokenIndex()
    index.extend([1, 2, 3, 1, 2, 4, 1, 2])
    assert index_draft_tree(index, 24, 3, 2, 2.0, 0.1) == (1.0, [3, 4, 1], [0, 0, 1])
    assert index_draft_tree(index, 24, 3, 2, 1.0, 0.1) == (2 / 3, [3, 4], [0, 0])


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


def test_a_suffix_tree_decodes_up_to_max_model_len():
    """A request whose trees reach past max_model_len (the proposer and the scheduler keep a
    prefix of the nodes, which is a tree) decodes to the end as plain greedy does."""
    prompt = "import os\nimport sys\n" * 4 + "import"
    limit = len(LLM().tokenizer.encode(prompt)) + 24  # 24 tokens of room: 16 drafts, then fewer
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = LLM(max_model_len=limit).generate([prompt], params)[0]
    llm = LLM(max_model_len=limit, speculative_config={
        "method": "suffix", "num_speculative_tokens": 8, "num_draft_tokens": 17,
        "suffix_decoding_max_spec_factor": 4.0})
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids and len(out.prompt_token_ids + out.token_ids) == limit
    assert sum(out.num_accepted) > 0


def test_a_suffix_tree_takes_num_draft_tokens_alone():
    """num_draft_tokens sizes a suffix tree (depth: K, at most the drafts); a head's tree
    keys, a ragged batch or a bad size are refused by name."""
    tree = SpeculativeConfig.from_dict({"method": "suffix", "num_draft_tokens": 9}).tree
    assert (tree.num_nodes, tree.max_depth, tree.label) == (9, 8, "suffix 8 drafts d8")
    spec = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 3,
                                        "num_draft_tokens": 9})
    assert (spec.tree.max_depth, spec.num_fed_drafts) == (3, 8)
    for extra, match in [
            ({"tree_topk": 2}, r"^tree_topk=2 with method='suffix' \(a suffix tree: its "
                               r"branching follows its counts\); allowed: None"),
            ({"tree_score_temperature": 0.5}, "^tree_score_temperature=0.5 with method='suffix'"),
            ({"speculative_token_tree": [(0,)]}, "^speculative_token_tree=.* with method='suffix'"),
            ({"num_draft_tokens": 1}, r"^num_draft_tokens=1: .* allowed an int in 2 \.\. 63"),
            ({"num_draft_tokens": 64}, r"^num_draft_tokens=64: .* allowed an int in 2 \.\. 63"),
            ({"disable_padded_drafter_batch": True},
             r"^disable_padded_drafter_batch=True with num_draft_tokens .*allowed: False")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict({"method": "suffix", "num_draft_tokens": 9, **extra})
    with pytest.raises(ValueError, match="tree_topk with method='ngram': no tree drafting"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                     "tree_topk": 2, "num_draft_tokens": 4})


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


# prompts whose continuations branch (a repeated line with two endings)
BRANCHING = ["a = b\na = c\na = b\na = c\na = b\na =",
             "import os\nimport sys\nimport re\nimport os\nimport sys\nimport",
             "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor",
             "if x:\n    return True\nif y:\n    return False\nif z:\n    return"]


def walk(tokens: list[int], parents: list[int], truth: list[int]) -> tuple[int, bool]:
    """The depth of the tree's longest path that ``truth`` continues, and whether it passed
    a node that is not its parent's first child."""
    node, depth, aside = 0, 0, False
    while depth < len(truth):
        kids = [k + 1 for k, up in enumerate(parents) if up == node]
        hit = [c for c in kids if tokens[c - 1] == truth[depth]]
        if not hit:
            return depth, aside
        aside |= hit[0] != kids[0]
        node, depth = hit[0], depth + 1
    return depth, aside


@pytest.mark.parametrize("backend", ["eager", "replay"])
def test_a_suffix_tree_equals_plain_and_accepts_its_longest_continued_path(backend):
    """num_draft_tokens: each step verifies a suffix tree (8 drafts, 4 deep; spec factor 4,
    so short matches draft wide trees). Greedy output
    equals plain decoding's, and every step accepted exactly the depth of its tree's longest
    path that plain decoding continues (the tokens a request held at its next proposal):
    the host's parents reached the verifier, branches included. Each token's log-probability
    is plain decoding's: read at the node it was drawn at, not at its row."""
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=1)
    plain_outs = LLM(max_num_seqs=4).generate(BRANCHING, params)
    plain = [o.token_ids for o in plain_outs]
    llm = LLM(speculative_config={"method": "suffix", "num_speculative_tokens": 4,
                                  "num_draft_tokens": 9,
                                  "suffix_decoding_max_spec_factor": 4.0},
              max_num_seqs=4, graph_backend=backend, check_host_syncs=backend == "replay")
    proposals = {}  # request id -> [(tokens held, drafts, parents)] in order
    search = llm.core.proposer.drafts

    def recorded(request_id, token_ids, k):
        out = search(request_id, token_ids, k)
        proposals.setdefault(request_id, []).append(
            (len(token_ids), out[:len(out) // 2], out[len(out) // 2:]))
        return out

    llm.core.proposer.drafts = recorded
    outs = [o for _ in range(2) for o in llm.generate(BRANCHING, params)]
    assert [o.token_ids for o in outs] == plain * 2
    for o, want in zip(outs, plain_outs * 2):
        assert [e.logprob for e in o.logprobs] == pytest.approx(
            [e.logprob for e in want.logprobs], abs=1e-4)
    checked = branched = aside = 0
    for o in outs:
        truth = o.prompt_token_ids + o.token_ids
        steps = proposals[o.request_id]
        for (held, drafts, parents), (held_next, _, _) in zip(steps, steps[1:]):
            assert len(drafts) <= 8 and all(0 <= up <= k for k, up in enumerate(parents))
            depth, passed_aside = walk(drafts, parents, truth[held:])
            assert held_next - held - 1 == depth
            checked += bool(drafts)
            branched += len(set(parents)) < len(parents)
            aside += passed_aside
    assert checked > 20 and branched > 0 and aside > 0


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
