"""Issue 13, item 7: acceptance at temperature > 0 is what speculative sampling predicts.

The drafters are greedy (q is one-hot at the draft d), so the first draft of a verifying step
is accepted with probability p_T(d | context), the target's temperature-T probability of d.
The engine is stepped by hand on the embedded model (EAGLE, K=2); before each step every
decoding request's context and first draft are noted, after it whether the draft was kept
(a rejected draft is never re-emitted: the recovered token is drawn with d removed). The
expectation is computed from the target's logits by a dense forward of each context; the
measured rate must match it within 4 standard errors of the sum of Bernoulli(p) draws.
"""

import math

import pytest
import torch

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams, Status

PROMPTS = ["def fibonacci(n):", "import os\n", "class Node:\n    def __init__(self",
           "for i in range(", "    return self.", "with open(path) as f:", "x = [", "if not "]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 2},
               max_model_len=160, max_num_seqs=8, max_num_batched_tokens=64, seed=3)


def first_draft_trials(llm: LLM, temperature: float):
    """-> (requests, [(request, context, first draft, accepted)] for every verifying step)."""
    params = SamplingParams(max_tokens=48, temperature=temperature, ignore_eos=True)
    reqs = [llm.add_request(p, params) for p in PROMPTS]
    trials = []
    while True:
        pending = [(r, list(r.token_ids), r.spec_token_ids[0]) for r in reqs
                   if r.status == Status.RUNNING and not r.is_prefilling and r.spec_token_ids]
        if llm.step() is None:
            break
        for r, context, draft in pending:
            trials.append((r, context, draft, r.token_ids[len(context)] == draft))
    return reqs, trials


@torch.inference_mode()
def target_probs(llm: LLM, trials, temperature: float) -> list[float]:
    """p_T(draft | context) of every trial, from one dense causal forward of each request's
    final tokens: its row len(context) - 1 sees exactly the context (checked a prefix)."""
    probs = {}
    for r in {id(r): r for r, *_ in trials}.values():
        ids = list(r.token_ids)
        hidden, _ = llm.target(torch.tensor([ids]), torch.arange(len(ids))[None])
        probs[id(r)] = torch.softmax(llm.target.compute_logits(hidden[0]) / temperature, dim=-1)
    out = []
    for r, context, draft, _ in trials:
        assert list(r.token_ids[:len(context)]) == context
        out.append(float(probs[id(r)][len(context) - 1, draft]))
    return out


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_first_position_acceptance_matches_the_target_probability_of_the_draft(llm,
                                                                              temperature):
    reqs, trials = first_draft_trials(llm, temperature)
    assert len(trials) >= 200
    # the engine's first-position counters count exactly these trials
    assert sum(r.num_drafted[0] for r in reqs) == len(trials)
    assert sum(r.num_accepted[0] for r in reqs) == sum(a for *_, a in trials)
    p = target_probs(llm, trials, temperature)
    measured = sum(a for *_, a in trials) / len(trials)
    expected = sum(p) / len(p)
    stderr = math.sqrt(sum(x * (1 - x) for x in p)) / len(p)
    print(f"T={temperature}: {len(trials)} trials, measured {measured:.3f}, "
          f"expected {expected:.3f} +- {stderr:.3f}")
    assert abs(measured - expected) < 4 * stderr, (measured, expected, stderr)
