"""N-gram drafting (``method: "ngram"``): vLLM's lookup rule against a plain-Python reference,
the config keys, and the engine: 0..K drafts per request in one padded (uniform, captured)
step, greedy output equal to plain decoding, padded equal to ragged when sampling."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.proposers.ngram import ngram_drafts

K = 3


def reference_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule, brute force: the longest n in [min_n, max_n] whose suffix also occurs
    ending before the last token; its earliest occurrence; the k tokens after it."""
    for n in range(max_n, min_n - 1, -1):
        for i in range(len(tokens) - n):
            if tokens[i:i + n] == tokens[len(tokens) - n:]:
                return tokens[i + n:i + n + k]
    return []


@given(st.lists(st.integers(0, 3), max_size=40), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 5))
def test_ngram_drafts_equal_the_reference(tokens, min_n, extra, k):
    """Small alphabets, so matches of every length occur, overlapping ones included."""
    got = ngram_drafts(np.asarray(tokens, dtype=np.int64), min_n, min_n + extra, k)
    assert got == reference_drafts(tokens, min_n, min_n + extra, k)


@pytest.mark.parametrize("tokens,min_n,max_n,k,drafts", [
    ([1, 2, 3, 4, 1, 2, 3], 1, 3, 2, [4, 1]),  # [1, 2, 3] occurred at 0
    ([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, 2, [5, 1]),  # the earliest occurrence, not the latest
    ([1, 2, 3, 4, 2, 3], 2, 3, 4, [4, 2, 3]),  # fewer than k: the tokens end
    ([1, 1, 1, 1], 1, 3, 3, [1]),  # the longest match wins though it leaves one token
    ([1, 1, 1, 1], 1, 2, 3, [1, 1]),
    ([5, 6, 7], 1, 3, 3, []),  # no match
    ([5], 1, 1, 3, []),
])
def test_ngram_drafts_worked_examples(tokens, min_n, max_n, k, drafts):
    assert ngram_drafts(np.asarray(tokens, dtype=np.int64), min_n, max_n, k) == drafts


@pytest.mark.parametrize("given_keys,expected", [
    ({}, (5, 5)), ({"prompt_lookup_max": 3}, (3, 3)), ({"prompt_lookup_min": 2}, (2, 2)),
    ({"prompt_lookup_min": 1, "prompt_lookup_max": 4}, (1, 4))])
def test_prompt_lookup_defaults_follow_vllm(given_keys, expected):
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3,
                                        **given_keys})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == expected


@pytest.mark.parametrize("bad,match", [
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
    ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min=0: allowed an int >= 1"),
    ({"method": "ngram", "prompt_lookup_max": "3"}, "prompt_lookup_max='3': allowed an int"),
    ({"method": "eagle3", "prompt_lookup_max": 3}, "prompt_lookup_max=3 is a key of "
                                                   "method='ngram', not method='eagle3'")])
def test_bad_prompt_lookup_is_refused_naming_the_key(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"num_speculative_tokens": 3, **bad})


# ---- the engine ------------------------------------------------------------------------------
# code that repeats itself (the ngram's workload) and code that does not
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(",
           "import os\nimport sys\nimport os\nimport sys\nimport",
           "for i in range(10):\n    print(i)\nfor i in range(10):\n",
           "class Stack:\n    def push(self, x):\n", "x = 1\ny = 2\nx = 1\ny =",
           "def f(n):\n    if n < 2:\n        return n\n", "a = [1, 2, 3]\nb = [1, 2, 3]\nc = [",
           "print('hello')\nprint('hello')\nprint("]
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def plain_tokens():
    llm = LLM(max_num_seqs=8)
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24,
                                                                      ignore_eos=True))]


def record_steps(llm, monkeypatch) -> list[list[tuple[int, int]]]:
    """Filled per step of ``llm``: ([(drafts, filler) of each request it ran], whether the
    step was planned a uniform decode: captured by a capturing backend)."""
    steps, execute = [], llm.runner.execute

    def recording(batch):
        steps.append(([(len(s.spec_token_ids), s.num_filler) for s in llm.scheduler.scheduled],
                      batch.plan.uniform_decode))
        return execute(batch)
    monkeypatch.setattr(llm.runner, "execute", recording)
    return steps


@pytest.mark.parametrize("backend", ["eager", "replay"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
@pytest.mark.parametrize("conc", [1, 8])
def test_ngram_greedy_output_equals_plain_decoding(plain_tokens, monkeypatch, conc, padded,
                                                   backend):
    """Greedy ngram gives plain decoding's tokens. Padded with a capturing backend (replay),
    each decode feeds 1 + K tokens whatever its draft count (filler after 0..K drafts), so
    with several requests a step holds requests of different counts, 0 included, and stays
    uniform and captured; eager steps (padded or ragged) feed 1 + drafts, no filler. Drafts
    were proposed and accepted."""
    llm = LLM(speculative_config={**NGRAM, "disable_padded_drafter_batch": not padded},
              max_num_seqs=conc, graph_backend=backend if padded else "eager",
              check_host_syncs=True)
    steps = record_steps(llm, monkeypatch)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain_tokens
    assert sum(sum(o.num_accepted) for o in outs) > 0
    decodes = [(reqs, uniform) for reqs, uniform in steps if all(d + f for d, f in reqs)]
    if padded and backend == "replay":
        assert decodes and all(d + f == K for reqs, _ in decodes for d, f in reqs)
        assert all(uniform for _, uniform in decodes)
        assert all(s.captured for s, (reqs, _) in zip(llm.steps, steps, strict=True)
                   if all(d + f for d, f in reqs))
        if conc > 1:  # a step with no drafts for one request and drafts for another
            counts = [{d for d, _ in reqs} for reqs, _ in decodes]
            assert any(0 in ds and max(ds) > 0 for ds in counts)
    else:
        assert all(f == 0 for reqs, _ in steps for _, f in reqs)


def test_sampled_ngram_padded_equals_ragged():
    """Sampled requests (T 0.8, seeded): the padded step (filler after each request's drafts)
    draws the same tokens as the ragged one, whose requests feed only their drafts: the
    random numbers follow each token's position, not the fed count."""
    params = [SamplingParams(max_tokens=20, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    out = {}
    for padded in (True, False):
        llm = LLM(speculative_config={**NGRAM, "disable_padded_drafter_batch": not padded},
                  max_num_seqs=8)
        out[padded] = [(o.token_ids, o.num_drafted, o.num_accepted)
                       for o in llm.generate(PROMPTS, params)]
    assert out[True] == out[False]
    assert sum(sum(acc) for _, _, acc in out[True]) > 0
