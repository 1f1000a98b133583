"""A CPU step's decodes and prefill chunks laid out apart in the torch attention
(``QuerySplit``): the runner splits exactly the uncaptured, uncompiled steps that hold both,
the tokens are plain greedy decoding's and a head's drafts (its first pass splits too) are
those of one layout."""

import pytest
import torch

from specdec.engine.runner import ModelRunner
from specdec.engine.sequence import SamplingParams
from specdec.kernels.paged_attention_torch import QuerySplit

from helpers import dense_greedy, make_llm, tiny_head, tiny_target

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.mark.parametrize("method,backend", [(None, "eager"), ("eagle", "eager"),
                                            ("eagle", "replay")])
def test_decodes_beside_a_prompt_are_split_from_it(target, method, backend, monkeypatch):
    """Two requests decode (1 + K tokens each), then a 30-token prompt arrives (budget 16:
    three chunks beside them). Those mixed steps split after the decodes when they run
    eagerly; a step of decodes or of prompts alone and a captured step (replay captures mixed
    steps too) do not. Every request's tokens equal dense greedy decoding."""
    k = 2 if method else 0
    llm = make_llm(target, method, k, True, head=tiny_head(method, target) if method else None,
                   graph_backend=backend)
    splits = []
    prepare = ModelRunner.prepare

    def recorded(self, scheduled, plan):  # the runner's own prepare, its split noted
        batch = prepare(self, scheduled, plan)
        splits.append((batch.query_split, [s.request.is_prefilling for s in scheduled]))
        return batch
    monkeypatch.setattr(ModelRunner, "prepare", recorded)
    first = [llm.add_request(p, GREEDY) for p in ([5, 9, 13], [7, 1])]
    for _ in range(2):
        llm.step()
    late = llm.add_request([(i * 7) % 90 for i in range(30)], GREEDY)
    while llm.core.has_unfinished():
        llm.step()
    mixed = [split for split, prefilling in splits if any(prefilling) and not all(prefilling)]
    want = QuerySplit(2, 2 * (1 + k), 1 + k) if backend == "eager" else None
    assert mixed == [want] * 3
    assert all(split is None for split, prefilling in splits
               if all(prefilling) or not any(prefilling))
    for req in [*first, late]:
        prompt = req.token_ids[:req.num_prompt_tokens]
        assert req.output_token_ids == dense_greedy(target, prompt, 8, 64)


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_a_heads_first_pass_drafts_the_same_split_or_not(target, method):
    """The head's first pass over the target's layout takes the step's split too: every
    draft equals the drafts of an engine whose steps keep one layout."""
    def drafts(split: bool) -> tuple[list, int]:
        llm = make_llm(target, method, 2, True, head=tiny_head(method, target))
        runner, splits = llm.core.runner, []
        prepare = runner.prepare

        def recorded(scheduled, plan):  # the runner's own prepare, its split noted
            batch = prepare(scheduled, plan)
            if not split:
                batch.query_split = None
            splits.append(batch.query_split is not None)
            return batch
        runner.prepare = recorded
        reqs = [llm.add_request(p, GREEDY) for p in ([5, 9, 13], [7, 1])]
        seen = []
        for i in range(60):
            if i == 2:
                reqs.append(llm.add_request([(j * 7) % 90 for j in range(30)], GREEDY))
            if not llm.core.has_unfinished():
                break
            llm.step()
            seen.append([list(r.spec_token_ids) for r in reqs])
        return seen, sum(splits)
    (split_drafts, split_steps), (one_drafts, one_steps) = drafts(True), drafts(False)
    assert split_drafts == one_drafts
    assert split_steps >= 2 and one_steps == 0
