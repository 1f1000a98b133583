"""``LLM.generate(prompts, SamplingParams(...))`` and a list of them, as vLLM's LLM.generate."""

import pytest

from specdec import LLM
from specdec.engine.sequence import SamplingParams

PROMPTS = [[5, 9, 13], [7, 7, 7, 7], [3, 1]]


@pytest.fixture(scope="module")
def spec_llm(folder):
    return LLM(folder / "target", {"method": "eagle3", "num_speculative_tokens": 2},
               max_model_len=64, max_num_seqs=4)


def tokens(outs):
    return [o.token_ids for o in outs]


def test_positional_sampling_params_equals_the_keyword_form(spec_llm):
    kw = spec_llm.generate(PROMPTS, max_tokens=6, ignore_eos=True)
    pos = spec_llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    named = spec_llm.generate(PROMPTS, sampling_params=SamplingParams(max_tokens=6,
                                                                      ignore_eos=True))
    assert tokens(pos) == tokens(kw) == tokens(named)
    assert all(len(t) == 6 for t in tokens(pos))
    # sampled, with a per-request seed: same tokens either way
    a = spec_llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.8, seed=3))
    b = spec_llm.generate(PROMPTS, max_tokens=5, temperature=0.8, seed=3)
    assert tokens(a) == tokens(b)


def test_a_list_gives_each_prompt_its_own_params(spec_llm):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 5, 3)]
    outs = spec_llm.generate(PROMPTS, params)
    assert [len(o.token_ids) for o in outs] == [2, 5, 3]
    for prompt, p, out in zip(PROMPTS, params, outs):  # each as if generated alone
        assert out.token_ids == spec_llm.generate([prompt], p)[0].token_ids


def test_the_older_int_positional_is_max_tokens(spec_llm):
    assert tokens(spec_llm.generate(PROMPTS, 4, ignore_eos=True)) == tokens(
        spec_llm.generate(PROMPTS, max_tokens=4, ignore_eos=True))


@pytest.mark.parametrize("args,kwargs,exc,match", [
    ((SamplingParams(max_tokens=2),), dict(max_tokens=3), TypeError, "not both"),
    (([SamplingParams()] * 2,), {}, ValueError, "2 entries for 3 prompts"),
    (([SamplingParams(), 4, SamplingParams()],), {}, TypeError, r"sampling_params\[1\]"),
    (("greedy",), {}, TypeError, "sampling_params='greedy'"),
    ((4,), dict(max_tokens=3), TypeError, "max_tokens given twice"),
])
def test_bad_sampling_params_queue_nothing(spec_llm, args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        spec_llm.generate(PROMPTS, *args, **kwargs)
    assert spec_llm.step() is None  # nothing was queued


@pytest.mark.parametrize("field,value,match", [
    ("max_tokens", 0, r"max_tokens=0"), ("temperature", -1.0, r"temperature=-1.0"),
    ("top_p", 0.0, r"top_p=0.0"), ("logprobs", 50, r"logprobs=50"),
    ("stop_token_ids", 7, r"stop_token_ids=7"), ("seed", -2, r"seed=-2")])
def test_a_field_set_after_construction_is_checked_at_submission(spec_llm, field, value,
                                                                 match):
    """SamplingParams is a plain (mutable) dataclass, as vLLM's: generate and add_request check
    every field again, naming where it came from, and queue nothing."""
    params = SamplingParams(max_tokens=3)
    setattr(params, field, value)
    with pytest.raises((TypeError, ValueError), match=r"sampling_params\[1\]\." + match):
        spec_llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=3), params])
    with pytest.raises((TypeError, ValueError), match=r"^params\." + match):
        spec_llm.add_request(PROMPTS[0], params)
    assert spec_llm.step() is None  # nothing was queued


def test_a_request_id_in_use_is_refused_and_the_engines_ids_skip_callers(spec_llm):
    params = SamplingParams(max_tokens=2)
    n = int(spec_llm.add_request(PROMPTS[0], params).request_id)  # the engine's count
    mine = spec_llm.add_request(PROMPTS[1], params, request_id=str(n + 1))
    with pytest.raises(ValueError, match=rf"request_id='{n + 1}' is taken by an unfinished"):
        spec_llm.add_request(PROMPTS[1], params, request_id=str(n + 1))
    assert spec_llm.add_request(PROMPTS[2], params).request_id == str(n + 2)  # skips mine
    while spec_llm.step() is not None:
        pass
    assert len(mine.output_token_ids) == 2  # its tokens were counted under its own id
    assert spec_llm.add_request(PROMPTS[0], params, request_id=str(n + 1)).request_id == \
        str(n + 1)  # free again once finished
    while spec_llm.step() is not None:
        pass


def test_a_queued_request_keeps_the_params_it_was_given(spec_llm):
    """Changing the caller's SamplingParams after add_request changes no queued request."""
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    request = spec_llm.add_request(PROMPTS[0], params)
    params.max_tokens, params.temperature = 9, 0.9
    while spec_llm.step() is not None:
        pass
    assert request.output_token_ids == spec_llm.generate(
        [PROMPTS[0]], max_tokens=3, ignore_eos=True)[0].token_ids


def test_a_list_under_data_parallel_equals_one_rank_call_after_call(folder):
    """DP runs every prompt with its own params in one engine per rank, under the request ids
    one rank gives them (the engine's running count, call after call): unseeded sampled
    requests -- keyed by their ids -- draw one rank's numbers, and outputs come back in
    prompt order."""
    kw = dict(max_model_len=64, max_num_seqs=4)
    spec = {"method": "eagle3", "num_speculative_tokens": 2}
    one = LLM(folder / "target", spec, **kw)
    dp = LLM(folder / "target", spec, **kw, data_parallel_size=2)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9) for n in (2, 5, 3)]
    for _ in range(2):  # the second call: new ids, so new numbers, on both
        got, want = dp.generate(PROMPTS, params), one.generate(PROMPTS, params)
        assert [o.request_id for o in got] == [o.request_id for o in want]
        assert tokens(got) == tokens(want) and [len(t) for t in tokens(got)] == [2, 5, 3]
    assert [o.request_id for o in got] == ["3", "4", "5"]
