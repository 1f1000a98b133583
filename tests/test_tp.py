"""Tensor (and sequence) parallelism through the engine, with real processes and gloo.

One spawn of 2 ranks (TP=2) runs every job in turn -- the embedded default model (dense) and a
tiny MiniMax-M2 from transformers (MoE, loaded from its folder: each rank reads only its
slices), plain, MTP and EAGLE-3, padded and ragged, SP off and on, a draft tree -- and each
job's tokens and per-position acceptance equal those of the same engine at TP=1. One spawn of 4
ranks (DP=2 x TP=2, SP) is seed 000: extract_hidden_states on the MoE target with one DP rank
idle all run; the same launch runs MTP with a MoE head on the MoE target, with and without
expert parallelism.
"""

import collections
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref

import hf_models
import pytest
import torch
import torch.distributed as dist
from helpers import run_ranks
from safetensors.torch import load_file

from specdec.distributed import init_grid
from specdec.engine.dp_engine import DPJob, run_data_parallel
from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.models.heads import build_head
from specdec.models.registry import load_model

TIMEOUT = 300
MAX_TOKENS = 10
# odd and even lengths; the 16-token budget chunks the 23-token prompt
PROMPTS = [[5, 9, 13], list(range(40, 63)), [7], [300, 17, 4, 99, 120, 6, 2], [3, 3]]
ENGINE = {"max_model_len": 96, "max_num_seqs": 4, "max_num_batched_tokens": 16}
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def spec(method: str, k: int, padded: bool = True, **dmc) -> dict:
    return {"method": method, "num_speculative_tokens": k,
            "disable_padded_drafter_batch": not padded, "draft_model_config": dmc}


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """(folder, full model) of a tiny MiniMax-M2: 2 layers, 8 experts, 4 heads, 2 KV heads."""
    path = hf_models.build_minimax_m2(tmp_path_factory.mktemp("minimax") / "m")
    return path, load_model(path, torch.float32)


def moe_jobs(minimax):
    path, target = minimax
    torch.manual_seed(1)
    mtp = build_head("mtp", target).eval()  # a MoE layer (MiniMax's experts), replicated
    torch.manual_seed(2)
    eagle3 = build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[0, 1, 1]).eval()
    base = dict(model=str(path), **ENGINE)
    return {
        "moe-plain-sp": dict(base, sequence_parallel=True),
        "moe-mtp": dict(base, draft_head=mtp, speculative_config=spec("mtp", 2)),
        "moe-mtp-sp": dict(base, draft_head=mtp, speculative_config=spec("mtp", 2),
                           sequence_parallel=True),
        "moe-eagle3-ragged": dict(base, draft_head=eagle3, speculative_config=spec(
            "eagle3", 2, False, eagle_aux_hidden_state_layer_ids=[0, 1, 1])),
    }


DENSE = {  # the embedded default model and its trained heads
    "dense-plain": dict(ENGINE),
    "dense-mtp": dict(ENGINE, speculative_config=spec("mtp", 2)),
    "dense-mtp-ragged": dict(ENGINE, speculative_config=spec("mtp", 2, False)),
    "dense-mtp-sampled": dict(ENGINE, speculative_config=spec("mtp", 2)),
    "dense-eagle3": dict(ENGINE, speculative_config=spec("eagle3", 3)),
    "dense-eagle3-ragged": dict(ENGINE, speculative_config=spec("eagle3", 2, False)),
    "dense-eagle3-sp": dict(ENGINE, speculative_config=spec("eagle3", 3),
                            sequence_parallel=True),
    # captured steps (the CUDA-graph code path without a graph) with collectives inside
    "dense-eagle3-replay": dict(ENGINE, speculative_config=spec("eagle3", 2),
                                graph_backend="replay", capture_sizes=[1, 2, 4]),
    # K per step (3 -> 1 at 3-4 requests, back to 3): the peer takes each step's K from the
    # driver's header
    "dense-eagle3-k-schedule": dict(ENGINE, speculative_config=dict(
        spec("eagle3", 3), num_speculative_tokens_per_batch_size=[[3, 4, 1]]),
        graph_backend="replay", capture_sizes=[1, 2, 4]),
    # a dynamic draft tree, captured: the tree mask and the accepted path's K/V move on both
    # ranks' shards
    "dense-mtp-tree-replay": dict(ENGINE, speculative_config=dict(
        spec("mtp", 3), tree_topk=2, num_draft_tokens=6), graph_backend="replay",
        capture_sizes=[1, 2, 4]),
}


def qwen3_jobs(qwen3):
    path, target = qwen3
    torch.manual_seed(3)
    mtp = build_head("mtp", target).eval()
    base = dict(model=str(path), **ENGINE)
    return {"qwen3-plain": base,
            "qwen3-mtp-sp": dict(base, draft_head=mtp, speculative_config=spec("mtp", 2),
                                 sequence_parallel=True)}


# with penalties, top-k and min_tokens (the processed step: its inputs broadcast, the
# penalties counted from each rank's own token table)
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=7,
                         repetition_penalty=1.2, frequency_penalty=0.3, top_k=20, min_tokens=3)
SAMPLED_JOBS = ("dense-mtp-sampled",)  # rejection sampling: same random numbers on each rank


def outcome(outputs) -> list[tuple]:
    return [(o.token_ids, o.num_accepted, o.num_decode_steps) for o in outputs]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = hf_models.build_qwen3(tmp_path_factory.mktemp("qwen3") / "m")
    return path, load_model(path, torch.float32)


@pytest.fixture(scope="module")
def tp_runs(minimax, qwen3):
    """{job: (DPRun at TP=2, outcome at TP=1)}."""
    jobs = {**DENSE, **moe_jobs(minimax), **qwen3_jobs(qwen3)}
    params = {name: SAMPLED if name in SAMPLED_JOBS else PARAMS for name in jobs}
    runs = run_data_parallel([DPJob(dict(kw, tensor_parallel_size=2), PROMPTS, params[name])
                              for name, kw in jobs.items()], 1, engine=LLM, tp_size=2,
                             timeout=TIMEOUT)
    ref = {name: outcome(LLM(**kw).generate(PROMPTS, params[name]))
           for name, kw in jobs.items()}
    return {name: (run, ref[name]) for name, run in zip(jobs, runs)}


@pytest.mark.parametrize("name", [*DENSE, "moe-plain-sp", "moe-mtp", "moe-mtp-sp",
                                  "moe-eagle3-ragged", "qwen3-plain", "qwen3-mtp-sp"])
def test_tp2_equals_tp1_token_for_token(tp_runs, name):
    """Tokens, and the drafts' acceptance at each position (so the drafts too, in effect)."""
    run, ref = tp_runs[name]
    assert outcome(run.outputs) == ref
    if "ragged" not in name:  # checked on both ranks (SPECDEC_CHECK_HOST_SYNCS=1): none
        assert all(s.host_syncs == 0 for s in run.ranks[0].steps)
    if name.startswith("dense-") and name != "dense-plain":  # trained heads: drafts accepted
        assert sum(sum(o.num_accepted) for o in run.outputs) > 0


@pytest.mark.parametrize("name", list(DENSE))
def test_both_tp_ranks_issue_the_same_collectives_every_step(tp_runs, name):
    run, _ = tp_runs[name]
    driver, peer = run.ranks[0], run.tp_peers[0]
    assert len(driver.collectives) == len(peer.collectives) == len(driver.steps) + 1
    assert driver.collectives == peer.collectives
    assert driver.collectives[-1] == [("tp_broadcast", driver.collectives[-1][0][1])]  # STOP


def test_plain_step_collectives_by_kind(tp_runs):
    """The default model (4 layers, TP=2, SP off), a step with no new prompt: the step's one
    broadcast, the embedding's all-reduce + 2 per layer, the logits' all-gather."""
    run, _ = tp_runs["dense-plain"]
    kinds = [collections.Counter(op for op, _ in step) for step in run.ranks[0].collectives]
    assert kinds[-2] == {"tp_broadcast": 1, "tp_all_reduce": 9, "tp_all_gather": 1}
    assert kinds[0]["tp_broadcast"] == 2  # the first step also carries the new prompts


def test_sequence_parallel_reduce_scatters_whole_shards(tp_runs):
    """SP: every reduce-scatter input and every all-gathered shard splits evenly across 2."""
    run, _ = tp_runs["moe-mtp-sp"]
    ops = [(op, shape) for step in run.ranks[0].collectives for op, shape in step]
    assert any(op == "tp_reduce_scatter" for op, _ in ops)
    assert all(shape[0] % 2 == 0 for op, shape in ops if op == "tp_reduce_scatter")


# ---- seed 000: DP=2 x TP=2 with SP, extract_hidden_states on the MoE target ------------------
SEED_PROMPTS = [[5, 9, 13], [7, 11, 2, 400, 8, 9, 1], [3], list(range(100, 123))]  # odd lengths
AUX = [0, 1]


def extract_kwargs(path, out_dir, **kw):
    return dict(model=str(path), speculative_config=spec(
        "extract_hidden_states", 1, eagle_aux_hidden_state_layer_ids=AUX,
        output_dir=str(out_dir)), **ENGINE, **kw)


@pytest.fixture(scope="module")
def seed_run(minimax, tmp_path_factory):
    """DP rank 0 gets every prompt, DP rank 1 none (idle every step)."""
    path, _ = minimax
    one, many = tmp_path_factory.mktemp("dp1tp1"), tmp_path_factory.mktemp("dp2tp2")
    ref = LLM(**extract_kwargs(path, one)).generate(SEED_PROMPTS, max_tokens=8)
    job = DPJob(extract_kwargs(path, many, tensor_parallel_size=2, sequence_parallel=True),
                SEED_PROMPTS, SamplingParams(max_tokens=8), [[0, 1, 2, 3], []])
    mtp_kw = moe_jobs(minimax)["moe-mtp-sp"]  # a MoE head: its experts split across DP too
    mtp_job = DPJob(dict(mtp_kw, tensor_parallel_size=2), PROMPTS, PARAMS,
                    [[2], [0, 1, 3, 4]])
    # the same with expert parallelism: each of the 4 ranks 2 of the 8 experts, whole
    ep_job = DPJob(dict(mtp_kw, tensor_parallel_size=2, enable_expert_parallel=True), PROMPTS,
                   PARAMS, [[0, 1, 3, 4], [2]])
    run, mtp_run, ep_run = run_data_parallel([job, mtp_job, ep_job], 2, engine=LLM, tp_size=2,
                                             timeout=TIMEOUT)
    mtp_ref = outcome(LLM(**dict(mtp_kw, sequence_parallel=False)).generate(PROMPTS, PARAMS))
    return run, ref, one, many, mtp_run, mtp_ref, ep_run


def test_seed000_no_hang_and_the_outputs_equal_dp1_tp1(seed_run):
    run, ref, *_ = seed_run
    assert [o.token_ids for o in run.outputs] == [o.token_ids for o in ref]
    idle = run.ranks[1]
    assert len(idle.steps) >= 8 and all(s.num_reqs == 0 for s in idle.steps)


def test_dp2_tp2_mtp_with_a_moe_head_equals_dp1_tp1(seed_run):
    """MTP K=2 with SP, uneven loads (DP rank 0: one short prompt, rank 1: four): the idle steps'
    dummy head forwards match the busy rank's MoE collectives; tokens and acceptance equal."""
    *_, mtp_run, mtp_ref, _ = seed_run
    assert outcome(mtp_run.outputs) == mtp_ref
    assert any(s.num_reqs == 0 for s in mtp_run.ranks[0].steps)


def test_dp2_tp2_expert_parallel_with_a_moe_head_equals_dp1_tp1(seed_run):
    """enable_expert_parallel=True at DP=2 x TP=2 with SP: MiniMax-M2's 8 routed experts
    placed whole, 2 a rank (rank d*2 + t: experts 2r, 2r+1), MTP K=2 with the MoE head, uneven
    loads (DP rank 1: one short prompt, then idle steps): one rank's tokens and acceptance;
    both DP ranks issue the same MoE exchanges, shape for shape, every step."""
    _, _, _, _, _, mtp_ref, ep_run = seed_run
    assert outcome(ep_run.outputs) == mtp_ref
    assert any(s.num_reqs == 0 for s in ep_run.ranks[1].steps)
    moe = [[[(op, s) for op, s in step if op.startswith("moe_")] for step in r.collectives]
           for r in (*ep_run.ranks, *ep_run.tp_peers)]
    assert all(log == moe[0] for log in moe[1:]) and any(moe[0])


def test_seed000_one_planning_all_reduce_per_dp_rank_per_step(seed_run):
    run, *_ = seed_run
    for driver in run.ranks:
        assert len(driver.collectives) == len(driver.steps) + 1
        for step in driver.collectives:
            assert [op for op, _ in step if op == "all_reduce"] == ["all_reduce"]
            assert step[0] == ("all_reduce", (4, 2))
    for peer in run.tp_peers:  # peers plan nothing
        assert not any(op == "all_reduce" for step in peer.collectives for op, _ in step)


def test_seed000_collectives_match_across_dp_and_within_tp_with_tp_aligned_shapes(seed_run):
    """The idle DP rank's dummy steps issue the busy rank's MoE collectives (the cross-DP
    ones), shape for shape (upstream: gloo '8 vs 4'); within each DP rank, both TP ranks
    issue the same collectives; every token count is even (upstream: reduce_scatter)."""
    run, *_ = seed_run
    moe = [[[(op, s) for op, s in step if op.startswith("moe_")] for step in r.collectives]
           for r in (*run.ranks, *run.tp_peers)]
    assert all(log == moe[0] for log in moe[1:]) and any(moe[0])
    for driver, peer in zip(run.ranks, run.tp_peers):
        assert [[x for x in step if x[0] != "all_reduce"] for step in driver.collectives] == \
            peer.collectives
    shapes = [s for r in run.ranks for step in r.collectives for op, s in step
              if op in ("tp_reduce_scatter", "moe_all_gather")]
    assert shapes and all(s[0] % 2 == 0 for s in shapes)


def test_seed000_files_written_once_per_dp_group_equal_dp1_tp1(seed_run):
    """One file per request (TP rank 0 writes; its peer holds the same states, unwritten);
    the gathered hidden states equal DP=1 x TP=1's: the embeddings (aux id 0) bit for bit,
    the layer-1 inputs within float32 rounding of the TP sums."""
    _, _, one, many, *_ = seed_run
    names = sorted(p.name for p in many.iterdir())
    assert names == sorted(p.name for p in one.iterdir()) == [
        f"{i}.safetensors" for i in range(len(SEED_PROMPTS))]
    for i, prompt in enumerate(SEED_PROMPTS):
        a, b = (load_file(str(d / f"{i}.safetensors")) for d in (one, many))
        assert b["token_ids"].tolist() == prompt
        assert b["hidden_states"].shape == (len(prompt), len(AUX), 64)
        assert torch.equal(b["hidden_states"][:, 0], a["hidden_states"][:, 0])
        torch.testing.assert_close(b["hidden_states"], a["hidden_states"], rtol=0, atol=1e-5)


TORCHRUN_SCRIPT = """
import json, os, sys
from specdec import LLM, SamplingParams
llm = LLM(tensor_parallel_size=2, max_model_len=96, max_num_seqs=4, max_num_batched_tokens=16)
outs = llm.generate(json.loads(sys.argv[1]), SamplingParams(max_tokens=10, ignore_eos=True))
with open(os.path.join(sys.argv[2], "rank" + os.environ["RANK"] + ".json"), "w") as f:
    json.dump([o.token_ids for o in outs], f)
"""


def test_torchrun_launch_equals_tp1(tp_runs, tmp_path):
    """The same engine under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK): every rank returns
    every output, equal to TP=1's."""
    script = tmp_path / "tp_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", str(script), json.dumps(PROMPTS),
                          str(tmp_path)],
                         capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    _, ref = tp_runs["dense-plain"]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == [tokens for tokens, *_ in ref]


def _close_grid_rank(rank, store, results):
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
        threads = len(os.listdir("/proc/self/task"))
        grid = init_grid(1, 2, rank)
        groups = [weakref.ref(grid.tp.group), weakref.ref(grid.world)]
        got = [None, None]
        dist.all_gather_object(got, rank, group=grid.world)
        grid.tp.broadcast(torch.ones(4))
        grid.close()
        results.put((rank, (got, [g() is None for g in groups],
                            len(os.listdir("/proc/self/task")) - threads)))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put((rank, traceback.format_exc()))


def test_closing_a_grid_joins_its_groups_threads(tmp_path):
    """Grid.close (init_grid runs it at exit) drops the grid's groups, so their gloo worker
    threads are joined while Python is alive (one freeing its last collective's tensors during
    interpreter shutdown aborts the process); the default group, not the grid's, stays."""
    got = run_ranks(_close_grid_rank, (str(tmp_path / "store"),), 2, TIMEOUT)
    assert got == {r: ([0, 1], [True, True], 0) for r in (0, 1)}, got


# ---- faults and refusals ----------------------------------------------------------------------
def test_a_killed_tp_peer_fails_the_call_naming_it():
    llm = LLM(tensor_parallel_size=2, data_parallel_timeout=60)

    def kill_peer():
        while not (peer := [p for p in mp.active_children() if p.name == "specdec-rank-1"]):
            time.sleep(0.05)
        time.sleep(1.5)  # mid-job (the job alone takes tens of seconds)
        os.kill(peer[0].pid, signal.SIGKILL)
    threading.Thread(target=kill_peer, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 killed by SIGKILL"):
        llm.generate([[1, 2, 3]] * 32, max_tokens=400, ignore_eos=True)
    assert time.monotonic() - start < 60


def test_a_family_not_sharded_yet_is_refused_before_any_rank_starts(tmp_path):
    import hf_qwen3_5
    path = hf_qwen3_5.build_qwen3_5(tmp_path / "q35")
    with pytest.raises(ValueError, match="Qwen3_5ForCausalLM family is not sharded yet"):
        LLM(model=str(path), tensor_parallel_size=2, max_model_len=64)


def test_compiled_steps_under_tp_are_refused_naming_why():
    with pytest.raises(ValueError, match="graph_backend='compile' with tensor_parallel_size=2"):
        LLM(tensor_parallel_size=2, graph_backend="compile", max_model_len=64)


def test_step_on_a_tp_launcher_points_to_generate():
    llm = LLM(tensor_parallel_size=2, max_model_len=64)
    with pytest.raises(RuntimeError, match="tensor_parallel_size=2 use generate"):
        llm.add_request([1, 2], SamplingParams())
