"""Qwen3.5 (``Qwen3_5ForCausalLM``, text) and Qwen3-Next (``Qwen3NextForCausalLM``): a hybrid
decoder whose layers are gated DeltaNet linear attention (``layers.gated_deltanet``) or gated
full attention (``layers.gated_attention``), as ``layer_types`` says (else every
``full_attention_interval``-th layer, default 4, is full attention), each followed by a
SwiGLU MLP; every norm but the DeltaNet's output norm is zero-centred (``x * (1 + w)``);
rotary covers ``partial_rotary_factor`` (transformers' default 0.25, ``HF_DEFAULTS``) of each
head.

Qwen3-Next differs in two places: the DeltaNet's input projections are fused per key-head
group (``in_proj_qkvz``, ``in_proj_ba``), and the MLPs are softmax-routed MoEs with a gated
shared expert (``layers.moe``) on the layers ``decoder_sparse_step`` / ``mlp_only_layers``
pick.

The cache: paged KV for the full-attention layers, per-request state slots for the linear
ones (``kv_cache_spec`` says which). The MTP layer stored as ``mtp.*`` in the same folder is
the draft head's (``heads.qwen3_5_mtp``), skipped here.

The published Qwen3.5 checkpoints are multimodal (``Qwen3_5ForConditionalGeneration``):
their text model is this one, its config the ``text_config`` (``checkpoint.load_config``),
its tensors ``model.language_model.*`` (read as ``model.*``); the vision tower
``model.visual.*`` is not read (specdec takes text prompts).
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.layers.gated_attention import GatedAttention
from specdec.models.layers.gated_deltanet import GatedDeltaNet
from specdec.models.layers.mlp import MLP
from specdec.models.layers.moe import (
    MOE_CONFIG_KEYS,
    SHARED_EXPERT_KEY,
    MoEMLP,
    is_moe_layer,
)
from specdec.models.layers.norm import OffsetRMSNorm
from specdec.models.layers.rotary import RotaryEmbedding

LINEAR_KEYS = frozenset({"linear_conv_kernel_dim", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_num_key_heads",
                         "linear_num_value_heads"})
# read by the MTP head (heads.qwen3_5_mtp) or checked here
QWEN3_5_KEYS = LINEAR_KEYS | {"attn_output_gate", "mtp_num_hidden_layers",
                              "mtp_use_dedicated_embeddings"}
QWEN3_NEXT_KEYS = QWEN3_5_KEYS | MOE_CONFIG_KEYS | {SHARED_EXPERT_KEY}


def check_config(config: ModelConfig) -> None:
    """Refuse what this model does not implement, naming the key."""
    e = config.extra
    for key in sorted(LINEAR_KEYS):
        value = e.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config {key}={value!r}: must be a positive int")
    if e.get("attn_output_gate", True) is not True:
        raise ValueError(f"config attn_output_gate={e['attn_output_gate']!r}: only true (the "
                         "gated attention) is implemented")
    if e.get("mtp_use_dedicated_embeddings", False) is not False:
        raise ValueError("config mtp_use_dedicated_embeddings=True: only the MTP layer "
                         "sharing the target's embedding is implemented")


def rotary(config: ModelConfig) -> RotaryEmbedding:
    """The rope of the first ``partial_rotary_factor`` channels of a head."""
    return RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)


class HybridDecoderLayer(nn.Module):
    """``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``;
    the mixer is ``linear_attn`` (a GatedDeltaNet) or ``self_attn`` (a GatedAttention)."""

    def __init__(self, mixer: nn.Module, mlp: nn.Module, hidden_size: int, eps: float):
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(hidden_size, eps)
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, x: torch.Tensor, rope, kv=None) -> torch.Tensor:
        normed = self.input_layernorm(x)
        if hasattr(self, "linear_attn"):
            h = x + self.linear_attn(normed, kv)
        else:
            h = x + self.self_attn(normed, rope, kv)
        return h + self.mlp(self.post_attention_layernorm(h))


def _mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    c = config
    return MoEMLP(c) if is_moe_layer(c, layer_idx) else MLP(c.hidden_size, c.intermediate_size)


def full_attention_layer(config: ModelConfig, layer_idx: int,
                         cache_idx: int | None = None) -> HybridDecoderLayer:
    """A gated-attention decoder layer of ``config``'s shape, its MLP a MoE where
    ``is_moe_layer(config, layer_idx)``, attending through cache layer ``cache_idx`` (default
    ``layer_idx``; the MTP layer ``mtp.layers.0``: index 0, layer 0 of the draft's cache)."""
    c = config
    attn = GatedAttention(layer_idx if cache_idx is None else cache_idx, c.hidden_size,
                          c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                          c.rms_norm_eps)
    return HybridDecoderLayer(attn, _mlp(c, layer_idx), c.hidden_size, c.rms_norm_eps)


def build_layer(config: ModelConfig, layer_idx: int, fused: bool) -> HybridDecoderLayer:
    """Decoder layer ``layer_idx`` of ``config``, its type from ``layer_types``, its MLP a MoE
    where ``is_moe_layer``; ``fused``: the DeltaNet's Qwen3-Next projections."""
    c, e = config, config.extra
    if c.layer_types is None or c.layer_types[layer_idx] == "full_attention":
        return full_attention_layer(config, layer_idx)
    mixer = GatedDeltaNet(layer_idx, c.hidden_size, e["linear_num_key_heads"],
                          e["linear_num_value_heads"], e["linear_key_head_dim"],
                          e["linear_value_head_dim"], e["linear_conv_kernel_dim"],
                          c.rms_norm_eps, fused=fused)
    return HybridDecoderLayer(mixer, _mlp(c, layer_idx), c.hidden_size, c.rms_norm_eps)


class Qwen3_5ForCausalLM(DecoderForCausalLM):
    MODEL_TYPE = "qwen3_5_text"
    LINEAR_ATTENTION = True
    CONFIG_KEYS = QWEN3_5_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False,
        "hidden_act": "silu", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
        "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32}
    IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$|mtp\..*|model\.visual\..*")
    FUSED_PROJECTIONS = False  # the DeltaNet's in_proj_qkvz / in_proj_ba (Qwen3-Next)
    TEXT_PREFIX = "model.language_model."  # the multimodal checkpoints' text model
    NORM = OffsetRMSNorm
    check_config = staticmethod(check_config)

    def checkpoint_name(self, name: str) -> str | None:
        if name.startswith(self.TEXT_PREFIX):
            name = "model." + name[len(self.TEXT_PREFIX):]
        return super().checkpoint_name(name)

    def build_layer(self, layer_idx: int) -> nn.Module:
        return build_layer(self.config, layer_idx, self.FUSED_PROJECTIONS)

    def build_rotary(self):
        return rotary(self.config)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The published (multimodal) Qwen3.5 checkpoints: this text model, read from
    ``text_config`` (module docstring)."""

    MULTIMODAL_MODEL_TYPE = "qwen3_5"


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    MODEL_TYPE = "qwen3_next"
    CONFIG_KEYS = QWEN3_NEXT_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        **Qwen3_5ForCausalLM.HF_DEFAULTS, "num_key_value_heads": 2, "num_experts": 512,
        "num_experts_per_tok": 10, "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": []}
    FUSED_PROJECTIONS = True
