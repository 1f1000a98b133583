"""Prefix caching end to end: a run that hits the cache equals a run without it, token for token
and draft for draft (plain, EAGLE, EAGLE-3, MTP, draft model, ngram, suffix; a hybrid
linear-attention target through its state snapshots; eager and captured through replay; greedy
and seeded sampling), requests that end early leave no block held, and what cannot be cached is
refused by name."""

import pytest
import torch

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.models.config import ModelConfig
from specdec.models.draft_lm import DraftLM
from specdec.models.llama import LlamaForCausalLM

from helpers import VOCAB, make_llm, tiny_head, tiny_target

BLOCK = 16
# two 16-token blocks in common; the token after them (the head's lookahead) differs
COMMON = [(i * 5 + 3) % (VOCAB - 1) for i in range(2 * BLOCK)]
BATCHES = [  # repeats within a batch and across the two batches
    [COMMON + [1, 2, 3], COMMON + [4, 5], COMMON + [1, 2, 3], COMMON[:20] + [9]],
    [COMMON + [4, 5], COMMON + [1, 2, 3, 6], COMMON[:BLOCK] + [7, 8], COMMON + [1]],
]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def draft_lm():
    """A second tiny Llama on the target's vocabulary: method draft_model's own model."""
    torch.manual_seed(5)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      eos_token_id=VOCAB - 1)
    return LlamaForCausalLM(cfg).to(torch.float64).eval()


def build(target, draft_lm, method, cache: bool, padded: bool = True, **kw) -> LLM:
    kw.update(enable_prefix_caching=cache, max_num_seqs=3)
    if method == "draft_model":  # the draft model object stands for its folder
        spec = {"method": method, "num_speculative_tokens": 3, "model": "draft",
                "disable_padded_drafter_batch": not padded, **kw.pop("tree", {})}
        return LLM(target=target, draft_head=DraftLM(draft_lm), speculative_config=spec,
                   dtype=torch.float64, max_num_batched_tokens=16, max_model_len=64, **kw)
    head = tiny_head(method, target) if method in ("mtp", "eagle", "eagle3") else None
    return make_llm(target, method, 3, padded, head=head, **kw)


def run(llm: LLM) -> tuple[dict, dict]:
    """The batches one after the other, greedy and seeded requests alternating -> (request id
    -> output tokens, request id -> the drafts it was given at each length of its tokens)."""
    outs, drafts = {}, {}
    for batch in BATCHES:
        reqs = [llm.add_request(p, GREEDY if i % 2 else SEEDED) for i, p in enumerate(batch)]
        while llm.step() is not None:
            for r in llm.scheduler.running:
                if not r.is_prefilling:
                        drafts.setdefault(r.request_id, {})[r.num_tokens] = tuple(
                        r.spec_token_ids)
        outs.update((r.request_id, r.output_token_ids) for r in reqs)
    assert llm.allocator.ref == [0] * llm.allocator.num_blocks
    assert len(llm.allocator.free) == llm.allocator.num_blocks
    return outs, drafts


@pytest.mark.parametrize("backend", ["eager", "replay"])
@pytest.mark.parametrize("method", [None, "eagle", "eagle3", "mtp", "draft_model", "ngram",
                                    "suffix"])
def test_cache_hits_equal_no_cache(target, draft_lm, method, backend):
    """The drafter's KV is reused with the target's: its drafts are those of a run that
    computes every prompt (suffix's drafts also read the other requests' outputs in the order
    they finish, which the cache changes: its greedy tokens are compared)."""
    cached = build(target, draft_lm, method, True, graph_backend=backend)
    plain = build(target, draft_lm, method, False, graph_backend=backend)
    (outs, drafts), (want, want_drafts) = run(cached), run(plain)
    if method == "suffix":  # other drafts: other samples of the seeded requests
        outs, want = ({i: o for i, o in x.items() if int(i) % 2} for x in (outs, want))
    else:
        assert drafts == want_drafts
    assert outs == want
    hits = sum(s.prefix_cache_hits for s in cached.steps)
    queries = sum(s.prefix_cache_queries for s in cached.steps)
    assert queries == sum(map(len, BATCHES[0] + BATCHES[1]))
    assert hits >= 6 * BLOCK  # within the first batch, and across
    assert not any(s.prefix_cache_queries for s in plain.steps)
    if backend == "replay":
        assert any(s.captured for s in cached.steps)


@pytest.mark.parametrize("tree", [{"speculative_token_tree": [(0,), (1,), (0, 0), (0, 0, 0)]},
                                  {"tree_topk": 2, "num_draft_tokens": 6}],
                         ids=["static", "dynamic"])
@pytest.mark.parametrize("method", ["eagle3", "draft_model"])
def test_draft_tree_hits_equal_no_cache(target, draft_lm, tree, method):
    """A tree step's accepted path is moved into place in the step that verifies it, before
    its blocks can be registered: hits equal a run without the cache, drafts included (a
    draft model's root and node rows lie past the kept tokens, rewritten by the next prefix
    pass)."""
    cached, plain = (build(target, draft_lm, method, c, tree=tree) for c in (True, False))
    assert run(cached) == run(plain)
    assert sum(s.prefix_cache_hits for s in cached.steps) >= 6 * BLOCK


@pytest.mark.parametrize("method", ["eagle", "draft_model"])
def test_ragged_drafter_hits_equal_no_cache(target, draft_lm, method):
    """disable_padded_drafter_batch=True: the head's first pass runs over the kept tokens."""
    runs = [run(build(target, draft_lm, method, cache, padded=False)) for cache in (True, False)]
    assert runs[0] == runs[1]


def test_async_scheduling_hits_equal_no_cache(target, draft_lm):
    """Async scheduling reserves a decode ahead and writes junk KV past the accepted tokens:
    never into a registered block."""
    outs = [run(build(target, draft_lm, "eagle", cache, async_scheduling=True,
                      graph_backend="replay")) for cache in (True, False)]
    assert outs[0] == outs[1]


def test_aborted_and_finished_requests_hold_no_block(target, draft_lm):
    """Requests aborted waiting, mid-prefill and mid-decode give their blocks back (their final
    blocks stay cached, and later requests hitting them equal an uncached run)."""
    llm = build(target, draft_lm, "eagle3", True)
    reqs = [llm.add_request(p, GREEDY) for p in BATCHES[0]]
    llm.step()
    assert llm.abort_request(reqs[0].request_id)  # mid-prefill
    for _ in range(4):
        llm.step()
    assert llm.abort_request(reqs[1].request_id)  # mid-decode
    assert llm.abort_request(reqs[3].request_id)
    while llm.step() is not None:
        pass
    assert llm.allocator.ref == [0] * llm.allocator.num_blocks and llm.allocator.cached
    outs, _ = run(llm)
    assert list(outs.values()) == list(run(build(target, draft_lm, "eagle3", False))[0].values())


def test_prompt_logprobs_requests_read_nothing_from_the_cache(target):
    """Their every prompt position is computed (as vLLM), and they query nothing."""
    params = SamplingParams(max_tokens=4, prompt_logprobs=2)
    outs = []
    for cache in (True, False):
        llm = make_llm(target, None, 0, True, enable_prefix_caching=cache)
        llm.generate(BATCHES[0][:1], max_tokens=4)
        outs.append(llm.generate(BATCHES[0][:1], params))
        assert not sum(s.prefix_cache_queries for s in llm.steps[-10:])
    assert outs[0][0].prompt_logprobs == outs[1][0].prompt_logprobs


@pytest.fixture(scope="module")
def qwen3_5_folder(tmp_path_factory):
    """A tiny Qwen3.5 (linear, full, linear attention) with its MTP layer, as transformers
    writes it."""
    import hf_qwen3_5
    return hf_qwen3_5.build_qwen3_5_mtp(tmp_path_factory.mktemp("qwen3_5") / "model")


def test_qwen3_next_hits_equal_no_cache(tmp_path):
    """Qwen3-Next (the fused gated-DeltaNet projections, MoE layers and MTP layer) through
    the same snapshots: tokens and drafts equal a run without the cache."""
    import hf_qwen3_5
    folder = hf_qwen3_5.build_qwen3_next_mtp(tmp_path / "qwen3_next")
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    cached, plain = (LLM(folder, spec, dtype=torch.float64, max_model_len=64, max_num_seqs=3,
                         max_num_batched_tokens=16, enable_prefix_caching=cache)
                     for cache in (True, False))
    assert run(cached) == run(plain)
    assert sum(s.prefix_cache_hits for s in cached.steps) >= 4 * BLOCK


@pytest.mark.parametrize("backend,overlap", [("eager", False), ("replay", False),
                                             ("replay", True)],
                         ids=["eager", "replay", "replay-async"])
@pytest.mark.parametrize("method", [None, "mtp"])
def test_hybrid_hits_restore_state_snapshots_and_equal_no_cache(qwen3_5_folder, method,
                                                                 backend, overlap):
    """Qwen3.5's linear-attention state cannot be rebuilt from K/V blocks: a hit restores the
    snapshot of the state staged at its last block's boundary (3 snapshot slots for the
    batches' prefixes, so older ones are evicted). Tokens and drafts equal a run that
    computes every prompt, greedy and seeded, with no host sync in a step; under async
    scheduling too (an overlapped step's staged state is never snapshotted)."""
    spec = method and {"method": method, "num_speculative_tokens": 2}

    def build(cache: bool) -> LLM:
        return LLM(qwen3_5_folder, spec, dtype=torch.float64, max_model_len=64,
                   max_num_seqs=3, max_num_batched_tokens=16, graph_backend=backend,
                   enable_prefix_caching=cache, check_host_syncs=True,
                   async_scheduling=overlap)
    cached, plain = build(True), build(False)
    assert cached.allocator.caching and cached.allocator.snapshots == 3
    assert run(cached) == run(plain)
    assert sum(s.prefix_cache_hits for s in cached.steps) >= 4 * BLOCK
    assert {s.host_syncs for s in cached.steps if s.num_reqs} == {0}


@pytest.mark.parametrize("backend,overlap", [("eager", False), ("replay", True)],
                         ids=["eager", "replay-async"])
@pytest.mark.parametrize("method", [None, "mtp"])
def test_a_hybrid_hit_reaches_into_the_earlier_reply(qwen3_5_folder, method, backend,
                                                     overlap):
    """Second turns (the first's prompt, its reply or the reply's first 14 tokens, a new
    message) hit past the first prompt's last block boundary: decode steps stage the state
    at the boundaries their accepted tokens cross (with MTP: verify steps, drafts
    included), under async scheduling too, where the reply's steps are continued before
    they are read and a later boundary's staging must not reach the earlier's snapshot.
    Their tokens and log-probabilities equal a run without the cache."""
    spec = method and {"method": method, "num_speculative_tokens": 2}
    first = COMMON + [1, 2, 3]  # 35 tokens: its last boundary is 32
    outs = []
    for cache in (True, False):
        llm = LLM(qwen3_5_folder, spec, dtype=torch.float64, max_model_len=96,
                  enable_prefix_caching=cache, graph_backend=backend,
                  async_scheduling=overlap)
        reply = llm.generate([first], SamplingParams(max_tokens=40, ignore_eos=True))[0]
        assert any(s.overlapped for s in llm.steps) == overlap
        seconds = [first + reply.token_ids[:14] + [4, 5, 6], first + reply.token_ids + [4]]
        greedy = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=0)
        outs.append([(o.token_ids, [t.logprob for t in o.logprobs])
                     for o in llm.generate(seconds, greedy)])
        hits = sum(s.prefix_cache_hits for s in llm.steps)
        # 48 of 52 (13 tokens of the reply; MTP's key reads one more) and 64 of 76
        assert hits == ((3 + 4) * BLOCK if cache else 0)
    for (ids, logprobs), (ids_plain, logprobs_plain) in zip(*outs):
        assert ids == ids_plain and logprobs == pytest.approx(logprobs_plain, abs=1e-4)


@pytest.fixture(scope="module")
def qwen3_5_cycle_folder(tmp_path_factory):
    """A tiny near-cycle Qwen3.5 whose MTP layer's drafts are often accepted."""
    import hf_qwen3_5
    return hf_qwen3_5.build_qwen3_5_mtp_cycle(tmp_path_factory.mktemp("qwen3_5") / "cycle")


def test_async_snapshots_skip_a_boundary_the_next_step_restages(qwen3_5_cycle_folder):
    """4-token blocks and 3-token MTP steps whose drafts are often accepted, under async
    scheduling: the step after a boundary's step, launched before it is read, may cross the
    next boundary and restage the row. Such a boundary gets no snapshot; the others do, and
    hits at every depth of the reply equal a run without the cache (tokens and
    log-probabilities)."""
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    first = COMMON[:10]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=0)
    outs, hits = [], []
    for cache in (True, False):
        llm = LLM(qwen3_5_cycle_folder, spec, dtype=torch.float64, max_model_len=64, block_size=4,
                  graph_backend="replay", async_scheduling=True, enable_prefix_caching=cache)
        reply = llm.generate([first], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        n = len(llm.steps)
        seconds = [first + reply.token_ids[:m] + [4] for m in range(3, 30, 3)]
        outs.append([(o.token_ids, [t.logprob for t in o.logprobs])
                     for o in llm.generate(seconds, greedy)])
        hits.append(sum(s.prefix_cache_hits for s in llm.steps[n:]))
    assert hits[1] == 0 and hits[0] > len(seconds) * len(first)  # into the replies
    for (ids, logprobs), (ids_plain, logprobs_plain) in zip(*outs):
        assert ids == ids_plain and logprobs == pytest.approx(logprobs_plain, abs=1e-4)


def test_a_failed_state_copy_leaves_no_snapshot_without_its_state(qwen3_5_folder,
                                                                   monkeypatch):
    """A step that fails while copying states (Ctrl-C, a device error) leaves those
    snapshots unused: a later hit on that prefix equals a run without the cache (a snapshot
    whose save never ran would restore a zero state)."""
    from specdec.engine.runner import ModelRunner
    prompt = COMMON + [1, 2, 3]  # 35 tokens; 14 more cross the boundary at 48 as it ends
    outs = []
    for cache in (True, False):
        llm = LLM(qwen3_5_folder, dtype=torch.float64, max_model_len=64,
                  enable_prefix_caching=cache)
        first = llm.add_request(prompt, SamplingParams(max_tokens=14, ignore_eos=True))
        while first.finish_reason is None:  # its finish registers a snapshot, saved next step
            llm.step()
        assert bool(llm.scheduler.state_saves) == cache
        copy = ModelRunner.copy_states

        def fail(self, saves, restores):
            monkeypatch.setattr(ModelRunner, "copy_states", copy)
            raise KeyboardInterrupt
        monkeypatch.setattr(ModelRunner, "copy_states", fail)
        other = llm.add_request([7, 8, 9], GREEDY)
        with pytest.raises(KeyboardInterrupt):
            llm.step()
        assert other.finish_reason == "error"
        second = prompt + first.output_token_ids + [5]  # its usable blocks end at 48
        outs.append(llm.generate([second], GREEDY)[0].token_ids)
    assert outs[0] == outs[1]


def test_extract_hidden_states_refuses_it_and_defaults_to_off(target, tmp_path):
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"output_dir": str(tmp_path),
                                   "eagle_aux_hidden_state_layer_ids": [1, 2]}}
    kw = dict(target=target, speculative_config=spec, dtype=torch.float64, max_model_len=64)
    with pytest.raises(ValueError, match="enable_prefix_caching=True: method="
                                         "'extract_hidden_states' saves"):
        LLM(**kw, enable_prefix_caching=True)
    llm = LLM(**kw)
    assert not llm.allocator.caching and "prefix caching off" in llm.startup


def test_on_by_default_and_a_bad_value_names_the_field(target):
    llm = make_llm(target, None, 0, True)
    assert llm.config.enable_prefix_caching is True and llm.allocator.caching
    assert llm.startup is None  # nothing to say at start-up
    with pytest.raises(TypeError, match="enable_prefix_caching"):
        make_llm(target, None, 0, True, enable_prefix_caching="yes")


@pytest.mark.parametrize("given,value", [([], None), (["--enable-prefix-caching"], True),
                                         (["--no-enable-prefix-caching"], False)])
def test_the_flag_reaches_every_command(given, value):
    """generate and serve pass it to LLM, bench serve --launch to the server it starts, bench
    to its engines (None: the flag not given, LLM's default)."""
    from specdec.bench import itl
    from specdec.bench import serve as bench_serve
    from specdec.bench.sweep import build_engines, expand
    from specdec.commands.cli import build_parser
    from specdec.flags import engine_kwargs
    parse = build_parser().parse_args
    for command in (["generate", "--prompt", "x"], ["serve"]):
        assert engine_kwargs(parse([*command, *given])).get("enable_prefix_caching") == value
    launch = parse(["bench", "serve", "--launch", *given])
    assert bench_serve.engine_flags(launch) == given
    sweep = itl.sweep_from_args(parse(["bench", "--methods", "none", "--concurrency", "1",
                                       "--prompt-len", "4", "--output-len", "2", *given]))
    engines, _ = build_engines(sweep, expand(sweep))
    (engine,) = engines.values()
    assert engine.kwargs["enable_prefix_caching"] is value
    assert engine.llm.config.enable_prefix_caching is (value is not False)


def test_metrics_count_prefix_cache_tokens_under_vllms_names():
    """Queries: the prompt tokens of requests looked up at admission; hits: those cached."""
    import httpx

    from specdec.entrypoints.serve import build_server_app
    from helpers import ServerThread, metrics
    llm = LLM(max_model_len=128, max_num_seqs=2)
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)" * 2
    n = len(llm.tokenizer.encode(prompt).ids)
    server = ServerThread(build_server_app(llm, "tiny"))
    try:
        for _ in range(2):
            httpx.post(f"{server.url}/v1/completions", json=dict(
                model="tiny", prompt=prompt, max_tokens=2), timeout=60)
        m = metrics(server.url)
    finally:
        server.close()
    lab = '{"engine": "0", "model_name": "tiny"}'
    assert m["vllm:prefix_cache_queries_total" + lab] == m["specdec:prefix_cache_queries_total"] \
        == 2 * n
    assert m["vllm:prefix_cache_hits_total" + lab] == m["specdec:prefix_cache_hits_total"] \
        == (n - 1) // BLOCK * BLOCK > 0


def test_each_data_parallel_rank_keeps_its_own_cache(target):
    """Rank 0 runs A+x then A+y (the second hits A), rank 1 A+z then B: A is cached on rank 0
    only, so rank 1's first request misses; the tokens equal one rank's without the cache."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    batch = [COMMON + [1, 2], COMMON + [3], COMMON + [4, 5], COMMON[::-1] + [6]]
    kw = dict(target=target, dtype=torch.float64, max_model_len=64, max_num_seqs=1)
    (run,) = run_data_parallel([DPJob(kw, batch, GREEDY, [[0, 1], [2, 3]])], 2, engine=LLM,
                               timeout=120)
    hits = [[s.prefix_cache_hits for s in rank.steps if s.prefix_cache_queries]
            for rank in run.ranks]
    assert hits == [[0, 2 * BLOCK], [0, 0]]
    plain = LLM(**kw, enable_prefix_caching=False).generate(batch, GREEDY)
    assert [o.token_ids for o in run.outputs] == [o.token_ids for o in plain]
