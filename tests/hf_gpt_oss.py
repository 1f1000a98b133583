"""Tiny random gpt-oss models (``GptOssForCausalLM``) built and saved by transformers (the
reference specdec must match) in the published layouts: experts stacked in bf16-copy form
(``gate_up_proj [E, H, 2I]`` ...), or MXFP4 (``*_blocks`` / ``*_scales``, quantized here
from the same weights, ``quantization_config: {"quant_method": "mxfp4"}``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

import hf_models as H

WINDOW = 8  # sliding_window (128 on the Hub)
# gpt-oss-20b's keys with the shapes shrunk: 3 layers sliding / full / sliding, 4 experts of
# 64 (H and I multiples of MXFP4's 32-value blocks), top-2, swiglu_limit 1.0 (7.0 on the Hub)
# so the clamps bite at these scales, YaRN from 64 positions to 256
GPT_OSS = dict(vocab_size=H.VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
               swiglu_limit=1.0, max_position_embeddings=256, rms_norm_eps=1e-5,
               tie_word_embeddings=False, bos_token_id=2, eos_token_id=1, pad_token_id=0,
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 64})
EXPERTS = re.compile(r".*\.mlp\.experts\.(gate_up_proj|down_proj)")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _random_extras(model, gen) -> None:
    """Sinks and expert biases (transformers leaves them at zero or tiny) drawn large enough
    to matter."""
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith("_proj_bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def build(path) -> Path:
    """The bf16-copy layout, config.json as the Hub writes it (``experts_per_token``,
    ``initial_context_length``, no ``swiglu_alpha``: its default)."""
    path = H._build(path, "GptOssConfig", "GptOssForCausalLM", sharded=False,
                    post=_random_extras, **GPT_OSS)
    config = H.read_config(path)
    config.pop("swiglu_alpha")
    H.write_config(path, {**config, "experts_per_token": 2, "initial_context_length": 64})
    return path


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, in, out] float (the bf16-copy layout) -> (blocks [E, out, in/32, 16] uint8,
    scales [E, out, in/32] uint8), the published layout: per 32 values along ``in`` one e8m0
    scale ``2 ** (s - 127)`` with the block's largest magnitude at most 6 * 2 ** (s - 127),
    each value the nearest e2m1 code (low nibble first)."""
    rows = w.transpose(1, 2).reshape(w.shape[0], w.shape[2], w.shape[1] // 32, 32)
    exp = torch.ceil(torch.log2(rows.abs().amax(-1).clamp(min=1e-30) / 6)).clamp(-127, 127)
    scaled = rows / torch.exp2(exp)[..., None]
    code = (scaled.abs()[..., None] - E2M1).abs().argmin(-1) + 8 * (scaled < 0)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def to_mxfp4(src, dst) -> Path:
    """A copy of ``src`` (``build``'s layout) whose expert matrices are MXFP4."""
    dst = H.copy_folder(src, dst)
    file = dst / "model.safetensors"
    tensors = H._load(file)
    for name in [n for n in tensors if EXPERTS.fullmatch(n)]:
        blocks, scales = quantize_mxfp4(tensors.pop(name))
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
    save_file(tensors, str(file), metadata={"format": "pt"})
    config = H.read_config(dst)
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def dequantized_reference(float_folder, mxfp4_folder, dequantize):
    """transformers' model of ``float_folder`` with its experts replaced by
    ``dequantize(blocks, scales)`` of ``mxfp4_folder``'s (transformers' own function)."""
    model = H.hf_model(float_folder)
    stored = H._load(Path(mxfp4_folder) / "model.safetensors")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if EXPERTS.fullmatch(name):
                p.copy_(dequantize(stored[name + "_blocks"], stored[name + "_scales"]))
    return model
