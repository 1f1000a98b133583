"""K per step from measurements (``num_speculative_tokens_policy="goodput"``): the policy
against an oracle computed from the same observations (E(K) / t(K), E from each decode's
acceptance), its exploration and refresh; in the engine, tokens never change whatever K it
picks (greedy equals plain decoding, eager and captured), every K bucket runs, and the policy
counts what the requests drafted and kept."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.engine.k_policy import GoodputPolicy

K = 3
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(", "import os\nimport sys\n",
           "for i in range(10):", "class Stack:\n", "x = 1\ny = 2\nx = 1\n"]


def oracle(potentials: list[int], cost: list[float], cap: int) -> int:
    """The K in 0..cap of the most tokens per second when decode i would accept
    ``potentials[i]`` drafts of any number drafted and a step at K takes ``cost[K]`` s
    (the smaller K on a tie)."""
    def tokens_per_s(k):
        return sum(1 + min(a, k) for a in potentials) / cost[k]
    return max(range(cap + 1), key=tokens_per_s)


def run_steps(policy, batch: int, cap: int, potentials, cost, n: int) -> list[int]:
    """``n`` decode-only steps: each picks K, then observes its cost and acceptance; as in
    the engine, a step's decodes carry min(previous K, K) drafts (the first step: ``cap``)."""
    ks = getattr(policy, "test_ks", [])
    for _ in range(n):
        k = policy.pick(batch, cap, True)
        asked = min(ks[-1] if ks else cap, k)
        policy.observe(batch, k, cost[k], [min(a, asked) for a in potentials], asked)
        ks.append(k)
    policy.test_ks = ks
    return ks[-n:]


@settings(max_examples=200, deadline=None)
@given(potentials=st.lists(st.integers(0, K), min_size=1, max_size=8),
       cost=st.lists(st.floats(0.5, 4.0), min_size=K + 1, max_size=K + 1),
       cap=st.integers(0, K))
def test_after_exploring_each_k_the_policy_picks_the_oracles_k(potentials, cost, cap):
    rates = sorted(sum(1 + min(a, k) for a in potentials) / cost[k] for k in range(cap + 1))
    assume(len(rates) == 1 or rates[-1] - rates[-2] > 1e-6 * rates[-1])
    policy = GoodputPolicy(K, lambda n: n, refresh_steps=64)
    explored = run_steps(policy, len(potentials), cap, potentials, cost, 2 * (cap + 1))
    # every K twice in a row, least recently run first: the second step of K verifies K
    # drafts, so every position's acceptance is measured
    assert explored == [k for k in range(cap + 1) for _ in range(2)]
    best = oracle(potentials, cost, cap)  # then the oracle's K until a refresh is due
    assert set(run_steps(policy, len(potentials), cap, potentials, cost,
                         64 - 2 * (cap + 1))) == {best}


def test_a_k_not_run_for_refresh_steps_runs_again_and_its_new_cost_counts():
    """Drafts never kept: K = 0 is best; a K not run for ``refresh_steps`` decode-only steps
    runs again (twice). When K = 2's cost falls and its drafts are kept (a workload that
    changed), the refresh finds it."""
    policy = GoodputPolicy(K, lambda n: n, refresh_steps=16, decay=0.0)
    cost = [1.0, 1.5, 2.0, 2.5]
    ks = run_steps(policy, 2, K, [0, 0], cost, 24)
    # K = j runs at steps 2j, 2j + 1 (then last run: decode step 2j + 2), next at 2j + 18
    assert ks == [0, 0, 1, 1, 2, 2, 3, 3] + [0] * 12 + [1, 1, 2, 2]
    cost[2] = 1.2
    ks = run_steps(policy, 2, K, [3, 3], cost, 32)
    # K = 3 (its refresh; now the best measured: 4 tokens in 2.5) until K = 2 is measured
    # again at its new cost (3 tokens in 1.2), then K = 2 between refreshes
    assert ks == [3] * 12 + [0, 0, 1, 1] + [2] * 12 + [3, 3, 0, 0]
    assert policy.expected_tokens(2) == 3.0


def test_a_prefill_step_only_exploits_and_a_new_bucket_starts_from_its_neighbours():
    """Bucket 1 measured: a new bucket (4) takes its times, scaled by a K both ran, and
    explores its own K only after ``refresh_steps`` of its decode-only steps."""
    policy = GoodputPolicy(K, lambda n: 1 if n == 1 else 4, refresh_steps=8)
    assert policy.pick(3, K, False) == K  # nothing measured anywhere: the cap
    policy.observe(3, 0, None, [0, 0, 0], 0)  # a mixed step: acceptance counts, no time
    assert not any(policy.times[4])
    cost_1 = [1.0, 1.2, 1.5, 1.9]
    run_steps(policy, 1, K, [1], cost_1, 2 * (K + 1))  # bucket 1 only; one draft kept
    assert policy.pick(1, K, False) == oracle([1], cost_1, K) == 1
    assert policy.pick(3, K, True) == 1  # bucket 4 from bucket 1's figures: no exploring
    # bucket 4 runs K = 1 at 4x bucket 1's times and K = 0 at 2x: estimates scale by K = 1
    cost_4 = [2.0, 4.8, 5.0, 5.2]
    ks = run_steps(policy, 3, K, [1, 1, 1], cost_4, 8)
    assert ks[0] == 1 and policy.seconds(4) == pytest.approx(
        [4.8 * 1.0 / 1.2, 4.8, 4.8 * 1.5 / 1.2, 4.8 * 1.9 / 1.2])
    # its own K = 0, 2, 3 are explored once 8 of its decode steps have run
    assert run_steps(policy, 3, K, [1, 1, 1], cost_4, 6) == [0, 0, 2, 2, 3, 3]
    assert policy.seconds(4) == cost_4[:1] + [4.8] + cost_4[2:]


def test_one_slow_step_does_not_move_the_pick():
    """A step preempted or collected (15x its cost) is one of the last ``window`` times: the
    least of them stands, so the pick stays."""
    policy = GoodputPolicy(K, lambda n: n)
    cost = [1.0, 1.2, 1.4, 1.6]
    run_steps(policy, 2, K, [3, 3], cost, 2 * (K + 1))
    best = oracle([3, 3], cost, K)
    spiked = list(cost)
    spiked[best] *= 15
    run_steps(policy, 2, K, [3, 3], spiked, 1)
    assert run_steps(policy, 2, K, [3, 3], cost, 8) == [best] * 8


@pytest.mark.parametrize("value,match", [
    ("fast", r"num_speculative_tokens_policy='fast'; allowed: \('goodput',\) or None"),
    (1, r"num_speculative_tokens_policy=1; allowed")])
def test_an_unknown_policy_is_refused_by_name(value, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict({"method": "eagle3", "num_speculative_tokens": K,
                                     "num_speculative_tokens_policy": value})


def test_the_policy_runs_every_k_bucket_and_extract_hidden_states_refuses_it():
    cfg = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": K,
                                       "num_speculative_tokens_policy": "goodput"})
    assert cfg.step_ks == tuple(range(K + 1))
    with pytest.raises(ValueError, match="num_speculative_tokens_policy='goodput' with "
                                         "method='extract_hidden_states'"):
        SpeculativeConfig.from_dict({"method": "extract_hidden_states",
                                     "num_speculative_tokens": 1,
                                     "num_speculative_tokens_policy": "goodput",
                                     "draft_model_config": {
                                         "eagle_aux_hidden_state_layer_ids": [0]}})


@pytest.fixture(scope="module")
def plain():
    llm = LLM(max_model_len=128)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("method,backend", [("eagle3", "eager"), ("eagle3", "replay"),
                                            ("ngram", "replay")])
def test_greedy_under_the_policy_equals_plain_and_every_k_runs(plain, method, backend):
    """Whatever K each step runs (explored, refreshed, picked), greedy tokens equal plain
    decoding; replay captures every decode-only step at each K; with decay 1 the policy's
    counts are the requests' own: decodes run with K > j, and those that kept draft j + 1
    (at most one more per request: its last step may accept past its end)."""
    llm = LLM(max_model_len=128, graph_backend=backend, speculative_config={
        "method": method, "num_speculative_tokens": K,
        "num_speculative_tokens_policy": "goodput"})
    llm.core.k_policy.decay = 1.0
    llm.core.k_policy.refresh_steps = 6
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == plain
    assert {s.num_spec_tokens for s in llm.steps} == set(range(K + 1))
    if backend == "replay":
        assert all(s.captured for s in llm.steps if s.num_tokens == s.num_reqs * (
            1 + s.num_spec_tokens))
    if method == "eagle3":  # every decode at K drafts K
        drafted, accepted = ([sum(getattr(o, name)[j] for o in outs
                                  if len(getattr(o, name)) > j) for j in range(K)]
                             for name in ("num_drafted", "num_accepted"))
        assert [n for _, n in llm.core.k_policy.kept] == drafted
        assert all(a <= hit <= a + len(PROMPTS)
                   for (hit, _), a in zip(llm.core.k_policy.kept, accepted))
