"""Gemma-2, Gemma-3 (text) and Phi-3 against transformers: greedy tokens (3 prompts x 32 tokens,
every prompt longer than the Gemma window and than Phi-3's original_max_position_embeddings),
last-position logits within 1e-4; the reference moves when a family feature is dropped; the
soft cap in the Triton paged attention kernel (interpreted) equals the torch path, down to a
whole Gemma-2 forward through the paged cache; greedy ngram speculation equals plain decoding;
the transformers-5 spelling of each config reads as the Hub's; refusals name their key.

Tiny models (``hf_models.build_gemma2`` / ``build_gemma3`` / ``build_phi3``): hidden 64, 2-4
layers, float32, saved by transformers in the published layout (sharded or one file, the Hub's
config.json spelling).
"""

import json

import pytest
import torch

from specdec import LLM, kernels
from specdec.attention import AttentionMetadata, KVCache
from specdec.kernels import paged_attention_torch as ref
from specdec.models import load_model
from specdec.models.config import ModelConfig
from specdec.models.layers.rotary import RotaryEmbedding
from specdec.models.registry import model_class

import hf_models as H

FAMILIES = ["gemma2", "gemma3", "phi3"]
MAX_NEW = 32
TOL = 1e-4
_gen = torch.Generator().manual_seed(38)
PROMPTS = [torch.randint(3, 500, (n,), generator=_gen).tolist() for n in (37, 45, 60)]
LOGIT_PROMPT = torch.randint(3, 500, (70,), generator=_gen).tolist()
assert min(map(len, PROMPTS)) > max(H.GEMMA_WINDOW, H.PHI3_ORIGINAL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """name -> its tiny model's folder, built once."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = H.build(name, tmp_path_factory.mktemp(name) / "model")
        return cache[name]
    return get


@pytest.fixture(scope="module")
def reference(folder):
    """name -> transformers' greedy tokens for PROMPTS, last logits for LOGIT_PROMPT and its
    layer types."""
    return H.reference_cache(lambda name: H.hf_model(folder(name)), PROMPTS, MAX_NEW,
                             LOGIT_PROMPT, lambda model: {"layer_types": getattr(
                                 model.config, "layer_types", None)})


def dense_last_logits(model, prompt) -> torch.Tensor:
    ids = torch.tensor(prompt)
    with torch.inference_mode():
        hidden, _ = model(ids[None], torch.arange(len(ids))[None])
        return model.compute_logits(hidden[0, -1])


# ---- against transformers ------------------------------------------------------------------
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_tokens_and_logits_match_transformers(name, folder, reference):
    path, want = folder(name), reference(name)
    model = load_model(path)
    assert model.config.layer_types == want["layer_types"]  # Gemma: rebuilt from the pattern
    diff = (dense_last_logits(model, LOGIT_PROMPT) - want["logits"]).abs().max().item()
    assert diff <= TOL, f"{name}: max |dlogit| {diff:.3g} > {TOL}"
    outs = LLM(model=str(path), max_num_seqs=4, max_model_len=256).generate(
        PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    for i, (o, w) in enumerate(zip(outs, want["tokens"])):
        assert o.token_ids == w, f"{name}: prompt {i} (len {len(PROMPTS[i])}) diverges"


def test_folders_are_laid_out_as_published(folder):
    assert len(H.shard_files(folder("gemma2"))) >= 2 and len(H.shard_files(folder("phi3"))) >= 2
    assert H.shard_files(folder("gemma3")) == []  # gemma-3-1b: one model.safetensors
    names = set(H.tensor_names(folder("phi3")))
    assert {"model.layers.0.self_attn.qkv_proj.weight",
            "model.layers.0.mlp.gate_up_proj.weight"} <= names
    assert "model.layers.0.self_attn.q_proj.weight" not in names
    for name in ("gemma2", "gemma3"):
        cfg = H.read_config(folder(name))
        assert "layer_types" not in cfg and "rope_theta" in cfg  # the Hub's spelling
        assert "lm_head.weight" not in H.tensor_names(folder(name))  # tied


def _set(**keys):
    return lambda cfg: cfg.update(keys)


MUTATIONS = {  # what a loader could get wrong -> (family, config edit)
    "attention soft cap ignored": ("gemma2", _set(attn_logit_softcapping=None)),
    "final soft cap ignored": ("gemma2", _set(final_logit_softcapping=None)),
    "query_pre_attn_scalar ignored": ("gemma2", _set(query_pre_attn_scalar=16)),
    "sliding window ignored": ("gemma2", _set(sliding_window=256, sliding_window_size=256)),
    "local rope ignored": ("gemma3", _set(rope_local_base_freq=1000000.0)),
    "global rope scaling ignored": ("gemma3", _set(rope_scaling=None)),
    "long factors ignored": ("phi3", _set(original_max_position_embeddings=256)),
}


@pytest.mark.parametrize("what", list(MUTATIONS))
def test_reference_is_sensitive_to_the_family_feature(what, folder, reference, tmp_path):
    """Dropping the feature moves transformers' logits by >> TOL: a loader ignoring it fails."""
    name, edit = MUTATIONS[what]
    path = H.copy_folder(folder(name), tmp_path / "mutated")
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    diff = (H.hf_last_logits(path, LOGIT_PROMPT) - reference(name)["logits"]).abs().max()
    assert diff > 100 * TOL, f"{name} with {what}: logits move only {diff:.3g}"


# ---- rotary: longrope and the rope per layer type ------------------------------------------------
@pytest.mark.parametrize("max_pos", [256, H.PHI3_ORIGINAL])
def test_longrope_tables_equal_transformers(max_pos, folder):
    """Extended (max_position_embeddings > original): the long factors and sqrt(1 + ln 8 /
    ln 32); not extended: the short factors, attention factor 1 (transformers' rotary module
    over positions past / within the original length)."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    cfg = {**H.read_config(folder("phi3")), "max_position_embeddings": max_pos}
    config = ModelConfig.from_dict(cfg, model_class(cfg["architectures"]))
    rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)
    hf = Phi3RotaryEmbedding(Phi3Config(**cfg))
    positions = torch.arange(max_pos)[None]  # past the original length iff extended
    cos, sin = hf(torch.zeros(()), positions)  # [1, T, D]: sin as [s, s]
    tables = rotary.tables(positions, torch.float32)  # [1, T, 1, D]: sin as [-s, s]
    half = config.head_dim // 2
    torch.testing.assert_close(tables.cos[0, :, 0], cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(tables.sin[0, :, 0, half:], sin[0, :, half:], rtol=0, atol=1e-6)
    assert rotary.attention_factor == pytest.approx(hf.attention_scaling)
    assert (rotary.attention_factor > 1) == (max_pos > H.PHI3_ORIGINAL)


def test_gemma3_rope_per_layer_type(folder):
    model = load_model(folder("gemma3"))
    c = model.config
    assert c.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                             "sliding_attention"]
    local = {"rope_type": "default", "rope_theta": 10000.0}
    full = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}
    assert [c.rope_of(i) for i in range(4)] == [local, local, full, local]
    ropes = model.layer_ropes(torch.arange(5), torch.float32)
    assert ropes[0] is ropes[1] is ropes[3] and ropes[2] is not ropes[0]  # one table per type
    assert [s.sliding_window for s in model.kv_cache_spec()] == [8, 8, None, 8]


def test_transformers5_spelling_reads_as_the_hubs(folder):
    """The config.json transformers 5 writes (``layer_types``, ``rope_parameters`` nested by
    layer type for Gemma-3, ``_sliding_window_pattern``) gives the same model config, and
    ``to_hf_dict`` writes it back."""
    def ropes(config):  # transformers 5 names the default partial_rotary_factor
        return [{"partial_rotary_factor": 1.0, **config.rope_of(i)}
                for i in range(config.num_hidden_layers)]

    for name in FAMILIES:
        hub = load_model(folder(name)).config
        cls = model_class(hub.architectures)
        t5 = json.loads(H.hf_model(folder(name)).config.to_json_string())
        c = cls(ModelConfig.from_dict(t5, cls)).config
        assert c.layer_types == hub.layer_types and c.sliding_window == hub.sliding_window
        assert ropes(c) == ropes(hub)
        assert ropes(cls(ModelConfig.from_dict(c.to_hf_dict(cls), cls)).config) == \
            ropes(c)


# ---- the Triton paged attention kernel, interpreted ----------------------------------------------
@pytest.fixture(scope="module")
def triton_attention():
    pytest.importorskip("triton")
    from triton_interpret import load_interpreted
    return load_interpreted("triton_paged_attention")


def _layout(seed: int, chunks=(2, 1)):
    """Requests of ``chunks`` tokens after 9 and 5 cached keys (the last is a decode), in
    scattered blocks of 4, then one padding token: q [N, 4, 16] over 1 KV head (the
    interpreter runs N programs: few), caches, metadata. Scores reach ~10: caps bite."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + cached for c, cached in zip(chunks, (9, 5))]
    table = torch.randperm(8, generator=g).to(torch.int32).view(2, 4)
    qsl = torch.tensor([0, *chunks], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    k_cache, v_cache = (torch.randn(8 * 4 + 1, 1, 16, generator=g) for _ in range(2))
    q = torch.randn(sum(chunks) + 1, 4, 16, generator=g) * 3
    return q, k_cache, v_cache, qsl, torch.tensor(seq_lens, dtype=torch.int32), table


@pytest.mark.parametrize("softcap,scale,window", [(2.0, None, None), (0.5, 0.3, 5)])
def test_triton_softcap_equals_torch(triton_attention, softcap, scale, window):
    """The interpreted kernel equals the torch path, which the cap changes."""
    q, k_cache, v_cache, qsl, seq_lens, table = _layout(seed=7)
    got, want, uncapped = (impl.paged_attention(q, k_cache, v_cache, impl.plan_paged_attention(
        qsl, seq_lens, table, q.shape[0], int(seq_lens.max()), 4), sliding_window=window,
        scale=scale, softcap=cap) for impl, cap in ((triton_attention, softcap), (ref, softcap),
                                                   (ref, None)))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert (uncapped - want).abs().max() > 1e-2


def test_one_compiled_kernel_for_every_softcap(triton_attention):
    from triton_interpret import compile_cache_keys, launch_args

    q, k_cache, v_cache, qsl, seq_lens, table = _layout(seed=1, chunks=(0, 1))
    q = q[:1]
    plan = triton_attention.plan_paged_attention(qsl, seq_lens, table, 1, 0, 4)
    kernel = triton_attention._paged_attention_kernel
    calls = launch_args(kernel, lambda c: triton_attention.paged_attention(
        q, k_cache, v_cache, plan, softcap=c), [None, 1.0, 16.0, 50.0])
    assert len(set(compile_cache_keys(kernel, calls))) == 1


@pytest.mark.parametrize("softcap", [0, -1.0, True, "50"])
def test_bad_softcap_is_rejected(softcap):
    q, k_cache, v_cache, qsl, seq_lens, table = _layout(seed=1)
    plan = ref.plan_paged_attention(qsl, seq_lens, table, q.shape[0], 11, 4)
    with pytest.raises(ValueError, match="softcap"):
        ref.paged_attention(q, k_cache, v_cache, plan, softcap=softcap)


def test_gemma2_decode_through_the_triton_kernel(triton_attention, folder, monkeypatch):
    """Gemma-2 (soft caps, scale, windowed layers): a 12-token prefill on the torch path, then
    a decode through the paged cache with the interpreted Triton kernel (the dispatched call a
    GPU makes): the last logits of both steps equal the dense forward's within TOL."""
    model = load_model(folder("gemma2"))
    ids, table = PROMPTS[0][:13], torch.arange(2, dtype=torch.int32)[None]
    cache = KVCache(model.kv_cache_spec(), 2, 16, torch.float32, "cpu")
    for start, end in ((0, 12), (12, 13)):
        if start:  # the decode: the dispatched kernels, interpreted
            monkeypatch.setattr(kernels, "plan_paged_attention",
                                triton_attention.plan_paged_attention)
            monkeypatch.setattr(kernels, "paged_attention", triton_attention.paged_attention)
            cache.torch_attention = False  # (a GPU keeps the torch path until verified)
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end), max_seq_len=end, block_table=table,
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32))
        with torch.inference_mode():
            hidden, _ = model(torch.tensor(ids[start:end]), torch.arange(start, end),
                              kv=cache.bind(meta))
            got = model.compute_logits(hidden[-1])
        diff = (got - dense_last_logits(model, ids[:end])).abs().max().item()
        assert diff <= TOL, f"tokens {start}..{end}: max |dlogit| {diff:.3g}"


# ---- speculative decoding ----------------------------------------------------------------------
def test_ngram_speculation_equals_plain_greedy(folder, reference):
    """Gemma-2 (soft caps, windows) with padded ngram drafts: transformers' greedy tokens, with
    drafts accepted."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    llm = LLM(model=str(folder("gemma2")), speculative_config=spec, max_num_seqs=4,
              max_model_len=256)
    outs = llm.generate(PROMPTS, max_tokens=MAX_NEW, ignore_eos=True)
    assert [o.token_ids for o in outs] == reference("gemma2")["tokens"]
    assert sum(sum(o.num_accepted) for o in outs) > 0


def test_phi3_on_two_tensor_parallel_ranks_equals_transformers(folder, reference):
    """Phi-3's fused qkv_proj / gate_up_proj read as each rank's rows of their parts (longrope
    tables, the sliding window): transformers' greedy tokens on TP=2."""
    from specdec.engine.dp_engine import DPJob, run_data_parallel
    from specdec.engine.sequence import SamplingParams

    job = DPJob(dict(model=str(folder("phi3")), max_num_seqs=4, max_model_len=256,
                     tensor_parallel_size=2), PROMPTS,
                SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    run, = run_data_parallel([job], 1, engine=LLM, tp_size=2, timeout=240)
    assert [o.token_ids for o in run.outputs] == reference("phi3")["tokens"]


# ---- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,edit,key", [
    ("gemma2", _set(hidden_activation="gelu"), "hidden_activation"),
    ("gemma2", _set(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", _set(sliding_window_size=16), "sliding_window_size"),
    ("gemma2", _set(attn_logit_softcapping=-1.0), "attn_logit_softcapping"),
    ("gemma3", _set(rope_parameters={"full_attention": {"rope_type": "default"},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 5.0}},
                    rope_theta=None, rope_scaling=None), "rope_local_base_freq"),
    ("gemma3", _set(sliding_window_pattern=0), "sliding_window_pattern"),
    ("phi3", _set(rope_scaling={"type": "longrope", "short_factor": [1.0] * 4,
                                "long_factor": [1.0] * 8}), "short_factor"),
])
def test_refusals_name_the_key(name, edit, key, folder, tmp_path):
    path = H.copy_folder(folder(name), tmp_path / "m")
    cfg = H.read_config(path)
    edit(cfg)
    H.write_config(path, cfg)
    with pytest.raises(ValueError, match=key):
        load_model(path)


def test_phi3_without_original_max_position_embeddings_takes_transformers_default(folder,
                                                                                  tmp_path):
    """Left out, longrope's original length is Phi3Config's default 4096 (``HF_DEFAULTS``),
    as transformers reads the file."""
    path = H.copy_folder(folder("phi3"), tmp_path / "m")
    cfg = H.read_config(path)
    del cfg["original_max_position_embeddings"]
    H.write_config(path, cfg)
    assert load_model(path).config.rope["original_max_position_embeddings"] == 4096

