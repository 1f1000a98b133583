"""Tiny random Qwen3.5 (text) models built and saved by transformers (the reference specdec
must match), with the MTP layer ``mtp.*`` of the published checkpoint added.

``build_qwen3_5(path)``: hidden 64, 3 layers ``[linear, full, linear]`` (``layer_types``),
gated attention 4 heads / 2 kv heads of 16 (partial rotary 0.25 -> 4 channels), gated
DeltaNet 2 key heads / 4 value heads of 16 (grouped), conv kernel 4; ``A_log`` and
``dt_bias`` random; sharded. ``_interval``: no ``layer_types`` (4 layers,
``full_attention_interval`` 2). ``_mtp``: plus ``mtp.{fc [H, 2H], pre_fc_norm_embedding,
pre_fc_norm_hidden, norm, layers.0.*}`` (a full-attention decoder layer) in an extra shard,
``mtp_num_hidden_layers`` 1 in the config.
"""

from __future__ import annotations

from pathlib import Path

import hf_models as H
import torch

QWEN3_5 = dict(vocab_size=H.VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6,
               max_position_embeddings=256, tie_word_embeddings=False,
               layer_types=["linear_attention", "full_attention", "linear_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25},
               bos_token_id=H.QWEN_BOS, eos_token_id=H.QWEN_EOS)


def _deltanet_params(model, gen) -> None:
    """``dt_bias`` is ones at init: make it matter; ``A_log`` stays transformers' random."""
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def build_qwen3_5(path, **overrides) -> Path:
    return H._build(path, "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", post=_deltanet_params,
                    **{**QWEN3_5, **overrides})


def build_qwen3_5_interval(path) -> Path:
    path = build_qwen3_5(path, num_hidden_layers=4, layer_types=None, full_attention_interval=2)
    cfg = H.read_config(path)
    assert cfg.pop("layer_types") == ["linear_attention", "full_attention"] * 2
    H.write_config(path, {**cfg, "full_attention_interval": 2})
    return path


def mtp_tensors(path) -> dict[str, torch.Tensor]:
    """Seeded random ``mtp.*`` tensors for the target at ``path``: its full-attention layer's
    names and shapes under ``mtp.layers.0.`` plus fc, the two pre-fc norms and the final norm
    (zero-centred norms: ``N(0, 0.1)``)."""
    from safetensors import safe_open

    cfg = H.read_config(path)
    full = cfg["layer_types"].index("full_attention")
    src = f"model.layers.{full}."
    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()
                           if k.startswith(src)})
    gen = torch.Generator().manual_seed(H.SEED + 11)
    h = cfg["hidden_size"]
    out = {}
    for name, shape in sorted(shapes.items()):
        new = "mtp.layers.0." + name[len(src):]
        scale = 0.1 if name.endswith("norm.weight") else H.INIT_RANGE
        out[new] = scale * torch.randn(shape, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=gen)
    out["mtp.fc.weight"] = H.INIT_RANGE * torch.randn(h, 2 * h, generator=gen)
    return out


def build_qwen3_5_mtp(path) -> Path:
    path = build_qwen3_5(path)
    H.add_shard(path, mtp_tensors(path))
    H.write_config(path, {**H.read_config(path), "mtp_num_hidden_layers": 1})
    return path


BUILDERS = {"qwen3_5": build_qwen3_5, "qwen3_5_interval": build_qwen3_5_interval,
            "qwen3_5_mtp": build_qwen3_5_mtp}
