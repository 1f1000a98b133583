"""Fuzzing ``LLM`` and ``LLM.generate`` (issue 13): random configs, prompts and sampling params.

Every call either returns complete outputs (one per prompt, a finish reason, max_tokens and
max_model_len honoured, ids in the vocab) or raises ValueError/TypeError naming a field; no
other exception, no hang (a 60 s alarm per call), and the engine is idle and gives the same
greedy reference output afterwards. And features combined at random (methods, trees, the
ragged drafter, prefix caching, packed prefill, async scheduling, captured steps, waves of
arrivals and aborts) give plain greedy's tokens.
"""

import signal
from contextlib import contextmanager

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.engine.llm import DEFAULT_MODEL, LLM
from specdec.engine.sequence import SamplingParams

MAX_MODEL_LEN = 48
VOCAB = 2048  # the embedded model's vocabulary
ENGINES = {  # name -> speculative_config of the shared engines
    "none": None,
    "mtp-padded-k1": {"method": "mtp", "num_speculative_tokens": 1},
    "eagle-ragged-k2": {"method": "eagle", "num_speculative_tokens": 2,
                        "disable_padded_drafter_batch": True},
    "eagle3-padded-k3": {"method": "eagle3", "num_speculative_tokens": 3},
}
GENERATE_FIELDS = ("prompts", "max_tokens", "temperature", "top_p", "ignore_eos",
                   "stop_token_ids")
LLM_FIELDS = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "seed",
              "dtype", "num_speculative_tokens", "method", "disable_padded_drafter_batch",
              "graph_mode", "eagle_aux_hidden_state_layer_ids", "speculative_config",
              "draft_model_config", "capture_sizes", "output_dir")
REFERENCE = [[1, 2, 3]]


@pytest.fixture(scope="module")
def engines():
    """name -> (LLM, its greedy output for REFERENCE), built once for the module."""
    built = {}
    for name, spec in ENGINES.items():
        llm = LLM(speculative_config=spec, max_model_len=MAX_MODEL_LEN, max_num_seqs=4,
                  max_num_batched_tokens=32)
        assert llm.vocab_size == VOCAB
        built[name] = (llm, llm.generate(REFERENCE, max_tokens=4)[0].token_ids)
    return built


@contextmanager
def no_hang(seconds: int = 60):
    def fail(signum, frame):
        raise AssertionError(f"the call ran for more than {seconds} s")

    old = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


token_id = st.one_of(st.integers(0, VOCAB - 1), st.integers(-3, -1),
                     st.integers(VOCAB, VOCAB + 3), st.sampled_from([1.0, 2.5, True, "7", None]))
id_list = st.lists(st.integers(0, VOCAB - 1), min_size=0, max_size=MAX_MODEL_LEN + 4)
one_prompt = st.one_of(st.text(max_size=40), id_list, st.lists(token_id, max_size=6))
prompts = st.one_of(one_prompt, st.lists(one_prompt, max_size=4),
                    st.sampled_from([None, 5, 1.5, b"bytes", {"a": 1}]))
number = st.one_of(st.floats(-1, 3),
                   st.sampled_from([float("nan"), float("inf"), "0.5", None, True, 0, 1]))
sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.one_of(st.integers(-1, 6), st.sampled_from([0, 2.0, "3", True, None])),
    "temperature": number,
    "top_p": number,
    "ignore_eos": st.one_of(st.booleans(), st.sampled_from(["no", 1, None])),
    "stop_token_ids": st.one_of(st.lists(st.integers(-1, VOCAB + 1), max_size=2),
                                st.sampled_from([5, "5", None, [1.5]])),
})


def num_prompts(p) -> int:
    """What a successful call must return: a str or an int list is one prompt."""
    if isinstance(p, str) or (p and all(type(t) is int for t in p)):
        return 1
    return len(p)


def check_complete(llm: LLM, p, kwargs: dict, outs) -> None:
    max_tokens = kwargs.get("max_tokens")
    if max_tokens is None:  # absent or None: SamplingParams' default
        max_tokens = SamplingParams().max_tokens
    assert len(outs) == num_prompts(p)
    for o in outs:
        assert o.finish_reason in ("eos", "stop", "length"), (o.finish_reason, o.error)
        assert 1 <= len(o.token_ids) <= max_tokens
        assert len(o.prompt_token_ids) + len(o.token_ids) <= llm.max_model_len
        assert all(0 <= t < VOCAB for t in o.token_ids)
        if o.finish_reason == "length":
            assert len(o.token_ids) == max_tokens or \
                len(o.prompt_token_ids) + len(o.token_ids) == llm.max_model_len


def check_idle_and_unchanged(llm: LLM, reference: list[int]) -> None:
    s = llm.scheduler
    assert not s.waiting and not s.running
    assert len(llm.allocator.free) == llm.config.num_kv_blocks
    assert llm.generate(REFERENCE, max_tokens=4)[0].token_ids == reference


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(ENGINES)), p=prompts, kwargs=sampling)
def test_generate_returns_complete_outputs_or_names_the_field(engines, name, p, kwargs):
    llm, reference = engines[name]
    try:
        with no_hang():
            outs = llm.generate(p, **kwargs)
    except (ValueError, TypeError) as e:
        assert any(f in str(e) for f in GENERATE_FIELDS), repr(e)
    else:
        check_complete(llm, p, kwargs, outs)
    check_idle_and_unchanged(llm, reference)


methods = st.sampled_from(["mtp", "eagle", "eagle3", "deepseek_mtp", "medusa", "", 3, None])
spec_configs = st.one_of(
    st.none(), st.sampled_from([5, "{bad", [1], "null"]),
    st.fixed_dictionaries({"method": methods}, optional={
        "num_speculative_tokens": st.one_of(st.integers(-1, 4), st.sampled_from(["2", 2.0])),
        "disable_padded_drafter_batch": st.one_of(st.booleans(), st.just("yes")),
        "graph_mode": st.sampled_from(["eager", "torchair", "cuda", 1]),
        "draft_model_config": st.one_of(
            st.just({}), st.just([]),
            st.fixed_dictionaries({"eagle_aux_hidden_state_layer_ids": st.one_of(
                st.lists(st.integers(-1, 9), max_size=4), st.just("1,2"))})),
        "bogus_key": st.just(1),
    }))
sizes = st.one_of(st.integers(-1, 80), st.sampled_from([10**7, 2048, True, 1.5, "16", None]))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=spec_configs, max_model_len=sizes, max_num_seqs=sizes, block_size=sizes,
       max_num_batched_tokens=sizes,
       seed=st.one_of(st.integers(-1, 3), st.sampled_from([2**64, "1", 1.0])),
       dtype=st.sampled_from(["float32", "float64", "int8", torch.int32, torch.float64, 3]))
def test_random_configs_build_a_working_engine_or_name_the_field(
        spec, max_model_len, max_num_seqs, block_size, max_num_batched_tokens, seed, dtype):
    torchair = isinstance(spec, dict) and spec.get("graph_mode") == "torchair"
    kwargs = dict(max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                  seed=seed, dtype=dtype,
                  compile_backend="eager" if torchair else None)  # trace, no codegen
    try:
        with no_hang():
            llm = LLM(DEFAULT_MODEL, spec, **kwargs)
    except (ValueError, TypeError) as e:
        assert any(f in str(e) for f in LLM_FIELDS), repr(e)
        return
    prompts = [p for p in ([1, 2], [3]) if len(p) < llm.max_model_len]  # the ones that fit
    with no_hang():
        outs = llm.generate(prompts, max_tokens=3, temperature=0.7)
    check_complete(llm, prompts, {"max_tokens": 3}, outs)
    s = llm.scheduler
    assert not s.waiting and not s.running


SHARED = [(37 * i + 11) % (VOCAB - 1) + 1 for i in range(48)]  # prompts share its prefixes


@pytest.fixture(scope="module")
def plain_greedy():
    """prompt -> plain greedy tokens of it alone (the embedded model, 20 tokens)."""
    llm, cache = LLM(max_model_len=96, max_num_seqs=1), {}

    def get(prompt: list[int], n: int) -> list[int]:
        if tuple(prompt) not in cache:
            cache[tuple(prompt)] = llm.generate([prompt], max_tokens=20,
                                                ignore_eos=True)[0].token_ids
        return cache[tuple(prompt)][:n]
    return get


@st.composite
def feature_configs(draw):
    """A speculative config and engine keywords mixing the features a user may combine."""
    method = draw(st.sampled_from([None, "mtp", "eagle", "eagle3", "ngram", "suffix"]))
    kw = dict(max_num_seqs=draw(st.integers(1, 4)),
              max_num_batched_tokens=draw(st.sampled_from([16, 32, 64])),
              block_size=draw(st.sampled_from([8, 16])),
              enable_prefix_caching=draw(st.booleans()),
              pack_prefill=draw(st.sampled_from([None, True, False])),
              graph_backend=draw(st.sampled_from(["eager", "replay"])))
    if method is None:
        return None, kw
    k = draw(st.integers(1, 4))
    spec = {"method": method, "num_speculative_tokens": k}
    shape = draw(st.sampled_from(["chain", "ragged", "tree"]))
    if shape == "ragged":
        spec["disable_padded_drafter_batch"] = True
    elif shape == "tree" and method == "suffix":
        spec["num_draft_tokens"] = draw(st.integers(2, 8))
    elif shape == "tree" and method != "ngram":
        spec.update(tree_topk=draw(st.integers(1, 3)), num_draft_tokens=draw(st.integers(2, 8)))
    if method in ("mtp", "eagle", "eagle3") and shape != "ragged":
        kw["async_scheduling"] = draw(st.booleans())
    return spec, kw


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=feature_configs(), data=st.data())
def test_features_together_give_plain_greedys_tokens(plain_greedy, config, data):
    """Methods, chains and trees, the ragged drafter, prefix caching, packed prefill, async
    scheduling and captured steps at once, under requests that arrive in waves (sharing
    prefixes) and aborts between steps: every greedy request's tokens are plain greedy's of
    its prompt alone (an aborted one's a prefix of them), and no KV block is held after."""
    spec, kw = config
    try:
        llm = LLM(speculative_config=spec, max_model_len=96, **kw)
    except ValueError:  # a combination refused by name (its own tests check the message)
        return
    reqs, aborted = [], set()
    for _ in range(data.draw(st.integers(1, 3))):
        for _ in range(data.draw(st.integers(1, 3))):
            prompt = SHARED[:data.draw(st.integers(1, 40))] + data.draw(
                st.lists(st.integers(1, VOCAB - 1), max_size=4))
            n = data.draw(st.integers(1, 20))
            reqs.append((llm.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True)),
                         prompt, n))
        for _ in range(data.draw(st.integers(0, 4))):
            llm.step()
            if data.draw(st.integers(0, 9)) == 0:
                victim = data.draw(st.sampled_from(reqs))[0]
                if llm.abort_request(victim.request_id):
                    aborted.add(victim.request_id)
    with no_hang():
        while llm.step() is not None:
            pass
    for req, prompt, n in reqs:
        want = plain_greedy(prompt, n)
        got = req.output_token_ids
        assert got == (want[:len(got)] if req.request_id in aborted else want), (spec, kw)
    assert llm.allocator.ref == [0] * llm.allocator.num_blocks
    assert len(llm.allocator.free) == llm.allocator.num_blocks
