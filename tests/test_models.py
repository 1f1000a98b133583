"""Target model and draft heads: checkpoint layouts, round trips, causality, the kv contract."""

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specdec.models.heads import (Eagle3Head, EagleHead, MtpHead, build_head, head_config,
                                  load_head)
from specdec.models.config import Family, ModelConfig
from specdec.models.layers.rotary import RotaryEmbedding
from specdec.models.llama import LlamaForCausalLM, Qwen2ForCausalLM
from specdec.models.registry import load_pretrained

from helpers import tiny_config, tiny_model, tiny_model_head, ReferenceKV, head_inputs


# ---------------------------------------------------------------- config


def test_config_hf_round_trip_and_defaults():
    c = tiny_config(rope_theta=5e5, tie_word_embeddings=True)
    d = c.to_hf_dict(LlamaForCausalLM)
    assert d["model_type"] == "llama" and d["hidden_act"] == "silu" and d["head_dim"] == 8
    assert ModelConfig.from_dict(json.loads(json.dumps(d))) == c


def test_config_of_no_family_is_not_saved():
    """No silent model_type: a config is written through its family class."""
    with pytest.raises(ValueError, match="MODEL_TYPE"):
        tiny_config().to_hf_dict(Family)


def test_qwen2_config_implies_qkv_bias():
    d = dict(tiny_config().to_hf_dict(LlamaForCausalLM), architectures=["Qwen2ForCausalLM"])
    c = ModelConfig.from_dict(d, Qwen2ForCausalLM)
    assert c.attention_bias and c.to_hf_dict(Qwen2ForCausalLM)["model_type"] == "qwen2"
    assert "attention_bias" not in c.to_hf_dict(Qwen2ForCausalLM)
    names = set(Qwen2ForCausalLM(c).state_dict())
    assert "model.layers.0.self_attn.q_proj.bias" in names
    assert "model.layers.0.self_attn.o_proj.bias" not in names


@pytest.mark.parametrize("change, field", [
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(torch_dtype="int8"), "torch_dtype"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_scaling={"rope_type": "foo", "factor": 2.0}), "rope_type"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    (dict(sliding_window=0), "sliding_window"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_config_validation_names_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dict(dict(tiny_config().to_hf_dict(LlamaForCausalLM), **change))


def test_config_missing_key_is_named():
    d = tiny_config().to_hf_dict(LlamaForCausalLM)
    del d["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict(d)


# ---------------------------------------------------------------- target model


def test_target_parameter_names_are_hf():
    names = set(tiny_model().state_dict())
    per_layer = {f"model.layers.{i}.{n}" for i in range(4) for n in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")}
    assert names == per_layer | {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}


@pytest.mark.parametrize("save_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_save_load_round_trip_is_bit_exact(tmp_path, save_dtype):
    model = tiny_model()
    model.save_pretrained(tmp_path, dtype=save_dtype)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == str(save_dtype)[6:]
    loaded = load_pretrained(tmp_path, dtype=torch.float32)
    assert replace(loaded.config, torch_dtype=model.config.torch_dtype) == model.config
    for name, t in model.state_dict().items():
        got = loaded.state_dict()[name]
        assert got.dtype == torch.float32
        assert torch.equal(got, t.to(save_dtype).float()), name


def test_tied_embeddings_save_without_lm_head(tmp_path):
    model = tiny_model(tie_word_embeddings=True)
    model.save_pretrained(tmp_path, dtype=torch.float32)
    loaded = load_pretrained(tmp_path)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_unknown_and_missing_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny_model().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.9.extra.weight"] = torch.zeros(1)
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*model\.layers\.9\.extra\.weight"):
        load_pretrained(tmp_path)


def test_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    tiny_model().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(5, dtype=torch.float16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.norm\.weight: got \(5,\) != expected \(32,\)"):
        load_pretrained(tmp_path)


def test_rope_position_zero_is_identity_and_scores_are_relative():
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    def apply_rope(x, pos):
        return RotaryEmbedding.default(16, 1e4).tables(torch.tensor([pos]), x.dtype).apply(x)
    assert torch.equal(apply_rope(q, 0), q)

    def score(pq, pk):
        return (apply_rope(q, pq) * apply_rope(k, pk)).sum(-1)
    torch.testing.assert_close(score(7, 3), score(14, 10))


@given(t=st.integers(2, 12), cut=st.integers(1, 11), seed=st.integers(0, 3))
def test_dense_forward_is_causal(t, cut, seed):
    cut = min(cut, t - 1)
    model = tiny_model(seed)
    ids = torch.randint(0, 61, (2, t), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        full, full_aux = model(ids, torch.arange(t), aux_layer_ids=(1, 3))
        pre, pre_aux = model(ids[:, :cut], torch.arange(cut), aux_layer_ids=(1, 3))
    torch.testing.assert_close(pre, full[:, :cut], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre_aux, full_aux[:, :cut], rtol=1e-5, atol=1e-5)


def test_aux_layer0_is_the_embedding_and_last_hidden_is_normed_stream():
    model = tiny_model()
    ids = torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        hidden, aux = model(ids, torch.arange(5), aux_layer_ids=(0, 2))
        assert aux.shape == (2, 5, 2, 32)
        assert torch.equal(aux[:, :, 0], model.model.embed_tokens(ids))
        x = model.model.embed_tokens(ids)
        for layer in model.model.layers[:2]:
            x = layer(x, model.rope(torch.arange(5), x.dtype))
        torch.testing.assert_close(aux[:, :, 1], x)
    assert model(ids, torch.arange(5))[1] is None
    with pytest.raises(ValueError, match="aux_layer_ids"):
        model(ids, torch.arange(5), aux_layer_ids=(4,))


@given(t=st.integers(1, 10), chunk=st.integers(1, 4), seed=st.integers(0, 3))
def test_kv_contract_matches_dense(t, chunk, seed):
    """Feeding chunks through a kv object gives the dense forward's hidden states."""
    model = tiny_model(seed, attention_bias=False)
    ids = torch.randint(0, 61, (t,), generator=torch.Generator().manual_seed(seed))
    kv, outs, auxs = ReferenceKV(), [], []
    with torch.no_grad():
        dense, dense_aux = model(ids[None], torch.arange(t), aux_layer_ids=(2,))
        for s in range(0, t, chunk):
            h, a = model(ids[s:s + chunk], torch.arange(s, min(s + chunk, t)), kv, aux_layer_ids=(2,))
            outs.append(h)
            auxs.append(a)
    torch.testing.assert_close(torch.cat(outs), dense[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat(auxs), dense_aux[0], rtol=1e-4, atol=1e-5)


def test_qwen2_target_kv_matches_dense():
    d = dict(tiny_config().to_hf_dict(LlamaForCausalLM), architectures=["Qwen2ForCausalLM"])
    c = ModelConfig.from_dict(d, Qwen2ForCausalLM)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(c).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_()
        ids = torch.randint(0, 61, (6,))
        dense, _ = model(ids[None], torch.arange(6))
        kv = ReferenceKV()
        step = torch.cat([model(ids[i:i + 1], torch.arange(i, i + 1), kv)[0] for i in range(6)])
    torch.testing.assert_close(step, dense[0], rtol=1e-4, atol=1e-5)


def test_compute_logits_is_float32():
    model = tiny_model().to(torch.bfloat16)
    hidden, _ = model(torch.randint(0, 61, (1, 3)), torch.arange(3))
    assert hidden.dtype == torch.bfloat16 and model.compute_logits(hidden).dtype == torch.float32


# ---------------------------------------------------------------- heads

LAYER = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight", "post_attention_layernorm.weight"}
LAYOUTS = {
    "mtp": {f"model.mtp_layers.0.{n}" for n in LAYER | {
        "input_layernorm.weight", "token_layernorm.weight", "hidden_layernorm.weight",
        "input_proj.weight", "final_layernorm.weight", "self_attn.q_proj.bias",
        "self_attn.k_proj.bias", "self_attn.v_proj.bias"}} | {"model.embed_tokens.weight", "lm_head.weight"},
    "eagle": {f"layers.0.{n}" for n in LAYER} | {"fc.weight"},
    "eagle3": {f"midlayer.{n}" for n in LAYER | {"input_layernorm.weight", "hidden_norm.weight"}}
    | {"fc.weight", "norm.weight", "lm_head.weight", "d2t"},
}
SHAPES = {"mtp": {"model.mtp_layers.0.input_proj.weight": (32, 64)},
          "eagle": {"fc.weight": (32, 64)},
          "eagle3": {"fc.weight": (32, 96), "midlayer.self_attn.q_proj.weight": (32, 64),
                     "midlayer.self_attn.k_proj.weight": (16, 64), "lm_head.weight": (40, 32),
                     "d2t": (40,)}}
CLASSES = {"mtp": MtpHead, "eagle": EagleHead, "eagle3": Eagle3Head}
ARCHS = {"mtp": "MiMoForCausalLM", "eagle": "LlamaForCausalLM", "eagle3": "LlamaForCausalLMEagle3"}


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_head_layout_and_round_trip(tmp_path, method):
    from safetensors.torch import load_file
    target = tiny_model()
    head = tiny_model_head(method, target)
    head.save_pretrained(tmp_path, torch.float16)
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == LAYOUTS[method]
    for name, shape in SHAPES[method].items():
        assert tuple(tensors[name].shape) == shape, name
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [ARCHS[method]] and config["num_hidden_layers"] == 1
    if method == "mtp":
        assert config["num_nextn_predict_layers"] == 1
        assert torch.equal(tensors["lm_head.weight"], target.lm_head.weight.half())
    if method == "eagle3":
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and config["draft_vocab_size"] == 40
        assert tensors["d2t"].dtype == torch.int64
    loaded = load_head(tmp_path, target)
    assert type(loaded) is CLASSES[method]
    for name, t in head.state_dict().items():
        expect = t.half().float() if t.is_floating_point() else t
        assert torch.equal(loaded.state_dict()[name], expect), name


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_head_rejects_unknown_tensor(tmp_path, method):
    from safetensors.torch import load_file, save_file
    target = tiny_model()
    tiny_model_head(method, target).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["layers.0.input_layernorm.weight"] = torch.ones(32, dtype=torch.float16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"unexpected tensors \['layers\.0\.input_layernorm\.weight'\]"):
        load_head(tmp_path, target)


def test_head_must_match_target_sizes(tmp_path):
    tiny_model_head("eagle", tiny_model()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hidden_size/vocab_size"):
        load_head(tmp_path, tiny_model(vocab_size=62))


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_head_kv_matches_dense_and_chains(method):
    """Token-by-token through a kv object == dense causal; a 2-step chain reuses next_hidden."""
    target = tiny_model()
    head = tiny_model_head(method, target)
    ids = torch.randint(0, 61, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = head.combine_hidden_states(head_inputs(method, target, ids))
        assert hidden.shape == (1, 7, 32)
        dense_lh, dense_next = head(ids, torch.arange(7), hidden)
        kv, lhs = ReferenceKV(), []
        for i in range(7):
            lh, nxt = head(ids[0, i:i + 1], torch.arange(i, i + 1), hidden[0, i:i + 1], kv)
            lhs.append(lh)
        torch.testing.assert_close(torch.cat(lhs), dense_lh[0], rtol=1e-4, atol=1e-5)
        # step 2 from the last slot: same as a dense run over the sequence extended by one
        draft = head.draft_to_target_ids(head.compute_logits(lh).argmax(-1))
        lh2, _ = head(draft, torch.tensor([7]), nxt, kv)
        ext_hidden = torch.cat((hidden, nxt[None]), dim=1)
        dense2, _ = head(torch.cat((ids, draft[None]), dim=1), torch.arange(8), ext_hidden)
        torch.testing.assert_close(lh2[0], dense2[0, -1], rtol=1e-4, atol=1e-5)
    logits = head.compute_logits(dense_lh)
    assert logits.dtype == torch.float32 and logits.shape[-1] == head.draft_vocab_size


def test_logits_hidden_vs_next_hidden_per_layout():
    target = tiny_model()
    ids = torch.randint(0, 61, (1, 5))
    with torch.no_grad():
        for method in ("mtp", "eagle"):  # one output for logits and the next step
            head = tiny_model_head(method, target)
            a, b = head(ids, torch.arange(5), torch.randn(1, 5, 32))
            assert torch.equal(a, b)
        head = tiny_model_head("eagle3", target)  # logits from norm(next_hidden)
        a, b = head(ids, torch.arange(5), torch.randn(1, 5, 32))
        torch.testing.assert_close(a, head.norm(b))


def test_mtp_zeroes_the_embedding_at_position_zero():
    target = tiny_model()
    head = tiny_model_head("mtp", target)
    hidden = torch.randn(1, 1, 32)
    with torch.no_grad():
        outs = [head(torch.tensor([[tok]]), torch.tensor([0]), hidden)[0] for tok in (3, 17)]
        assert torch.equal(outs[0], outs[1])
        moved = [head(torch.tensor([[tok]]), torch.tensor([1]), hidden)[0] for tok in (3, 17)]
        assert not torch.equal(moved[0], moved[1])


def test_eagle3_combine_accepts_stacked_or_flat_aux():
    head = tiny_model_head("eagle3", tiny_model())
    aux = torch.randn(4, 3, 32)
    torch.testing.assert_close(head.combine_hidden_states(aux), head.combine_hidden_states(aux.flatten(-2)))
    torch.testing.assert_close(head.combine_hidden_states(aux), aux.flatten(-2) @ head.fc.weight.T)
    with pytest.raises(ValueError, match="combine_hidden_states"):
        head.combine_hidden_states(torch.randn(4, 2, 32))


def test_d2t_maps_draft_to_target_ids():
    target = tiny_model()
    head = tiny_model_head("eagle3", target)
    with torch.no_grad():
        head.d2t.zero_()
        head.d2t[1:3] = 4
    assert head.draft_to_target_ids(torch.tensor([0, 1, 2])).tolist() == [0, 5, 6]
    full = build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[1, 2, 3])
    assert not hasattr(full, "d2t") and full.draft_vocab_size == 61
    assert full.draft_to_target_ids(torch.tensor([60])).tolist() == [60]
    assert build_head("eagle", target).draft_to_target_ids(torch.tensor([7])).tolist() == [7]


def test_eagle3_config_validation():
    target = tiny_model()
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids"):
        build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[1, 2, 4])
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_head("eagle3", target, eagle_aux_hidden_state_layer_ids=[1, 2, 3], draft_vocab_size=99)
    with pytest.raises(ValueError, match="method"):
        head_config("medusa", target)
