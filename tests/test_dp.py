"""Data parallelism with real processes: gloo on CPU, a MoE target whose experts are split
across the DP ranks, so ranks that disagree on a padded size or on the number of forwards
crash or hang (every run has a timeout, so a hang fails the test).

Each DP size is one spawn running several jobs (one LLM each, in turn): MTP with a MoE head
(K=3: the drafter syncs and exchanges tokens too; and ragged with K=2), Eagle3 with a dense
head (K=2: the drafter's sync is skipped on every rank alike) and extract_hidden_states; the
loads are uneven, one rank gets no request at all.
"""

from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st
from safetensors.torch import load_file

from specdec.dp import DPContext, packed_metadata
from specdec.engine.dp_engine import DPJob, round_robin, run_data_parallel
from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.models.heads import build_head

from helpers import PROMPTS, dense_greedy, moe_target

TIMEOUT = 240  # seconds per spawn (a hang fails instead of blocking CI)
MAX_TOKENS = 20
AUX = [1, 2, 3]
K = {"mtp": 3, "mtp-ragged": 2, "eagle3": 2, "extract_hidden_states": 1, "ngram": 3,
     "mtp-k-schedule": 3, "mtp-tree": 2, "mtp-dtree": 3, "suffix-tree": 3}
# mtp-tree: a static draft tree of depth 2; mtp-dtree: a dynamic one of depth 3 (an idle rank
# runs the tree's head forwards per depth); suffix-tree: host trees of 0..4 drafts per request
TREE = {"mtp-tree": {"speculative_token_tree": [(0,), (1,), (0, 0), (1, 0)]},
        "mtp-dtree": {"tree_topk": 2, "num_draft_tokens": 5},
        "suffix-tree": {"num_draft_tokens": 5, "suffix_decoding_max_spec_factor": 4.0}}
# mtp-k-schedule: K per step (3 alone, 1 at 2-4 requests); a rank with several requests and
# one with one agree on the smaller K (the MoE head's collectives then match)
K_SCHEDULE = [[2, 4, 1]]
NUM_LAYERS = 4
# uneven loads: prompt indices per rank ([] = a rank that is idle for the whole run)
ASSIGN = {
    2: {"mtp": [[0, 1, 2, 3, 4], []], "mtp-ragged": [[0, 1, 2, 3], [4]],
        "eagle3": [[2], [0, 1, 3, 4]], "extract_hidden_states": [[1], [0, 2, 3, 4]],
        "ngram": [[0, 3], [1, 2, 4]], "mtp-k-schedule": [[0, 1, 2, 3], [4]],
        "mtp-tree": [[1, 2], [0, 3, 4]], "mtp-dtree": [[0, 1, 2, 4], [3]],
        "suffix-tree": [[0, 1, 2, 3], [4]]},
    3: {"mtp": [[1], [0, 2, 3, 4], []], "mtp-ragged": [[4], [], [0, 1, 2, 3]],
        "eagle3": [[], [4], [0, 1, 2, 3]], "extract_hidden_states": [[0, 1], [], [2, 3, 4]],
        "ngram": [[2, 3, 4], [0, 1], []], "mtp-k-schedule": [[0], [], [1, 2, 3, 4]],
        "mtp-tree": [[0, 1, 2, 3], [], [4]], "mtp-dtree": [[], [0, 2], [1, 3, 4]],
        "suffix-tree": [[0, 1], [], [2, 3, 4]]},
}


def llm_kwargs(method, target, out_dir=None, **kw):
    """mtp-ragged: MTP with disable_padded_drafter_batch (the drafter syncs a kept-token
    count that differs across ranks)."""
    spec = {"method": method.split("-")[0],
            "num_speculative_tokens": K[method],
            "disable_padded_drafter_batch": method.endswith("-ragged")}
    if method.endswith("-k-schedule"):
        spec["num_speculative_tokens_per_batch_size"] = K_SCHEDULE
    spec.update(TREE.get(method, {}))
    head = None
    if spec["method"] == "mtp":  # built from the MoE config: a MoE layer (cross-rank drafter)
        torch.manual_seed(1)
        head = build_head("mtp", target).to(torch.float64).eval()
    elif method == "eagle3":  # a dense head: no cross-rank layer
        spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
        torch.manual_seed(2)
        head = build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=AUX,
                          num_experts=0).to(torch.float64).eval()
    elif method == "ngram":  # no head: host drafts of 0..K tokens per request and rank
        spec.update(prompt_lookup_min=1, prompt_lookup_max=2)
    elif method == "extract_hidden_states":
        spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": AUX,
                                      "output_dir": str(out_dir)}
    # packed prefill: ASSIGN's uneven loads were chosen for its schedule (CPU's default is
    # unpacked; test_pack_prefill.py)
    return dict(target=target, draft_head=head, speculative_config=spec, dtype=torch.float64,
                max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16, pack_prefill=True,
                **kw)


def dp1_outputs(kwargs, prompts, max_tokens=MAX_TOKENS):
    return [o.token_ids for o in LLM(**kwargs).generate(prompts, max_tokens=max_tokens)]


@pytest.fixture(scope="module")
def target():
    return moe_target()


@pytest.fixture(scope="module")
def reference(target):
    return [dense_greedy(target, p, MAX_TOKENS, 64) for p in PROMPTS]


@pytest.fixture(scope="module")
def dp1(target, tmp_path_factory):
    """{method: (DP=1 token ids, DP=1 output dir)}."""
    out = {}
    for method in K:
        d = tmp_path_factory.mktemp("dp1")
        out[method] = dp1_outputs(llm_kwargs(method, target, d), PROMPTS), d
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["dp2", "dp3"])
def dp_runs(request, target, dp1, tmp_path_factory):
    """(dp_size, {method: (DPRun, DP=1 token ids, DP=1 output dir, DP=N output dir)})."""
    size, params = request.param, SamplingParams(max_tokens=MAX_TOKENS)
    jobs, dirs = [], {}
    for method, assignment in ASSIGN[size].items():
        dirs[method] = tmp_path_factory.mktemp(f"dp{size}")
        jobs.append(DPJob(llm_kwargs(method, target, dirs[method]), PROMPTS, params, assignment))
    runs = run_data_parallel(jobs, size, engine=LLM, timeout=TIMEOUT)
    return size, {m: (run, *dp1[m], dirs[m]) for m, run in zip(ASSIGN[size], runs)}


@pytest.mark.parametrize("method", list(K))
def test_outputs_equal_dp1_greedy(dp_runs, reference, method):
    _, runs = dp_runs
    run, dp1, *_ = runs[method]
    assert [o.token_ids for o in run.outputs] == dp1 == reference


@pytest.mark.parametrize("method", list(K))
def test_every_rank_records_the_same_collectives_each_step(dp_runs, method):
    size, runs = dp_runs
    ranks = runs[method][0].ranks
    logs = [r.collectives for r in ranks]
    assert all(log == logs[0] for log in logs[1:])
    # each step: the target's sync and its 4 MoE layers (all-gather + reduce-scatter) at least
    moe = [sum(op.startswith("moe_") for op, _ in step) for step in logs[0][:-1]]
    assert min(moe) >= 2 * NUM_LAYERS
    assert logs[0][-1] == [("all_reduce", (4, size))]  # the last step: everyone is idle


@pytest.mark.parametrize("method", list(K))
def test_some_rank_idles_while_another_works(dp_runs, method):
    """The uneven loads really happen: steps where one rank has no request."""
    _, runs = dp_runs
    per_rank = [[s.num_reqs for s in r.steps] for r in runs[method][0].ranks]
    assert any(0 in steps for steps in per_rank)
    assert all(len(steps) == len(per_rank[0]) for steps in per_rank)


def test_seed000_idle_dummy_run_issues_exactly_the_collectives_of_a_busy_propose(dp_runs):
    """MTP, K=3, MoE head: rank 2 (DP=3) / rank 1 (DP=2) never has a request, so each of its
    steps is target dummy forward + proposer.dummy_run; a busy rank's step is target forward +
    propose with a first pass and K-1 loop forwards. Both: the step's one planning
    all-reduce, 2*4 target MoE collectives, then 2*K head MoE collectives (no drafter sync)."""
    size, runs = dp_runs
    ranks = runs["mtp"][0].ranks
    idle = ranks[-1]
    assert all(s.num_reqs == 0 for s in idle.steps)
    busy_steps = [i for i, s in enumerate(ranks[0].steps) if s.num_reqs > 0]
    assert len(busy_steps) >= 10
    per_step = 1 + 2 * NUM_LAYERS + 2 * K["mtp"]
    for i in busy_steps:
        assert idle.collectives[i] == ranks[0].collectives[i]
        assert len(idle.collectives[i]) == per_step
        assert idle.steps[i].collectives == ranks[0].steps[i].collectives == per_step


@pytest.mark.parametrize("method", list(K))
def test_one_planning_all_reduce_per_rank_per_step(dp_runs, method):
    """The step is planned once (target and drafter share the plan), busy or idle, padded or
    ragged, MoE drafter or dense: exactly one all-reduce per rank per step."""
    _, runs = dp_runs
    for rank in runs[method][0].ranks:
        assert len(rank.collectives) == len(rank.steps) + 1  # + the final all-idle step
        for step in rank.collectives:
            assert [op for op, _ in step].count("all_reduce") == 1, method


def test_seed000_one_packed_shape_on_the_dp_group(dp_runs):
    """Upstream's gloo '8 vs 4' crash: two packed metadata shapes on one group in one step.
    Here every metadata all-reduce of every step is [4, dp_size]."""
    size, runs = dp_runs
    shapes = {shape for run, *_ in runs.values() for r in run.ranks for step in r.collectives
              for op, shape in step if op == "all_reduce"}
    assert shapes == {(4, size)}


@given(size=st.integers(1, 16), data=st.data())
def test_seed000_the_packed_tensor_has_one_shape_by_construction(size, data):
    rank = data.draw(st.integers(0, size - 1))
    packed = packed_metadata(DPContext(rank, size), data.draw(st.integers(0, 10**6)),
                             data.draw(st.integers(0, 10**4)), data.draw(st.integers(0, 2)))
    assert packed.shape == (4, size) and packed.dtype == torch.int32


def test_extract_hidden_states_files_equal_dp1(dp_runs):
    _, runs = dp_runs
    _, _, one, many = runs["extract_hidden_states"]
    assert sorted(p.name for p in many.iterdir()) == sorted(p.name for p in one.iterdir()) == [
        f"{i}.safetensors" for i in range(len(PROMPTS))]
    for i, prompt in enumerate(PROMPTS):
        a, b = (load_file(str(d / f"{i}.safetensors")) for d in (one, many))
        assert b["token_ids"].tolist() == prompt
        assert b["hidden_states"].shape == (len(prompt), len(AUX), 32)
        torch.testing.assert_close(b["hidden_states"], a["hidden_states"], rtol=1e-9, atol=1e-10)


def test_llm_data_parallel_size_generates_in_prompt_order(target):
    kw = llm_kwargs("mtp", target)
    llm = LLM(**kw, data_parallel_size=2)
    with pytest.raises(RuntimeError, match="data_parallel_size=2 use generate"):
        llm.add_request([1, 2], SamplingParams())
    outs = llm.generate(PROMPTS[:3], max_tokens=8)
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    assert [o.token_ids for o in outs] == dp1_outputs(kw, PROMPTS[:3], 8)


def test_each_runs_ranks_read_the_launchers_environment_of_that_run(target, monkeypatch):
    """Ranks fork from a server started once per launcher (forkserver), yet each run's ranks
    read the launcher's environment as it is at that run: the host-sync check, on (every step
    counted: 0) then off (not counted: None)."""
    job = DPJob(llm_kwargs("mtp", target), PROMPTS[:2], SamplingParams(max_tokens=4))
    for check, counted in (("1", 0), ("0", None)):
        monkeypatch.setenv("SPECDEC_CHECK_HOST_SYNCS", check)
        [run] = run_data_parallel([job], 2, engine=LLM, timeout=TIMEOUT)
        assert {s.host_syncs for rank in run.ranks for s in rank.steps} == {counted}


def test_a_failing_rank_fails_the_run_instead_of_hanging(target):
    """Rank 1's prompt is too long: it raises while rank 0 waits in a collective."""
    kw = llm_kwargs("mtp", target)
    job = DPJob(kw, [[1, 2, 3], list(range(70))], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="data-parallel rank 1: .*max_model_len=64"):
        run_data_parallel([job], 2, engine=LLM, timeout=TIMEOUT)


def test_round_robin_and_bad_assignments():
    assert round_robin(5, 2) == [[0, 2, 4], [1, 3]]
    job = DPJob({}, [[1], [2]], SamplingParams(), [[0], [0]])
    with pytest.raises(ValueError, match="assignment"):
        run_data_parallel([job], 2, engine=LLM)
    with pytest.raises(ValueError, match="data_parallel_size=1"):
        run_data_parallel([replace(job, assignment=None)], 1, engine=LLM)
    with pytest.raises(ValueError, match="device='meta'"):
        run_data_parallel([DPJob({"device": "meta"}, [[1]], SamplingParams())], 2, engine=LLM)
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        LLM(data_parallel_size=0)
    with pytest.raises(ValueError, match="not both"):
        LLM(data_parallel_size=2, dp=DPContext())


def test_dp_ranks_agree_on_each_steps_k(dp_runs):
    """mtp-k-schedule: a rank with several requests asks for K 1, a rank with one request (or
    none) for K 3; each step runs one K on every rank (the smaller: the first rank cuts its
    drafts to it), and both occur."""
    _, runs = dp_runs
    ks = [[s.num_spec_tokens for s in r.steps] for r in runs["mtp-k-schedule"][0].ranks]
    assert all(k == ks[0] for k in ks[1:])
    assert {1, 3} <= set(ks[0])
