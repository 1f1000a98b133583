"""Graph mode as a step wrapper: every method's padded step through every CPU backend.

The compile backends trace with dynamo (``compile_backend="eager"``: the graph is built, no
inductor codegen, so the test stays fast); ``replay`` runs the CUDA-graph code path (static
inputs and outputs per bucket, captured once) without a graph. Each must equal the eager
engine token for token, drafts included, over steps of varying acceptance.
"""

import asyncio
import random

import httpx
import pytest
import torch
import torch._dynamo.utils as dynamo_utils
from hypothesis import given
from hypothesis import strategies as st

from specdec.engine import core as core_module
from specdec.engine.inputs import DEFAULT_MODEL
from specdec.engine.llm import LLM
from specdec.engine.runner import MIN_GRAPH_SEQ_LEN, STARTUP_VARIANTS, graph_seq_len
from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.serve import build_server_app
from specdec.graphs import COMPILING, Backend, StepGraph, compile_dynamic
from specdec.models.heads import build_head
from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM

from helpers import LONG_PROMPT, ServerThread, metrics, run_arrivals, uniform_flags

K = 3
AUX = [0, 1, 1]
PROMPTS = [[1, 2, 3], [4, 5], [6, 1, 1, 2, 5], [3]]


@pytest.fixture(scope="module")
def target():
    """A tiny vocabulary so a random head is right often enough for varied acceptance."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=7)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


@pytest.fixture(scope="module")
def heads(target):
    out = {}
    for method, seed in (("mtp", 9), ("eagle", 8), ("eagle3", 6)):  # seeds with acceptance
        torch.manual_seed(seed)
        extra = {"eagle_aux_hidden_state_layer_ids": AUX} if method == "eagle3" else {}
        out[method] = build_head(method, target, **extra).to(torch.float64).eval()
    return out


def make_llm(target, heads, method, graph_backend=None, graph_mode=None,
             capture_sizes=(1, 2, 4), dtype=torch.float64, padded=True):
    spec = None
    if method is not None:
        spec = {"method": method, "num_speculative_tokens": K, "graph_mode": graph_mode,
                "disable_padded_drafter_batch": not padded}
        if method == "eagle3":
            spec["draft_model_config"] = {"eagle_aux_hidden_state_layer_ids": AUX}
    return LLM(target=target, draft_head=heads.get(method), speculative_config=spec,
               dtype=dtype, max_num_batched_tokens=32, max_model_len=160,
               max_num_seqs=4, capture_sizes=list(capture_sizes), graph_backend=graph_backend,
               compile_backend="eager" if graph_backend in COMPILING or (
                   spec and graph_mode == "torchair") else None)


def run(llm, prompts, max_tokens):
    reqs = [llm.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for p in prompts]
    drafts = []
    while llm.step() is not None:
        drafts.append([list(r.spec_token_ids) for r in reqs])
    return [r.output_token_ids for r in reqs], drafts, reqs


def graph_calls(llm):
    proposer = llm.runner.proposer
    return llm.runner.target_graph.calls, proposer.step_graph.calls if proposer else 0


def request_buckets(wrapper, variant=None):
    """Bp of every captured key ((Np, Bp), static values...) [of one sampling variant]."""
    return {key[0][1] for key in wrapper.captured
            if variant is None or ("variant", variant) in key}


@pytest.fixture(scope="module")
def eager_runs(target, heads):
    """method -> the eager engine's (tokens, drafts step by step) for PROMPTS x 60 tokens,
    run once for the module: every wrapped backend is compared with the same run."""
    cache = {}

    def get(method):
        if method not in cache:
            cache[method] = run(make_llm(target, heads, method), PROMPTS, 60)[:2]
        return cache[method]
    return get


@pytest.mark.parametrize("backend", ["replay", "compile"])
@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3", None])
def test_wrapped_steps_equal_eager_token_for_token(target, heads, eager_runs, method, backend):
    eager_out, eager_drafts = eager_runs(method)
    llm = make_llm(target, heads, method, graph_backend=backend)
    out, drafts, reqs = run(llm, PROMPTS, 60)
    assert out == eager_out
    assert drafts == eager_drafts  # the drafts themselves, step by step
    target_calls, draft_calls = graph_calls(llm)
    assert target_calls >= 15
    if method is not None:
        assert draft_calls == target_calls  # every captured target step drafts through a graph
        accepted = {tuple(r.num_accepted) for r in reqs}
        assert len(accepted) > 1 and any(sum(a) > 0 for a in accepted)  # acceptance varied


@pytest.mark.parametrize("method", ["mtp", "eagle"])
def test_a_ragged_drafter_beside_a_captured_target_equals_eager(target, heads, method):
    """disable_padded_drafter_batch=True under ``replay``: the target's steps are captured
    (the start-up warm-up runs all-padding steps, which a ragged drafter has nothing to draft
    for), the drafter runs eager after the step's host read; tokens and drafts equal the
    eager ragged engine's."""
    eager = run(make_llm(target, heads, method, padded=False), PROMPTS, 30)
    llm = make_llm(target, heads, method, graph_backend="replay", padded=False)
    out, drafts, _ = run(llm, PROMPTS, 30)
    assert (out, drafts) == eager[:2]
    assert graph_calls(llm) == (llm.runner.target_graph.calls, 0)
    assert llm.runner.target_graph.calls >= 10


SAMPLED = [SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9, seed=5),
           SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7),
           SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, top_p=0.9),
           # the processed variant (penalties, top-k, min_tokens): its own captured graphs
           SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7, seed=11, top_k=8,
                          repetition_penalty=1.3, frequency_penalty=0.4, min_tokens=4)]


def run_sampled(llm, params):
    reqs = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    while llm.step() is not None:
        pass
    return [r.output_token_ids for r in reqs], [r.num_accepted for r in reqs]


@pytest.mark.parametrize("method", ["eagle3", None])
def test_sampled_steps_are_captured_and_equal_eager(target, heads, method):
    """Sampled decode steps (T 0.7, top-p 0.9, penalties and top-k, seeded and unseeded) run
    through the captured target step, captured at construction: the same tokens and
    acceptance as eager, and most steps replayed; steps with a prefill chunk capture their own
    keys."""
    eager = run_sampled(make_llm(target, heads, method), SAMPLED)
    llm = make_llm(target, heads, method, graph_backend="replay")
    graph = llm.runner.target_graph
    warm_up = set(graph.captured)  # construction captures every bucket in each variant
    assert {dict(key[1:])["variant"] for key in warm_up} == set(STARTUP_VARIANTS)
    assert run_sampled(llm, SAMPLED) == eager
    decode_steps = [s for s in llm.steps if s.num_reqs and not is_mixed(s, K if method else 0)]
    assert len(decode_steps) >= 6 and all(s.captured for s in decode_steps)
    # prefill steps: not capture sizes here; the processed variant (a top_p request beside:
    # the vocabulary sorted) captured at its first use
    assert {dict(key[1:])["variant"] for key in set(graph.captured) - warm_up} == {
        "processed_sorted"}
    # a greedy-only run captures greedy keys only
    greedy = make_llm(target, heads, method, graph_backend="replay")
    run(greedy, PROMPTS, 20)
    assert greedy.runner.target_graph.calls > 0
    assert all(("variant", "greedy") in key for key in set(greedy.runner.target_graph.captured)
               - warm_up)


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_zero_recompilations_after_warmup(target, heads, method):
    """Torchair-MTP's guarantee, now for every method: one graph per bucket, none later."""
    llm = make_llm(target, heads, method, graph_mode="torchair")
    run(llm, PROMPTS, 40)  # warm-up: compiles the buckets a 4-then-fewer batch hits
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    before = graph_calls(llm)[1]
    _, _, reqs = run(llm, PROMPTS, 200)
    assert graph_calls(llm)[1] - before >= 50
    assert {len(set(r.num_accepted)) for r in reqs} != {1}  # varying acceptance per position
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_replay_captures_once_per_bucket_and_reuses_its_buffers(target, heads):
    llm = make_llm(target, heads, "mtp", graph_backend="replay")
    run(llm, PROMPTS, 30)
    for wrapper in (llm.runner.target_graph, llm.runner.proposer.step_graph):
        assert request_buckets(wrapper) <= {1, 2, 4} and wrapper.captured
        ptrs = {b: [t.data_ptr() for t in e.outputs] for b, e in wrapper.captured.items()}
        run(llm, PROMPTS, 30)
        assert {b: [t.data_ptr() for t in e.outputs]
                for b, e in wrapper.captured.items()} == ptrs


def test_batch_above_the_largest_bucket_runs_eager(target, heads):
    eager_out, _, _ = run(make_llm(target, heads, "mtp"), PROMPTS, 20)
    llm = make_llm(target, heads, "mtp", graph_backend="replay", capture_sizes=(1, 2))
    out, _, reqs = run(llm, PROMPTS, 20)
    assert out == eager_out
    # 4 decoding requests fit no bucket: those steps ran eagerly, the 1-2 request tails did not
    steps_of_four = sum(1 for s in llm.steps if s.num_reqs == 4)
    assert steps_of_four > 0
    assert request_buckets(llm.runner.target_graph) <= {1, 2}


def test_step_arguments_must_be_tensors():
    graph = StepGraph(lambda x, n: x + n, Backend("replay"))
    with pytest.raises(TypeError, match="must be tensors.*int"):
        graph(1, torch.zeros(2), 3)
    with pytest.raises(ValueError, match="graph_backend='nope'"):
        StepGraph(lambda x: x, Backend("nope"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay_equals_eager():
    x = torch.arange(6.0, device="cuda")
    graph = StepGraph(lambda t: (t * 2 + 1).sum()[None], Backend("cuda_graph"))
    first = graph(6, x).clone()
    second = graph(6, x + 1)
    assert first.item() == 36 and second.item() == 48


def test_only_the_first_call_of_a_bucket_runs_outside_the_sync_guard():
    """Compilation and capture may sync (inductor's first compile does on CUDA); the steady
    state may not."""
    from specdec.syncs import HostSyncError, forbid_host_sync

    def syncing_step(x):
        x.sum().item()
        return x + 1

    graph = StepGraph(syncing_step, Backend("replay"))
    with forbid_host_sync():
        graph(1, torch.zeros(2))  # capture / warm-up of bucket 1
        graph(2, torch.zeros(3))  # a new bucket: its first call is set-up too
        with pytest.raises(HostSyncError, match="Tensor.item"):
            graph(1, torch.zeros(2))
    eager = StepGraph(syncing_step, Backend("eager"))  # no set-up: its first call is checked
    with forbid_host_sync(), pytest.raises(HostSyncError, match="Tensor.item"):
        eager(1, torch.zeros(2))


def test_graphs_are_warmed_for_every_bucket_at_construction(target, heads):
    llm = make_llm(target, heads, "eagle3", graph_backend="replay")
    assert request_buckets(llm.runner.target_graph) == request_buckets(
        llm.runner.proposer.step_graph) == {1, 2, 4}
    assert llm.core.graph_warmup_seconds > 0 and not llm.steps


def test_unknown_compile_backend_names_the_field():
    with pytest.raises(ValueError, match="compile_backend='tensorrt'.*inductor"):
        StepGraph(lambda x: x, Backend("compile", "tensorrt"))


@pytest.mark.parametrize("backend", [None, "eager", "replay"])
def test_a_compile_backend_is_refused_where_nothing_compiles(target, backend):
    """LLM(compile_backend=...) would do nothing without a compiling graph backend."""
    with pytest.raises(ValueError, match=r"^compile_backend='eager' is for a compiling graph "
                                         rf"backend .*; this engine's is '{backend or 'eager'}'"):
        LLM(target=target, dtype=torch.float64, graph_backend=backend, compile_backend="eager")


def test_static_inputs_are_the_first_args_and_other_tensors_are_copied_in():
    """A persistent buffer passed again is read in place (no copy); a new tensor is copied
    into the static input before the replay."""
    buf = torch.tensor([1.0, 2.0])
    graph = StepGraph(lambda x: x * 10, Backend("replay"))
    assert graph(2, buf).tolist() == [10.0, 20.0]
    buf.copy_(torch.tensor([3.0, 4.0]))  # the caller refills its buffer in place
    assert graph(2, buf).tolist() == [30.0, 40.0]
    assert graph(2, torch.tensor([5.0, 6.0])).tolist() == [50.0, 60.0]
    assert graph.captured[(2,)].inputs[0] is buf and buf.tolist() == [5.0, 6.0]


@pytest.mark.parametrize("kwargs,exc,field", [
    ({"graph_backend": "xla"}, ValueError, "graph_backend"),
    ({"check_host_syncs": "yes"}, TypeError, "check_host_syncs")])
def test_graph_and_sync_options_are_checked_on_the_dp_parent(target, kwargs, exc, field):
    """Before any rank starts, like every other option."""
    with pytest.raises(exc, match=field):
        LLM(target=target, dtype=torch.float64, data_parallel_size=2, **kwargs)


def is_mixed(step, k):
    return step.num_reqs and step.num_tokens != step.num_reqs * (1 + k)


@pytest.mark.parametrize("method", ["eagle3", None])
def test_mixed_prefill_decode_steps_are_captured_and_equal_eager(target, heads, method):
    """Steps with prefill chunks (greedy and sampled requests, seeded and unseeded) replay
    graphs keyed (Np, Bp, attention bound, variant) on the replay backend: every step fits a
    key here, so every step is captured, with the eager engine's tokens and acceptance."""
    sizes = (1, 2, 4, 8, 16, 32, 64)
    eager = run_arrivals(make_llm(target, heads, method, capture_sizes=sizes), PROMPTS)
    llm = make_llm(target, heads, method, graph_backend="replay", capture_sizes=sizes)
    assert run_arrivals(llm, PROMPTS) == eager
    k = K if method else 0
    mixed = [s for s in llm.steps if is_mixed(s, k)]
    assert len(mixed) >= 4 and all(s.captured for s in llm.steps)
    graph = llm.runner.target_graph
    mixed_keys = {key for key in graph.captured if key[0][0] != key[0][1] * (1 + k)}
    assert 0 < len(mixed_keys) <= len(mixed)
    assert {dict(key[1:])["max_seq_len"] for key in mixed_keys} == {64, 128}
    def bounds(key):  # (Np, Bp) and the first pass's bounds
        return key[0], *((name, dict(key[1:])[name]) for name in ("max_query_len", "max_seq_len"))

    if method is not None:
        assert set(map(bounds, llm.runner.proposer.step_graph.captured)) >= set(
            map(bounds, mixed_keys))  # the drafter replays the same (Np, Bp, bounds)


def test_compiling_backends_run_mixed_steps_eagerly(target, heads):
    """A compile per (Np, Bp, bound) key would stall a serving engine: mixed steps run eager
    there, uniform decodes compiled."""
    llm = make_llm(target, heads, "mtp", graph_backend="compile",
                   capture_sizes=(1, 2, 4, 8, 16, 32, 64))
    run_arrivals(llm, PROMPTS)
    assert not any(s.captured for s in llm.steps if is_mixed(s, K))
    assert any(s.captured for s in llm.steps if s.num_reqs and not is_mixed(s, K))


@given(max_model_len=st.integers(1, 10_000), data=st.data())
def test_a_mixed_steps_attention_bound_covers_its_sequences(max_model_len, data):
    """graph_seq_len: >= the longest sequence, <= max_model_len, a power of two (>= 64) unless
    capped, and under twice the longest sequence: few keys, little wasted gather."""
    n = data.draw(st.integers(1, max_model_len))
    bound = graph_seq_len(n, max_model_len)
    assert n <= bound <= max_model_len
    if bound < max_model_len:
        assert bound & (bound - 1) == 0 and bound >= MIN_GRAPH_SEQ_LEN
        assert bound < 2 * n or bound == MIN_GRAPH_SEQ_LEN


# ---- compile_dynamic: one dynamic-shape graph per code path, every step through it -----------
def greedy_arrivals(llm):
    """Greedy requests of varying lengths arriving while others decode, the last one decoding
    up to max_model_len -> their tokens."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [LONG_PROMPT[:n] for n in (5, 40, 3, 9, 17, 2, 30)]
    prompts.append((LONG_PROMPT * 3)[:llm.max_model_len - 12])
    reqs = []
    for i in range(200):
        if prompts and i % 2 == 0:
            reqs.append(llm.add_request(prompts.pop(0), params))
        if llm.step() is None and not prompts:
            break
    return [r.output_token_ids for r in reqs]


@pytest.fixture(scope="module")
def warmed(target, heads):
    """method -> its compile_dynamic engine, built once for the module (a warm-up compiles
    tens of graphs) -> (LLM, graphs dynamo compiled while building it)."""
    engines = {}

    def get(method):
        if method not in engines:
            graphs = dynamo_utils.counters["stats"]["unique_graphs"]
            llm = make_llm(target, heads, method, graph_backend="compile_dynamic")
            engines[method] = llm, dynamo_utils.counters["stats"]["unique_graphs"] - graphs
        return engines[method]
    return get


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_compile_dynamic_warms_up_the_serving_paths_and_equals_eager(warmed, target, heads,
                                                                     method):
    """Construction compiles the code paths of every sampling variant (``warmup_phases``),
    each graph counted by its wrapper; then requests arriving among decodes, up to
    max_model_len, greedy and sampled, compile nothing more, every step runs through the one
    wrapper, and tokens, drafts and acceptance equal the eager engine's."""
    llm, compiled = warmed(method)
    assert llm.core.graph_warmup_seconds > 0
    assert not llm.allocator.cached  # the warm-up's repeated prompts ran with the cache off
    assert sum(g.graphs for g in step_graphs(llm)) == compiled > 0
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    calls, first = graph_calls(llm), len(llm.steps)
    got = greedy_arrivals(llm)
    steps = sum(1 for s in llm.steps[first:] if s.num_reqs)
    assert graph_calls(llm)[0] - calls[0] == steps
    if method is not None:
        assert graph_calls(llm)[1] - calls[1] == steps
    eager = make_llm(target, heads, method)
    assert got == greedy_arrivals(eager)
    assert run_arrivals(llm, PROMPTS) == run_arrivals(eager, PROMPTS)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def step_graphs(llm) -> list[StepGraph]:
    proposer = llm.runner.proposer
    return [llm.runner.target_graph] + ([proposer.step_graph] if proposer else [])


CLIENT_SAMPLING = [{}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.7}]


def client_requests(llm) -> list[tuple[list[int], SamplingParams]]:
    """What clients may send: prompts of every length up to two step budgets and one (every
    prefill chunk length; a last chunk of one token), in a block per sampling variant (greedy,
    sampled, sampled with top-p), then the variants mixed; one request decoding to
    max_model_len."""
    out = []
    for sampling in CLIENT_SAMPLING + [None]:
        for n in range(1, 2 * llm.scheduler.max_num_batched_tokens + 2):
            kw = CLIENT_SAMPLING[n % 3] if sampling is None else sampling
            out.append(([1 + i % 6 for i in range(n)],
                        SamplingParams(max_tokens=1 + n % 5, ignore_eos=True, **kw)))
    out.append(([1, 2, 3] * 4, SamplingParams(max_tokens=llm.max_model_len, ignore_eos=True)))
    return out


def drive(llm, requests, seed=0):
    """Bursts of 1..max_num_seqs requests, mid-decode too, under a cap on the running batch
    that changes every few steps (so steps run 1..max_num_seqs requests) -> the steps."""
    rnd, pending, first = random.Random(seed), list(requests), len(llm.steps)
    cap, s = 1, llm.scheduler
    while pending or s.has_unfinished():
        cap = rnd.randint(1, s.max_num_seqs) if rnd.random() < 0.2 else cap
        if len(s.running) + len(s.waiting) < cap:
            for _ in range(rnd.randint(1, s.max_num_seqs)):
                if pending:
                    llm.add_request(*pending.pop(0))
        llm.step()
    return llm.steps[first:]


@pytest.mark.parametrize("method", [None, "eagle3"])
def test_compile_dynamic_compiles_nothing_after_start_up(warmed, method):
    """Every shape a client can produce (1..max_num_seqs requests, prompts of every chunk
    length, arrivals mid-decode, each sampling variant and mixes, max_model_len) runs on the
    graphs of start-up: the engine's counter and dynamo's agree at zero."""
    llm, _ = warmed(method)
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    steps = drive(llm, client_requests(llm))
    assert [s.new_graphs for s in steps if s.new_graphs] == []
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert {s.num_reqs for s in steps} >= set(range(1, llm.scheduler.max_num_seqs + 1))


def test_compile_dynamic_counts_each_graph_it_compiles():
    """A wrapper's ``graphs`` counts dynamo's graphs: one per code path, and one more for
    a size of 1 (dynamo specializes it)."""
    graph = StepGraph(lambda x: x * 2, Backend("compile_dynamic", "eager"))
    for size in (3, 5, 1, 4, 1):
        graph(None, torch.ones(size))
    assert graph.graphs == 2


def test_replay_captures_no_uniform_decode_after_start_up_and_counts_mixed_steps(
        target, heads, monkeypatch):
    """replay (the CUDA-graph code path): uniform decode steps of every sampling variant were
    captured at start-up; a step with a prefill chunk captures its (Np, Bp, bound) key at
    first use, and each such capture is counted once, by the wrapper that made it."""
    llm = make_llm(target, heads, "eagle3", graph_backend="replay")
    keys, uniform = [set(g.seen) for g in step_graphs(llm)], uniform_flags(llm, monkeypatch)
    steps = drive(llm, client_requests(llm))
    decodes = [s for s, flag in zip(steps, uniform, strict=True) if flag]
    assert len(decodes) > 50 and all(s.captured for s in decodes)
    assert [s.new_graphs for s in decodes if s.new_graphs] == []
    for name, graph, before in zip(("target", "draft"), step_graphs(llm), keys):
        assert sum(s.new_graphs.get(name, 0) for s in steps) == len(graph.seen - before) > 0


def test_compile_dynamic_graph_serves_every_size_of_a_path():
    """Sizes and int static values are symbolic: one graph for every size >= 2 of the same
    code path (size 1 is specialized by dynamo), equal to eager."""
    def step(x, y, *, n: int):
        return (x * 2 + y.sum()) [:n]

    graph = StepGraph(step, Backend("compile_dynamic", "eager"))
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    for size in (3, 5, 8, 13):
        x, y = torch.arange(size, dtype=torch.float32), torch.ones(size + 1)
        torch.testing.assert_close(graph(None, x, y, n=size - 1), step(x, y, n=size - 1))
    assert dynamo_utils.counters["stats"]["unique_graphs"] - graphs == 1



def test_compile_dynamic_traces_without_duck_sizes_and_restores_the_callers_settings():
    """Dynamo traces a compile_dynamic call with duck sizing off and floats specialized (two
    inputs of equal size at the first call stay two symbols: no recompile when they differ),
    and the caller's own settings are back after every call, one that raises included."""
    from torch.fx.experimental import _config as shape_config

    def settings():
        return shape_config.use_duck_shape, torch._dynamo.config.specialize_float

    traced_with = []

    def backend(gm, example_inputs):
        traced_with.append(settings())
        return gm.forward

    def step(x, y):
        if x.shape[0] > 100:
            raise ValueError("too long")
        return x * 2 + y.sum()

    before = settings()
    compiled = compile_dynamic(step, backend)
    for n, m in ((3, 3), (4, 6), (7, 5)):
        x, y = torch.arange(n, dtype=torch.float32), torch.ones(m)
        torch.testing.assert_close(compiled(x, y), step(x, y))
        assert settings() == before
    assert traced_with == [(False, True)]
    with pytest.raises(Exception, match="too long"):
        compiled(torch.ones(101), torch.ones(2))
    assert settings() == before


def test_compile_dynamic_generates_no_size_asserts_unless_inductor_is_told_to(monkeypatch):
    """Inductor's generated code checks no input's sizes and strides (dynamo's guards do;
    ~2 us a check on a CPU, about a hundred a decode step), unless
    TORCHINDUCTOR_SIZE_ASSERTS=1 asks for them. A matmul alone: no C++ to compile."""
    from torch._inductor.utils import run_and_get_code

    w = torch.randn(16, 8)

    def step(x):
        return x @ w

    def step_debugged(x):  # its own code object: dynamo's cache holds step's graph
        return x @ w

    x = torch.randn(3, 16)
    out, (code,) = run_and_get_code(compile_dynamic(step, "inductor"), x)
    torch.testing.assert_close(out, x @ w)
    assert "assert_size_stride(" not in code
    monkeypatch.setenv("TORCHINDUCTOR_SIZE_ASSERTS", "1")
    out, (code,) = run_and_get_code(compile_dynamic(step_debugged, "inductor"), x)
    assert code.count("assert_size_stride(") == 2  # x and w


def test_compile_dynamic_reads_the_weights_each_call_and_each_model_its_own():
    """The weights are graph inputs, not constants inductor froze at compile time: a weight
    changed in place after the graph compiled is what the next call reads, and a second
    model whose step shares the first one's code object (as every runner's does) computes
    with its own weights. A matmul alone: no C++ to compile."""

    class Runner:  # as the engine's: a plain object holding a model, its step a method
        def __init__(self, seed: int):
            torch.manual_seed(seed)
            self.proj = torch.nn.Linear(16, 8, bias=False)

        def step(self, x):
            return self.proj(x)

    x = torch.randn(3, 16)
    with torch.inference_mode():
        for seed in (0, 1):
            runner = Runner(seed)
            compiled = compile_dynamic(runner.step, "inductor")
            torch.testing.assert_close(compiled(x), runner.step(x))
            runner.proj.weight.mul_(-2)
            torch.testing.assert_close(compiled(x), runner.step(x))


def one_layer_target(dtype: torch.dtype, monkeypatch) -> LlamaForCausalLM:
    """A seeded one-layer target in ``dtype``, and a compile_dynamic warm-up of one greedy
    8-token prompt for the engines built while ``monkeypatch`` holds."""
    monkeypatch.setattr(core_module, "WARMUP_SAMPLING", ({},))
    monkeypatch.setattr(core_module, "warmup_phases", lambda *sizes: (((8,),),))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, eos_token_id=7)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def test_compile_dynamic_traces_the_forward_once_for_every_sampling_variant(monkeypatch):
    """The target step compiles in two parts: after a greedy warm-up, a sampled request of
    the same shapes runs through the compiled step without tracing the forward again (dynamo's
    cache of ``target_forward`` stays; that of ``verify`` holds a graph per variant), and its
    tokens equal the eager engine's; a 1-token prompt alone (attention bound 1, run at 2)
    reuses the forward graph of one decoding request. In float32, which no other eager-backend
    compile_dynamic engine of the suite uses: dynamo's cache is per code object and the
    forward's guards hold for any engine of the same dtype, so one warmed earlier in the same
    process would already hold its graphs (``verify`` reads no tensor of the model's dtype:
    its graphs may come from any engine)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    target = one_layer_target(torch.float32, monkeypatch)
    llm = make_llm(target, {}, None, graph_backend="compile_dynamic", dtype=torch.float32)

    def graphs(method) -> int:
        return len(_debug_get_cache_entry_list(method.__func__.__code__))
    forward, calls = graphs(llm.runner.target_forward), llm.runner.target_graph.calls
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=1)
    got = llm.generate([[1, 2, 3, 4, 5, 6, 7, 1]], params)[0].token_ids
    assert graphs(llm.runner.target_forward) == forward > 0
    assert llm.runner.target_graph.calls - calls == 6  # every step through the compiled step
    assert graphs(llm.runner.verify) >= 2  # greedy and sampled: a graph each
    eager = make_llm(target, {}, None, dtype=torch.float32).generate([[1, 2, 3, 4, 5, 6, 7, 1]],
                                                                     params)
    assert got == eager[0].token_ids
    # a 1-token prompt alone: the sizes of the warm-up's decodes (one request, one token),
    # attention bound 1 -> 2: their forward graph, not one of its own
    forward = graphs(llm.runner.target_forward)
    alone = SamplingParams(max_tokens=2, ignore_eos=True)
    assert llm.generate([[3]], alone)[0].token_ids == make_llm(
        target, {}, None, dtype=torch.float32).generate([[3]], alone)[0].token_ids
    assert graphs(llm.runner.target_forward) == forward


def test_compile_dynamic_steps_compile_once_with_or_without_the_host_sync_counter(monkeypatch):
    """A step compiled without a torch function mode runs under ``check_host_syncs``' counter
    (a mode) without compiling again, and the other way round: the compiled parts run outside
    any mode (dynamo would guard on it, and trace it into every op). In bfloat16, which no
    other compile_dynamic engine of the suite uses (dynamo's cache is per code object)."""
    target = one_layer_target(torch.bfloat16, monkeypatch)
    llm = LLM(target=target, dtype=torch.bfloat16, max_num_batched_tokens=32, max_model_len=64,
              max_num_seqs=2, graph_backend="compile_dynamic", compile_backend="eager",
              check_host_syncs=False)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 1]]
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    plain = llm.generate(prompt, params)[0].token_ids
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    llm.check_host_syncs = True
    assert llm.generate(prompt, params)[0].token_ids == plain
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_compile_dynamic_with_inductor_equals_eager_at_the_embedded_models_sizes(monkeypatch):
    """The real use: inductor's C++ kernels (fused norms, rotary, activations, the sampler;
    the matmuls on the weights as graph inputs) for the CPU steps give the eager engine's tokens,
    greedy and sampled rows side by side, in each row layout of the step: two prompts
    together (request-major rows), their decodes (token-major), a 17-token prompt among them
    (segments). The model is the embedded one's shape with one layer and seeded weights.
    Inductor's compiles are most of this test, so it compiles only what these arrivals need:
    no warm-up (the eager-backend tests above prove it), one sampling variant (a sampled
    request runs in every step, so the greedy rows go through the sampled variant's argmax
    branch: an all-greedy step's graph differs only in its last op), and never one request
    alone (dynamo specializes a size of 1: a graph per such step) -- the late prompt asks for
    fewer tokens, so all three end together.
    """
    import dataclasses

    monkeypatch.setattr(core_module, "WARMUP_SAMPLING", ({},))
    monkeypatch.setattr(core_module, "warmup_phases", lambda *sizes: ())
    config = dataclasses.replace(ModelConfig.from_folder(DEFAULT_MODEL), num_hidden_layers=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    sampled = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=3)

    def arrivals(llm):
        first = [llm.add_request(list(range(3 + i, 9 + i)), params)
                 for i, params in enumerate((sampled, greedy))]
        llm.step()
        llm.step()
        late = llm.add_request(list(range(20, 37)),
                               SamplingParams(max_tokens=6, ignore_eos=True))
        while llm.step() is not None:
            pass
        assert all(s.num_reqs >= 2 for s in llm.steps if s.num_reqs)
        return [r.output_token_ids for r in [*first, late]]

    kw = dict(target=model, dtype=torch.float32, max_num_seqs=4, max_num_batched_tokens=32,
              max_model_len=128)
    llm, eager = LLM(graph_backend="compile_dynamic", **kw), LLM(**kw)
    assert arrivals(llm) == arrivals(eager)
    # request-major prefill, token-major decodes, a 17-token chunk among two decodes
    assert [(s.num_reqs, s.num_tokens) for s in llm.steps[:3]] == [(2, 12), (2, 2), (3, 19)]


async def send_waves(url: str, llm) -> None:
    """Waves of 1..max_num_seqs + 1 concurrent completions (prompts of every chunk length,
    each sampling variant), then one decoding to max_model_len; every one must succeed."""
    requests = client_requests(llm)[::3]
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        async def one(prompt, params):
            body = {"prompt": prompt, "max_tokens": params.max_tokens, "ignore_eos": True,
                    "temperature": params.temperature, "top_p": params.top_p}
            assert (await h.post("/v1/completions", json=body)).status_code == 200

        size = 1
        while requests:
            wave, requests = requests[:size], requests[size:]
            await asyncio.gather(*(one(*r) for r in wave))
            size = size % (llm.scheduler.max_num_seqs + 1) + 1


@pytest.mark.parametrize("backend", ["compile_dynamic", "replay"])
def test_served_graphs_after_start_up_are_counted_in_metrics(warmed, target, heads, backend):
    """/metrics counts each step graph made after start-up, per step graph: none on a warmed
    compile_dynamic engine under concurrent requests of every variant; on replay, exactly
    the keys its steps with prefill chunks captured (an in-process server over the LLM)."""
    llm = (warmed("eagle3")[0] if backend == "compile_dynamic"
           else make_llm(target, heads, "eagle3", graph_backend="replay"))
    keys, graphs = [len(g.seen) for g in step_graphs(llm)], dynamo_utils.counters["stats"][
        "unique_graphs"]
    server = ServerThread(build_server_app(llm, "tiny"))
    try:
        asyncio.run(send_waves(server.url, llm))
        m = metrics(server.url)
    finally:
        server.close()
    made = [m[f'specdec:graph_compiles_after_startup_total{{"graph": "{name}"}}']
            for name in ("target", "draft")]
    if backend == "compile_dynamic":
        assert made == [0, 0] and dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    else:
        assert made == [len(g.seen) - n for g, n in zip(step_graphs(llm), keys)]
        assert made[0] > 0
