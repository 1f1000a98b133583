"""Qwen3.5 and Qwen3-Next (gated DeltaNet linear attention + gated full attention, zero-centred
norms, partial rotary; Qwen3-Next: fused DeltaNet projections, MoE with a gated shared expert):
specdec equals transformers on tiny random models transformers itself wrote
(``hf_qwen3_5``) -- greedy tokens through ``LLM`` with the prefill chunked at several sizes
(the linear layers' state slots carry the recurrence across chunks), logits of the dense and
the paged path -- the cache spec says paged KV for full attention and state slots for linear
attention, and what is not implemented is refused by name."""

import hf_models as H
from helpers import folder_builder
import hf_qwen3_5 as Q
import pytest
import torch

from specdec import LLM
from specdec.attention import AttentionMetadata, KVCache, KVCacheSpec
from specdec.linear_state import LinearStateSpec
from specdec.models import load_model

MAX_NEW = 32
TOL = 1e-4
_gen = torch.Generator().manual_seed(20240607)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (5, 17, 40)]
LOGIT_PROMPT = torch.randint(3, 500, (80,), generator=_gen).tolist()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="session")
def q35_dir(tmp_path_factory):
    return folder_builder(Q.BUILDERS, tmp_path_factory)


@pytest.fixture(scope="session")
def q35_reference(q35_dir):
    return H.reference_cache(
        lambda name: (Q.hf_vl_model if name == "qwen3_5_vl" else H.hf_model)(q35_dir(name)),
        PROMPTS, MAX_NEW, LOGIT_PROMPT)


@pytest.mark.parametrize("case,chunk", [("qwen3_5", 256), ("qwen3_5", 7), ("qwen3_5", 16),
                                        ("qwen3_5_interval", 256), ("qwen3_next", 256),
                                        ("qwen3_next", 7), ("qwen3_5_vl", 7)])
def test_greedy_tokens_match_transformers(case, chunk, q35_dir, q35_reference):
    """``chunk`` = max_num_batched_tokens: 7 and 16 split the 17- and 40-token prompts into
    chunks that share steps with other requests' decodes."""
    llm = LLM(model=str(q35_dir(case)), max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=chunk)
    got = [o.token_ids for o in llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)]
    assert got == q35_reference(case)["tokens"]
    assert max(s.num_tokens for s in llm.steps) <= chunk


@pytest.mark.parametrize("case", ["qwen3_5", "qwen3_5_interval", "qwen3_next", "qwen3_5_vl"])
def test_last_logits_match_transformers(case, q35_dir, q35_reference):
    model = load_model(q35_dir(case))
    ids = torch.tensor(LOGIT_PROMPT)
    with torch.inference_mode():
        hidden, _ = model(ids[None, :], torch.arange(len(ids))[None, :])
        logits = model.compute_logits(hidden[0, -1])
    diff = (logits - q35_reference(case)["logits"]).abs().max().item()
    assert diff <= TOL, f"{case}: max |dlogit| {diff:.3g}"


@pytest.mark.parametrize("chunk", [7, 32, 80])
def test_paged_prefill_in_chunks_matches_the_dense_path(chunk, q35_dir):
    """One 80-token prompt fed in chunks through the paged cache (request row 0; each chunk
    starts from the state slot the previous one wrote) equals the dense forward at every
    position, up to float32 rounding: the dense path runs the DeltaNet in chunks of 64, the
    paged one its first token one by one and the rest in chunks of what is left."""
    model = load_model(q35_dir("qwen3_5"))
    ids, n = torch.tensor(LOGIT_PROMPT), len(LOGIT_PROMPT)
    cache = KVCache(model.kv_cache_spec(), 6, 16, torch.float32, "cpu", state_rows=2)
    outs = []
    with torch.inference_mode():
        dense, _ = model(ids[None], torch.arange(n)[None])
        for lo in range(0, n, chunk):
            hi = min(lo + chunk, n)
            meta = AttentionMetadata(
                slot_mapping=torch.arange(lo, hi), block_table=torch.arange(6)[None].int(),
                query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
                seq_lens=torch.tensor([hi], dtype=torch.int32), max_seq_len=hi,
                rows=torch.tensor([0], dtype=torch.int32))
            out, _ = model(ids[lo:hi], torch.arange(lo, hi), kv=cache.bind(meta))
            outs.append(out)
    torch.testing.assert_close(torch.cat(outs), dense[0], rtol=5 * TOL, atol=5 * TOL)


def test_cache_spec_is_paged_kv_for_full_and_state_slots_for_linear_layers(q35_dir):
    """Layers [linear, full, linear]: K and V of 2 heads x 16 per token for the full layer (256
    bytes float32), per request slot (4 - 1) * 128 conv values + 4 x 16 x 16 state values
    (5632 bytes) for each linear layer; the engine plans 1 + K slots per request row."""
    from specdec.engine.config import EngineConfig

    model = load_model(q35_dir("qwen3_5"))
    specs = model.kv_cache_spec()
    state = LinearStateSpec(conv_dim=128, conv_kernel=4, num_heads=4, key_dim=16,
                            value_dim=16)
    assert specs == [state, KVCacheSpec(2, 16), state]
    assert state.bytes_per_slot() == 4 * (3 * 128 + 4 * 16 * 16) == 5632
    assert sum(s.bytes_per_token(torch.float32) for s in specs) == 2 * 2 * 16 * 4
    cfg = EngineConfig(256, 4, 256, 16, "float32", "cpu", 0, None, 1, False, 1, 600.0)
    assert cfg.kv_cache_bytes(specs, state_slots=3) - cfg.kv_cache_bytes(specs) == \
        (4 + 1) * 2 * 2 * 5632


def test_the_published_multimodal_layout_runs_its_text_model_and_mtp_layer(q35_dir,
                                                                         q35_reference):
    """``Qwen3_5ForConditionalGeneration`` (text_config with mrope keys, ``model.language_
    model.*``, a vision tower, ``mtp.*``): the text model loads (the vision tower unread), and
    MTP K=2 found in the same folder gives transformers' greedy tokens."""
    path = q35_dir("qwen3_5_vl")
    model = load_model(path)
    assert model.config.layer_types[1] == "full_attention"
    llm = LLM(model=str(path), max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert type(llm.runner.proposer.head).__name__ == "Qwen3_5MtpHead"
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == q35_reference("qwen3_5_vl")["tokens"]


# ---- refusals ----------------------------------------------------------------------------
def _edit(src, dst, edit):
    path = H.copy_folder(src, dst)
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    return path


@pytest.mark.parametrize("what,edit,match", [
    ("the MoE variant", lambda c: c.update(architectures=["Qwen3_5MoeForCausalLM"]),
     "Qwen3_5MoeForCausalLM.*not supported"),
    ("multimodal rope on the text architecture", lambda c: c["rope_parameters"].update(
        mrope_section=[1, 1, 0]), "mrope_section"),
    ("Qwen3.5 tensors as Qwen3-Next", lambda c: c.update(architectures=[
        "Qwen3NextForCausalLM"]), "missing tensors.*in_proj_qkvz"),
    ("ungated attention", lambda c: c.update(attn_output_gate=False), "attn_output_gate"),
    ("own MTP embedding", lambda c: c.update(mtp_use_dedicated_embeddings=True),
     "mtp_use_dedicated_embeddings"),
    ("a DeltaNet shape", lambda c: c.update(linear_key_head_dim=0), "linear_key_head_dim"),
    ("linear layers in a Llama", lambda c: [c.pop(k) for k in list(c) if k.startswith(
        "linear_")] + [c.update(architectures=["LlamaForCausalLM"])], "linear_attention"),
])
def test_refuses_what_is_not_implemented_naming_it(what, edit, match, q35_dir, tmp_path):
    path = _edit(q35_dir("qwen3_5"), tmp_path / "m", edit)
    with pytest.raises(ValueError, match=match):
        load_model(path)


# ---- the MTP layer (mtp.* of the target folder) ------------------------------------------------
@pytest.mark.parametrize("case", ["qwen3_5_mtp", "qwen3_next_mtp"])
def test_mtp_draft_logits_equal_transformers_layer_plus_mtp_math(case, q35_dir):
    """The target loader skips ``mtp.*``; the head reads only them (embedding and lm_head are
    the target's) and equals the reference assembled from transformers' decoder layer
    (Qwen3-Next's: with its MoE), at every position of a 40-token sequence."""
    from specdec.models.heads import load_head as load_qwen3_5_mtp
    from specdec.models.layers.moe import MoEMLP

    path = q35_dir(case)
    target = load_model(path)
    head = load_qwen3_5_mtp(path, target)
    ids = torch.tensor(PROMPTS[2])
    pos = torch.arange(len(ids))
    nxt = torch.cat([ids[1:], ids[:1]])
    with torch.inference_mode():
        hidden, _ = target(ids[None], pos[None])
        out, nxt_hidden = head(nxt[None], pos[None], hidden)
        got = head.compute_logits(out[0])
    want = Q.hf_mtp_reference(path, nxt, hidden[0], pos)
    assert (got - want).abs().max().item() <= TOL
    assert nxt_hidden is out  # the normed output is also the next step's hidden
    assert head.kv_cache_spec() == [KVCacheSpec(2, 16)]
    assert isinstance(head.mtp.layers[0].mlp, MoEMLP) == (case == "qwen3_next_mtp")


@pytest.mark.parametrize("ragged", [False, True])
def test_qwen3_next_mtp_speculative_greedy_equals_plain(ragged, q35_dir):
    """Qwen3-Next's MTP layer (a MoE) found in the target folder; K=2."""
    path = str(q35_dir("qwen3_next_mtp"))
    want = [o.token_ids for o in LLM(model=path, max_num_seqs=4, max_model_len=256).generate(
        PROMPTS, max_tokens=16, ignore_eos=True)]
    llm = LLM(model=path, max_num_seqs=4, max_model_len=256,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                  "disable_padded_drafter_batch": ragged})
    assert type(llm.runner.proposer.head).__name__ == "Qwen3_5MtpHead"
    outs = llm.generate(PROMPTS, max_tokens=16, ignore_eos=True)
    assert [o.token_ids for o in outs] == want and sum(sum(o.num_drafted) for o in outs) > 0


@pytest.mark.parametrize("tree,key", [
    ({"method": "mtp", "num_speculative_tokens": 2,
      "speculative_token_tree": [(0,), (1,), (0, 0)]}, "speculative_token_tree"),
    ({"method": "mtp", "num_speculative_tokens": 2, "tree_topk": 2, "num_draft_tokens": 4},
     "tree_topk"),
    ({"method": "suffix", "num_draft_tokens": 5}, "num_draft_tokens")])
def test_a_hybrid_model_refuses_draft_trees_by_name(q35_dir, tree, key):
    """Qwen3.5's linear-attention state is kept per chain position: every kind of draft tree
    is refused, naming the key given and the reason."""
    with pytest.raises(ValueError, match=rf"^{key}=.* with Qwen3_5ForCausalLM: its linear-"
                                         "attention layers keep one recurrent state per draft"):
        LLM(model=str(q35_dir("qwen3_5_mtp")), max_num_seqs=4, max_model_len=256,
            speculative_config=tree)


def test_mtp_refuses_more_than_one_layer(q35_dir, tmp_path):
    path = _edit(q35_dir("qwen3_5_mtp"), tmp_path / "m",
                 lambda c: c.update(mtp_num_hidden_layers=2))
    with pytest.raises(ValueError, match="mtp_num_hidden_layers=2"):
        LLM(model=str(path), max_num_seqs=4, max_model_len=256,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})


@pytest.fixture(scope="session")
def cycle_plain(q35_dir):
    return [o.token_ids for o in LLM(model=str(q35_dir("qwen3_5_mtp_cycle")), max_num_seqs=4,
                                     max_model_len=256).generate(PROMPTS, max_tokens=MAX_NEW,
                                                                 ignore_eos=True)]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("ragged", [False, True])
def test_mtp_speculative_greedy_equals_plain(k, ragged, q35_dir, cycle_plain):
    """A near-cycle target with an MTP layer that predicts the exact cycle: drafts are right
    at some positions and wrong at others, so every step rolls the DeltaNet state back to a
    different slot; the tokens are plain greedy's. The MTP layer is found in the target
    folder (no speculative_config.model); the padded step runs with 0 host syncs."""
    llm = LLM(model=str(q35_dir("qwen3_5_mtp_cycle")), max_num_seqs=4, max_model_len=256,
              check_host_syncs=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": k,
                                  "disable_padded_drafter_batch": ragged})
    assert type(llm.runner.proposer.head).__name__ == "Qwen3_5MtpHead"
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == cycle_plain
    accepted, drafted = (sum(sum(getattr(o, f)) for o in outs)
                         for f in ("num_accepted", "num_drafted"))
    assert 0 < accepted < drafted / 2 and drafted > 0
    if not ragged:
        assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}


@pytest.mark.parametrize("backend", ["eager", "replay"])
def test_async_scheduling_on_the_hybrid_target_equals_plain(backend, q35_dir, cycle_plain):
    """MTP K=2 with async scheduling: a decode launched before the host read rolls each row's
    DeltaNet state back on the device from the step before, as the synchronous step does:
    plain greedy's tokens, most decodes overlapped."""
    llm = LLM(model=str(q35_dir("qwen3_5_mtp_cycle")), max_num_seqs=4, max_model_len=256,
              graph_backend=backend, async_scheduling=True, check_host_syncs=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == cycle_plain
    steps = [s for s in llm.steps if s.num_reqs]
    assert sum(s.overlapped for s in steps) > len(steps) // 2
    assert {s.host_syncs for s in steps} == {0}


@pytest.mark.parametrize("ragged", [False, True])
def test_ngram_on_the_hybrid_target_equals_plain(ragged, q35_dir, cycle_plain):
    """ngram on a near-cycle target: 0..K drafts per request, padded with filler tokens
    whose recurrent states land in slots past the accepted ones and never become current;
    the tokens are plain greedy's, and some drafts were accepted, some rejected."""
    llm = LLM(model=str(q35_dir("qwen3_5_mtp_cycle")), max_num_seqs=4, max_model_len=256,
              check_host_syncs=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                                  "disable_padded_drafter_batch": ragged})
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == cycle_plain
    accepted, drafted = (sum(sum(getattr(o, f)) for o in outs)
                         for f in ("num_accepted", "num_drafted"))
    assert 0 < accepted < drafted


def _row_state(llm, row: int) -> list[torch.Tensor]:
    """Every linear layer's (conv, ssm) state at the row's current slot."""
    state = llm.runner.kv.state
    slot = row * state.num_slots + int(state.current[row])
    return [t[slot] for i in sorted(state.ssm) for t in (state.conv[i], state.ssm[i])]


@pytest.mark.parametrize("k", [1, 3])
def test_a_request_whose_drafts_are_all_rejected_has_the_state_of_plain_decoding(k, q35_dir):
    """A random MTP layer: no draft is ever accepted. After the same tokens, the request's
    current slot holds the state plain decoding holds (conv window and recurrent state of
    every linear layer) -- the rejected drafts' updates are gone -- though the slots after
    the drafts were written. Equal up to float32 rounding (1e-5: the projections run over
    1 + K rows instead of 1, a different GEMM); a missed rollback differs by O(1)."""
    path = str(q35_dir("qwen3_5_mtp"))
    plain = LLM(model=path, max_num_seqs=1, max_model_len=256)
    want = plain.generate([PROMPTS[1]], max_tokens=12, ignore_eos=True)[0].token_ids
    spec = LLM(model=path, max_num_seqs=1, max_model_len=256,
               speculative_config={"method": "mtp", "num_speculative_tokens": k})
    out = spec.generate([PROMPTS[1]], max_tokens=12, ignore_eos=True)[0]
    assert out.token_ids == want and sum(out.num_accepted) == 0 < sum(out.num_drafted)
    assert int(spec.runner.kv.state.current[0]) == 0
    for a, b in zip(_row_state(spec, 0), _row_state(plain, 0), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the drafts did update the other slots: a rollback, not a skipped write
    s = spec.runner.kv.state
    layer = min(s.ssm)
    assert (s.ssm[layer][1] - s.ssm[layer][0]).abs().max() > 1e-3


# ---- captured steps ------------------------------------------------------------------------------
SECOND = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (9, 3, 30, 12)]


@pytest.mark.parametrize("backend", ["replay", "compile"])
def test_captured_padded_step_equals_eager_without_recompiling(backend, q35_dir, cycle_plain):
    """MTP K=2 with the target step and the padded draft step through ``backend`` (compile:
    dynamo tracing with ``compile_backend="eager"``, as test_graphs: inductor's codegen is too
    slow for a CPU test): plain greedy's tokens; once every bucket ran, a run of 4 new prompts
    replays the captured target step 50+ times with no new dynamo graph."""
    from torch._dynamo import utils as dynamo_utils

    path = str(q35_dir("qwen3_5_mtp_cycle"))
    llm = LLM(model=path, max_num_seqs=4, max_model_len=256, graph_backend=backend,
              compile_backend="eager" if backend == "compile" else None, check_host_syncs=True,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == cycle_plain
    for n in (1, 2):  # warm up the buckets of 1 and 2 requests too (capture sizes 1, 2, 4)
        llm.generate(PROMPTS[:n], max_tokens=4, ignore_eos=True)
    plain = LLM(model=path, max_num_seqs=4, max_model_len=256)
    want = [o.token_ids for o in plain.generate(SECOND, max_tokens=60, ignore_eos=True)]
    target = llm.runner.target_graph
    graphs, calls = dynamo_utils.counters["stats"]["unique_graphs"], target.calls
    outs = llm.generate(SECOND, max_tokens=60, ignore_eos=True)
    assert [o.token_ids for o in outs] == want
    assert 0 < sum(sum(o.num_accepted) for o in outs) < sum(sum(o.num_drafted) for o in outs)
    assert target.calls - calls >= 50
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    assert {s.host_syncs for s in llm.steps if s.num_reqs} == {0}


# ---- extract_hidden_states on the hybrid model ---------------------------------------------------
AUX = [0, 1, 2]  # the inputs of layers 0-2: embeddings, after a linear layer, after a full one


def _extract_kwargs(path, out, **kw) -> dict:
    return dict(model=str(path), max_num_seqs=4, max_model_len=256, **kw,
                speculative_config={"method": "extract_hidden_states",
                                    "num_speculative_tokens": 1,
                                    "draft_model_config": {
                                        "eagle_aux_hidden_state_layer_ids": AUX,
                                        "output_dir": str(out)}})


@pytest.fixture(scope="module")
def extracted(q35_dir, tmp_path_factory):
    """Files of an unchunked run and of a run with a 7-token budget (the 40-token prompt in 6
    chunks, sharing steps with the other requests)."""
    dirs = {}
    for budget in (256, 7):
        out = tmp_path_factory.mktemp(f"hidden{budget}")
        llm = LLM(**_extract_kwargs(q35_dir("qwen3_5"), out, max_num_batched_tokens=budget))
        llm.generate(PROMPTS, max_tokens=4, ignore_eos=True)
        assert max(s.num_tokens for s in llm.steps) <= budget
        dirs[budget] = out
    return dirs


def _files(out) -> list[dict]:
    from safetensors.torch import load_file
    assert sorted(p.name for p in out.iterdir()) == [f"{i}.safetensors"
                                                     for i in range(len(PROMPTS))]
    return [load_file(str(out / f"{i}.safetensors")) for i in range(len(PROMPTS))]


def test_extract_files_equal_for_chunked_and_unchunked_prefill(extracted, q35_dir):
    """Both runs' files hold [T, 3, H] states equal to each other and to the dense forward's
    aux states (a chunked prefill carries the DeltaNet state across its chunks), up to float32
    rounding: the residual stream reaches ~90 here, so 1e-3 absolute is ~1e-5 of it (the
    projections run over other token groupings, the DeltaNet one by one or in chunks)."""
    model = load_model(q35_dir("qwen3_5"))
    for prompt, whole, chunked in zip(PROMPTS, _files(extracted[256]), _files(extracted[7])):
        assert whole["token_ids"].tolist() == chunked["token_ids"].tolist() == prompt
        assert chunked["hidden_states"].shape == (len(prompt), len(AUX), 64)
        torch.testing.assert_close(chunked["hidden_states"], whole["hidden_states"],
                                   rtol=TOL, atol=10 * TOL)
        with torch.inference_mode():
            _, aux = model(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                           aux_layer_ids=tuple(AUX))
        torch.testing.assert_close(chunked["hidden_states"], aux[0], rtol=TOL, atol=10 * TOL)


def test_extract_dp2_with_an_idle_rank_equals_dp1(extracted, q35_dir, tmp_path):
    """DP=2, one rank never gets a request (its dummy steps run the hybrid target on the
    trash state row): no hang, the same collectives on both ranks, the files of DP=1."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    from specdec.engine.sequence import SamplingParams

    job = DPJob(_extract_kwargs(q35_dir("qwen3_5"), tmp_path), PROMPTS,
                SamplingParams(max_tokens=4, ignore_eos=True), [[0, 1, 2], []])
    run, = run_data_parallel([job], 2, engine=LLM, timeout=240)
    busy, idle = run.ranks
    assert all(s.num_reqs == 0 for s in idle.steps) and len(idle.steps) == len(busy.steps)
    assert idle.collectives == busy.collectives
    for one, two in zip(_files(extracted[256]), _files(tmp_path)):
        assert one["token_ids"].tolist() == two["token_ids"].tolist()
        torch.testing.assert_close(two["hidden_states"], one["hidden_states"], rtol=1e-6,
                                   atol=1e-6)


def test_rollback_matches_transformers_snapshot_and_restore(q35_dir):
    """Verification steps [t, d1, d2] (K = 2) against transformers' own model and cache. The
    reference snapshots its cache (deepcopy) before each step and, after greedy acceptance,
    restores it and feeds the accepted tokens again; specdec feeds the 1 + K tokens once and
    only moves the row's state slot (``KVCache.accept``). Drafts are right or wrong by a fixed
    pattern (0, 1 or 2 accepted); the verification logits agree at every step."""
    import copy

    from transformers import DynamicCache

    path = q35_dir("qwen3_5")
    hf, model = H.hf_model(path), load_model(path)
    prompt = PROMPTS[1]
    greedy = H.hf_greedy(path, [prompt], 40, model=hf)[0]
    cache = KVCache(model.kv_cache_spec(), 8, 16, torch.float32, "cpu", state_rows=2,
                    state_slots=3)
    ref_cache = DynamicCache(config=hf.config)
    row, i32 = torch.tensor([0], dtype=torch.int32), torch.int32

    def specdec_step(ids: list[int], start: int, drafts: int) -> torch.Tensor:
        n = len(ids)
        pos = torch.arange(start, start + n)
        meta = AttentionMetadata(
            slot_mapping=pos, query_start_loc=torch.tensor([0, n], dtype=i32),
            seq_lens=torch.tensor([start + n], dtype=i32), block_table=torch.arange(8)[None].int(),
            max_seq_len=start + n, rows=row, num_draft_tokens=torch.tensor([drafts], dtype=i32),
            max_query_len=n)
        hidden, _ = model(torch.tensor(ids), pos, kv=cache.bind(meta))
        return model.compute_logits(hidden)

    with torch.inference_mode():
        ref = hf(torch.tensor([prompt]), past_key_values=ref_cache, use_cache=True).logits[0]
        got = specdec_step(prompt, 0, 0)
        torch.testing.assert_close(got[-1], ref[-1], rtol=TOL, atol=TOL)
        t, pos, done, accepted = int(got[-1].argmax()), len(prompt), 1, []
        cache.accept(row, torch.tensor([[t, -1, -1]], dtype=i32))
        for step in range(10):
            right = greedy[done:done + 2]
            drafts = [right[0] if step % 3 else 7, right[1] if step % 2 else 9]
            snapshot = copy.deepcopy(ref_cache)
            ref = hf(torch.tensor([[t] + drafts]), past_key_values=ref_cache,
                     use_cache=True).logits[0]
            got = specdec_step([t] + drafts, pos, 2)
            torch.testing.assert_close(got, ref, rtol=TOL, atol=TOL)
            argmax = got.argmax(-1).tolist()
            a = 0
            while a < 2 and drafts[a] == argmax[a]:
                a += 1
            new = drafts[:a] + [argmax[a]]
            assert new == greedy[done:done + a + 1]
            cache.accept(row, torch.tensor([new + [-1] * (2 - a)], dtype=i32))
            ref_cache = snapshot  # restore, then feed what was accepted
            hf(torch.tensor([[t] + drafts[:a]]), past_key_values=ref_cache, use_cache=True)
            t, pos, done = new[-1], pos + 1 + a, done + a + 1
            accepted.append(a)
    assert set(accepted) == {0, 1, 2}


def test_sampled_speculative_decoding_is_the_same_padded_and_ragged(q35_dir):
    """Rejection sampling (T 0.8, seeded: counter-based random numbers) on the hybrid target:
    padded and ragged drafting give the same tokens and acceptance, with drafts accepted and
    rejected. (The state slots follow ``sampled`` exactly as under greedy verification, which
    the greedy tests check against plain decoding.)"""
    path = str(q35_dir("qwen3_5_mtp_cycle"))
    runs = []
    for ragged in (False, True):
        llm = LLM(model=path, max_num_seqs=4, max_model_len=256,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2,
                                      "disable_padded_drafter_batch": ragged})
        outs = llm.generate(PROMPTS, max_tokens=24, temperature=0.8, seed=7, ignore_eos=True)
        runs.append([(o.token_ids, o.num_accepted) for o in outs])
    assert runs[0] == runs[1]
    accepted = sum(sum(acc) for _, acc in runs[0])
    assert 0 < accepted < 2 * sum(len(ids) for ids, _ in runs[0]) / 3


@pytest.mark.parametrize("ragged,backend", [(False, None), (True, None), (False, "replay")])
def test_prefill_chunks_share_steps_with_verifying_requests(ragged, backend, q35_dir):
    """A 16-token budget with K = 3: prefill chunks of the 40- and 70-token prompts run in the
    same steps as requests verifying drafts (the DeltaNet takes each row's first 1 + K tokens
    one by one, a chunk's rest in the chunked form); tokens equal plain greedy's. Through
    ``replay`` those mixed steps are captured too (max_query_len = Np in their graphs)."""
    path = str(q35_dir("qwen3_5_mtp_cycle"))
    prompts = PROMPTS + [torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(3)
                                       ).tolist()]
    want = [o.token_ids for o in LLM(model=path, max_num_seqs=4, max_model_len=256).generate(
        prompts, max_tokens=24, ignore_eos=True)]
    llm = LLM(model=path, max_num_seqs=4, max_model_len=256, max_num_batched_tokens=16,
              graph_backend=backend,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3,
                                  "disable_padded_drafter_batch": ragged})
    outs = llm.generate(prompts, max_tokens=24, ignore_eos=True)
    assert [o.token_ids for o in outs] == want
    assert sum(sum(o.num_accepted) for o in outs) > 0
    mixed = [s for s in llm.steps if s.num_reqs > 1 and s.num_tokens not in (
        s.num_reqs, s.num_reqs * 4)]
    assert len(mixed) >= 3
    assert all(s.captured for s in mixed) == (backend == "replay")
