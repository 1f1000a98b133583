"""A request's own seed (``SamplingParams.seed``): its sampled tokens depend on that seed
only, not on the requests around it, the engine's seed, or how its prompt was chunked."""

import pytest
import torch

from specdec.engine.rejection_sampler import rejection_sample
from specdec.engine.sequence import SamplingParams
from helpers import PROMPTS, make_llm, tiny_head, tiny_target

LONG = PROMPTS[1]  # 40 tokens: prefilled in 16-token chunks alone, in others among PROMPTS


def sample(method, padded, engine_seed, prompts, seed, **kw):
    target = tiny_target()
    head = tiny_head(method, target) if method else None
    llm = make_llm(target, method, 3, padded, head, seed=engine_seed, **kw)
    return [o.token_ids for o in llm.generate(prompts, max_tokens=24, temperature=1.0,
                                              seed=seed)]


@pytest.mark.parametrize("method,padded", [(None, True), ("mtp", True), ("eagle3", False)])
def test_a_seeded_request_ignores_the_batch_and_the_engine_seed(method, padded):
    [alone] = sample(method, padded, 1, [LONG], seed=7)
    crowd = sample(method, padded, 2, PROMPTS, seed=7, max_num_batched_tokens=32)
    assert crowd[1] == alone
    [other_seed] = sample(method, padded, 1, [LONG], seed=8)
    assert other_seed != alone
    # control: without a request seed the engine's shared stream decides
    assert sample(method, padded, 1, [LONG], None) != sample(method, padded, 2, [LONG], None)


def test_a_row_draws_from_its_own_key_and_position():
    """Row 2's sample depends on its key and counter only: the same in any sub-batch and
    beside any other keys; another key gives another sample."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 6, 3, 40
    logits = torch.randn(b, k + 1, v, generator=g)
    drafts = torch.randint(0, v, (b, k), generator=g, dtype=torch.int32)
    num_draft = torch.full((b,), k, dtype=torch.int32)
    ones, counters = torch.ones(b), torch.full((b,), 11, dtype=torch.int64)

    def row_2(others: int, own: int, rows=slice(None)):
        keys = torch.full((b,), others, dtype=torch.int64)
        keys[2] = own
        sel = range(b)[rows]
        out = rejection_sample(logits[rows], drafts[rows], num_draft[rows], ones[rows],
                               keys[rows], counters[rows])
        return out[sel.index(2)].tolist()

    outs = {key: row_2(0, key) for key in range(12)}
    assert all(row_2(s, key, rows) == out for key, out in outs.items()
               for s, rows in ((1, slice(None)), (5, slice(2, 3)), (9, slice(1, 5))))
    assert len({tuple(o) for o in outs.values()}) > 1  # the own key does decide


def test_seed_is_checked():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed=1.5)
