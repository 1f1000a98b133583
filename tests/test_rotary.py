"""specdec.models.layers.rotary against transformers 5.23 itself: for every rope type and
partial/interleaved layout, the normalised parameters of both config spellings, the inverse
frequencies, the cos/sin tables and the rotated q/k of the model's own ``rotary_emb`` module
and ``apply_rotary_pos_emb``; GPT-J and DeepSeek interleaving; refusals; no host reads."""

import copy

import pytest
import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3
from transformers.models.glm import modeling_glm
from transformers.models.llama import modeling_llama
from transformers.models.minimax_m2 import modeling_minimax_m2
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3_next import modeling_qwen3_next

from specdec.models.layers.rotary import ROPE_CONFIG_KEYS, RotaryEmbedding, rope_parameters
from specdec.syncs import forbid_host_sync

HEAD_DIM, MAX_POS, ORIGINAL = 64, 512, 64
COMMON = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=HEAD_DIM,
              max_position_embeddings=MAX_POS, rope_theta=1e4)

# name: (rope_scaling as a transformers-4 config.json writes it, other top-level keys)
TYPES = {
    "default": (None, {}),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL}, {}),
    "yarn": ({"type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL}, {}),
    "yarn_attention_factor": ({"rope_type": "yarn", "factor": 8.0, "attention_factor": 0.9,
                               "beta_fast": 16.0, "beta_slow": 2.0,
                               "original_max_position_embeddings": ORIGINAL}, {}),
    "yarn_mscale": ({"rope_type": "yarn", "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                     "truncate": False, "original_max_position_embeddings": ORIGINAL}, {}),
    # a top-level original_max_position_embeddings wins (transformers, at compute time)
    "yarn_top_level_original": ({"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": ORIGINAL},
                                {"original_max_position_embeddings": 32}),
}
# name: (config class, its rotary module, its modeling file, top-level keys, interleaved)
MODELS = {
    "llama": (transformers.LlamaConfig, modeling_llama.LlamaRotaryEmbedding, modeling_llama,
              {}, False),
    "qwen2": (transformers.Qwen2Config, modeling_qwen2.Qwen2RotaryEmbedding, modeling_qwen2,
              {}, False),
    "qwen3_next_partial_0.5": (transformers.Qwen3NextConfig,
                               modeling_qwen3_next.Qwen3NextRotaryEmbedding,
                               modeling_qwen3_next, {"partial_rotary_factor": 0.5}, False),
    "minimax_m2_rotary_dim_16": (transformers.MiniMaxM2Config,
                                 modeling_minimax_m2.MiniMaxM2RotaryEmbedding,
                                 modeling_minimax_m2, {"rotary_dim": 16}, False),
    "glm_partial_0.5_interleaved": (transformers.GlmConfig, modeling_glm.GlmRotaryEmbedding,
                                    modeling_glm, {"partial_rotary_factor": 0.5}, True),
}
CASES = [(m, t) for m in MODELS for t in TYPES if m != "qwen2" or t in ("default", "yarn")]
POSITIONS = [
    torch.arange(48).view(2, 24),  # all below original_max_position_embeddings
    torch.tensor([[0, 1, 63, 64, 65, 300, 511, 512],  # across it and max_position_embeddings
                  [513, 1000, 4095, 4096, 20000, 65535, 100000, 7]]),
]


def configs(model: str, case: str) -> tuple[dict, dict, transformers.PreTrainedConfig]:
    """(transformers-4 dict written by hand, transformers-5 dict that transformers saves,
    the transformers config)."""
    cls, _, _, extra, _ = MODELS[model]
    scaling, top = TYPES[case]
    t4 = dict(COMMON, **extra, **top, rope_scaling=scaling)
    config = cls(**copy.deepcopy(t4))  # transformers edits the dicts it is given
    return t4, config.to_dict(), config


def hf_layout(rope) -> tuple[torch.Tensor, torch.Tensor]:
    """A Rope's tables as transformers holds them: [B, T, R] cat((c, c)), cat((s, s))."""
    cos, sin = rope.cos.squeeze(-2), rope.sin.squeeze(-2)
    if rope.interleaved:  # [c0, c0, c1, c1, ..], [-s0, s0, -s1, s1, ..]
        assert torch.equal(cos[..., 0::2], cos[..., 1::2])
        assert torch.equal(sin[..., 0::2], -sin[..., 1::2])
        cos, sin = cos[..., 0::2], sin[..., 1::2]
    else:  # [c, c], [-s, s]
        half = cos.shape[-1] // 2
        assert torch.equal(cos[..., :half], cos[..., half:])
        assert torch.equal(sin[..., :half], -sin[..., half:])
        cos, sin = cos[..., :half], sin[..., half:]
    return torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)


@pytest.mark.parametrize("model,case", CASES)
def test_both_spellings_normalise_alike(model, case):
    t4, t5, _ = configs(model, case)
    assert "rope_parameters" in t5 and "rope_scaling" not in t5
    params = rope_parameters(t4)
    assert params == rope_parameters(t5)
    assert params["rope_type"] == case.split("_")[0]
    assert params.get("partial_rotary_factor", 1.0) == {
        "qwen3_next_partial_0.5": 0.5, "minimax_m2_rotary_dim_16": 0.25,
        "glm_partial_0.5_interleaved": 0.5}.get(model, 1.0)


def test_normalised_form():
    assert rope_parameters({"rope_theta": 5e5, "rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "mscale": None,
        "rope_type": "yarn"}}) == {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                   "original_max_position_embeddings": 32768}
    llama31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert rope_parameters({"rope_theta": 5e5, "rope_scaling": llama31}) == \
        rope_parameters({"rope_parameters": dict(llama31, rope_theta=5e5)}) == \
        dict(llama31, rope_theta=5e5)
    # harmless: echoes, original_max_position_embeddings where the type ignores it
    assert rope_parameters({"rope_scaling": {"type": "linear", "rope_type": "linear", "factor": 2,
                                             "original_max_position_embeddings": 100}}) == \
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2}
    assert rope_parameters({"rope_scaling": None, "max_position_embeddings": 8}) == \
        {"rope_type": "default", "rope_theta": 10000.0}
    assert rope_parameters({"rope_scaling": {"rope_type": "yarn", "factor": 2.0},
                            "max_position_embeddings": 8})["original_max_position_embeddings"] == 8
    assert {"rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor",
            "rotary_dim"} <= ROPE_CONFIG_KEYS


@pytest.mark.parametrize("model,case", CASES)
def test_tables_and_rotation_equal_transformers(model, case):
    _, t5, config = configs(model, case)
    _, rotary_cls, modeling, _, interleaved = MODELS[model]
    ours = RotaryEmbedding(HEAD_DIM, rope_parameters(t5), MAX_POS, interleaved=interleaved)
    for positions in POSITIONS:
        hf = rotary_cls(config)
        torch.testing.assert_close(ours.inv_freq("cpu"), hf.original_inv_freq, rtol=1e-6, atol=0)
        assert ours.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)
        cos, sin = hf(torch.zeros(()), positions)
        rope = ours.tables(positions, torch.float32)
        assert rope.cos.shape == (*positions.shape, 1, ours.rotary_dim)
        torch.testing.assert_close(hf_layout(rope), (cos, sin), rtol=0, atol=1e-6)
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(2, h, positions.shape[-1], HEAD_DIM, generator=g) for h in (3, 1))
        want = modeling.apply_rotary_pos_emb(q, k, cos, sin)
        for x, hf_x in zip((q, k), want):  # ours: [B, T, H, D], a strided view here
            got = rope.apply(x.transpose(1, 2)).transpose(1, 2)
            torch.testing.assert_close(got, hf_x, rtol=1e-6, atol=1e-6)


def test_interleaved_is_gptj_pairs():
    """Pairs (2j, 2j+1) turn by pos * theta^(-2j/R); channels R.. pass through."""
    emb = RotaryEmbedding(16, {"rope_theta": 100.0, "partial_rotary_factor": 0.5},
                          interleaved=True)
    pos = torch.tensor([0, 3, 50])
    x = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = x.clone()
    for j in range(4):
        a = (pos * 100.0 ** (-2 * j / 8))[:, None]
        x0, x1 = x[..., 2 * j], x[..., 2 * j + 1]
        want[..., 2 * j] = x0 * a.cos() - x1 * a.sin()
        want[..., 2 * j + 1] = x1 * a.cos() + x0 * a.sin()
    got = emb.tables(pos, torch.float64).apply(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # float32 angles
    assert torch.equal(got[..., 8:], x[..., 8:])


def test_interleaved_equals_deepseek_v3_up_to_its_channel_order():
    """transformers' DeepSeek-V3 writes the rotated pairs de-interleaved (evens, then odds);
    the same permutation of q and k, so q.k (attention) is the same."""
    config = transformers.DeepseekV3Config(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=2, qk_rope_head_dim=16,
        max_position_embeddings=MAX_POS, rope_theta=1e4,
        rope_scaling={"type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                      "beta_fast": 32, "beta_slow": 1,
                      "original_max_position_embeddings": ORIGINAL})
    ours = RotaryEmbedding(16, rope_parameters(config.to_dict()), MAX_POS, interleaved=True)
    positions = POSITIONS[1]
    cos, sin = modeling_deepseek_v3.DeepseekV3RotaryEmbedding(config)(torch.zeros(()), positions)
    rope = ours.tables(positions, torch.float32)
    torch.testing.assert_close(hf_layout(rope), (cos, sin), rtol=0, atol=1e-6)
    q, k = (torch.randn(2, 2, positions.shape[-1], 16, generator=torch.Generator().manual_seed(h))
            for h in range(2))
    want = modeling_deepseek_v3.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    order = torch.cat((torch.arange(0, 16, 2), torch.arange(1, 16, 2)))
    for x, hf_x in zip((q, k), want):
        got = rope.apply(x.transpose(1, 2)).transpose(1, 2)
        torch.testing.assert_close(got[..., order], hf_x, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config,match", [
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}},
     r"rope_parameters\.rope_type='mrope'.*default, linear, llama3, yarn, longrope"),
    ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}},
     r"rope_type='proportional'"),
    # dynamic NTK would make a request's tokens depend on its batch: refused, with why
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
     r"rope_type='dynamic' is refused: .*largest position in the batch"),
])
def test_unknown_rope_type_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        rope_parameters(config)


@pytest.mark.parametrize("config,match", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "short_factor": [1.0]}},
     r"rope_scaling\.short_factor=\[1\.0\] is not read by rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [8, 12]}},
     r"rope_parameters\.mrope_section=\[8, 12\] is not read by rope_type='default'"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "attention_factor": 0.5}},
     r"attention_factor=0\.5 is not read by rope_type='linear'"),
    ({"rope_scaling": {"rope_type": "default", "factor": 2.0}},
     r"rope_scaling\.factor=2\.0 is not read by rope_type='default'"),
])
def test_unused_key_that_changes_the_math_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        rope_parameters(config)


@pytest.mark.parametrize("config,match", [
    ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling\.factor is required"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "2"}}, r"rope_scaling\.factor='2'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}},
     r"original_max_position_embeddings is required"),
    ({"rope_scaling": {"type": "yarn", "rope_type": "linear", "factor": 2.0}}, r"disagree"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_theta": 5e5}}, r"rope_theta.*disagree"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0},
      "rope_parameters": {"rope_type": "linear", "factor": 4.0}}, r"disagree"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1\.5"),
    ({"rotary_dim": 16, "head_dim": 64, "partial_rotary_factor": 0.5}, r"disagree"),
    ({"rotary_dim": 30, "head_dim": 44}, r"rotary_dim=30 with head_dim=44.*29"),
])
def test_inconsistent_or_incomplete_config_is_refused(config, match):
    with pytest.raises(ValueError, match=match):
        rope_parameters(config)


def test_odd_rotary_dim_is_refused():
    with pytest.raises(ValueError, match="rotary_dim=3"):
        RotaryEmbedding(10, {"rope_theta": 1e4, "partial_rotary_factor": 0.3})


@pytest.mark.parametrize("case", TYPES)
def test_tables_read_nothing_back_from_the_device(case):
    """Every type is built with device ops only: no
    host read under specdec.syncs' guard, and it runs on meta tensors (which hold no data)."""
    _, t5, _ = configs("llama", case)
    for device in ("cpu", "meta"):
        emb = RotaryEmbedding(HEAD_DIM, rope_parameters(t5), MAX_POS)
        positions = POSITIONS[1].to(device)
        with forbid_host_sync():
            rope = emb.tables(positions, torch.bfloat16)
        assert rope.cos.device.type == device and rope.cos.dtype == torch.bfloat16


def test_inv_freq_is_kept_except_while_capturing(monkeypatch):
    emb = RotaryEmbedding(HEAD_DIM, {"rope_theta": 1e4})
    with monkeypatch.context() as m:
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert emb.inv_freq("cpu") is not emb.inv_freq("cpu")
    assert emb.inv_freq("cpu") is emb.inv_freq("cpu")
