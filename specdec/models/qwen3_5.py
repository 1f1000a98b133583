"""Qwen3.5 (``Qwen3_5ForCausalLM``, text): a hybrid decoder whose layers are gated DeltaNet
linear attention (``layers.gated_deltanet``) or gated full attention
(``layers.gated_attention``), as ``layer_types`` says (else every
``full_attention_interval``-th layer, default 4, is full attention), each followed by a dense
SwiGLU MLP; every norm but the DeltaNet's output norm is zero-centred (``x * (1 + w)``);
rotary covers ``partial_rotary_factor`` (default 0.25) of each head.

The cache: paged KV for the full-attention layers, per-request state slots for the linear
ones (``kv_cache_spec`` says which). The MTP layer stored as ``mtp.*`` in the same folder is
the draft head's (``qwen3_5_mtp``), skipped here. Qwen3-Next (fused ``in_proj_qkvz`` /
``in_proj_ba`` and a MoE) is not implemented: its architecture is refused by the registry.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.layers.gated_attention import GatedAttention
from specdec.models.layers.gated_deltanet import GatedDeltaNet
from specdec.models.layers.mlp import MLP
from specdec.models.layers.norm import OffsetRMSNorm
from specdec.models.layers.rotary import RotaryEmbedding
from specdec.models.llama import LlamaForCausalLM

LINEAR_KEYS = frozenset({"linear_conv_kernel_dim", "linear_key_head_dim",
                         "linear_value_head_dim", "linear_num_key_heads",
                         "linear_num_value_heads"})
# read by the MTP head (qwen3_5_mtp) or checked here
QWEN3_5_KEYS = LINEAR_KEYS | {"attn_output_gate", "mtp_num_hidden_layers",
                              "mtp_use_dedicated_embeddings"}
DEFAULT_PARTIAL_ROTARY = 0.25  # transformers' Qwen3.5 default when the config names none


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
    """The rope of the first ``partial_rotary_factor`` (default 0.25) channels of a head."""
    rope = {"partial_rotary_factor": DEFAULT_PARTIAL_ROTARY, **config.rope}
    return RotaryEmbedding(config.head_dim, rope, config.max_position_embeddings)


class HybridDecoderLayer(nn.Module):
    """``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``;
    the mixer is ``linear_attn`` (a GatedDeltaNet) or ``self_attn`` (a GatedAttention)."""

    def __init__(self, mixer: nn.Module, hidden_size: int, intermediate_size: int,
                 eps: float):
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(hidden_size, eps)
        if isinstance(mixer, GatedDeltaNet):
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.post_attention_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.mlp = MLP(hidden_size, intermediate_size)

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


def full_attention_layer(config: ModelConfig, cache_idx: int) -> HybridDecoderLayer:
    """A gated-attention decoder layer of ``config``'s shape attending through cache layer
    ``cache_idx`` (the MTP layer: 0 of the draft's own cache)."""
    c = config
    attn = GatedAttention(cache_idx, c.hidden_size, c.num_attention_heads,
                          c.num_key_value_heads, c.head_dim, c.rms_norm_eps)
    return HybridDecoderLayer(attn, c.hidden_size, c.intermediate_size, c.rms_norm_eps)


def build_layer(config: ModelConfig, layer_idx: int) -> HybridDecoderLayer:
    """Decoder layer ``layer_idx`` of ``config``, its type from ``layer_types``."""
    c, e = config, config.extra
    if c.layer_types is None or c.layer_types[layer_idx] == "full_attention":
        return full_attention_layer(config, layer_idx)
    mixer = GatedDeltaNet(layer_idx, c.hidden_size, e["linear_num_key_heads"],
                          e["linear_num_value_heads"], e["linear_key_head_dim"],
                          e["linear_value_head_dim"], e["linear_conv_kernel_dim"],
                          c.rms_norm_eps)
    return HybridDecoderLayer(mixer, c.hidden_size, c.intermediate_size, c.rms_norm_eps)


class Qwen3_5ForCausalLM(LlamaForCausalLM):
    CONFIG_KEYS = QWEN3_5_KEYS
    IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$|mtp\..*")

    def __init__(self, config: ModelConfig):
        check_config(config)
        nn.Module.__init__(self)
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(build_layer(config, i)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = rotary(config)

    def kv_cache_spec(self) -> list:
        """Per layer: a ``KVCacheSpec`` (full attention, paged) or a ``LinearStateSpec``."""
        return [layer.mixer.kv_cache_spec() for layer in self.model.layers]
