"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``): the pre-norm GQA decoder with q/k/v biases
(``attention_bias``; o_proj has none), an optional per-head q/k RMSNorm before rotary
(``use_qk_norm``), rotary on the first ``int(head_dim * partial_rotary_factor)`` channels of
each head (rotate-half pairs), a dense MLP below ``first_k_dense_replace`` and above it
DeepSeek-V3's MoE (``layers.moe``: sigmoid scores, group-limited top-k on score +
``e_score_correction_bias``, ``norm_topk_prob``, ``routed_scaling_factor``,
``n_shared_experts``). E.g. GLM-4.5: head_dim 128, factor 0.5 -> 64 rotated channels; 160
experts in 1 group, top-8, scaling 2.5; layers 0-2 dense, 3-91 MoE.

A key config.json omits means transformers' ``Glm4MoeConfig`` default (``HF_DEFAULTS``, e.g.
``partial_rotary_factor`` 0.5). Checkpoint names are HF's; ``mlp.gate.e_score_correction_bias``
loads into ``mlp.e_score_correction_bias``; the MTP layer stored after the target's
(``model.layers.{L}``, L = ``num_hidden_layers``) is the head's (``heads.glm4_moe_mtp``),
skipped here.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.deepseek import correction_bias_name, is_moe_layer
from specdec.models.layers.attention import Attention
from specdec.models.layers.mlp import MLP
from specdec.models.layers.moe import DEEPSEEK_MOE_KEYS, MOE_CONFIG_KEYS, MoEMLP

GLM4_MOE_KEYS = MOE_CONFIG_KEYS | DEEPSEEK_MOE_KEYS | frozenset({"first_k_dense_replace",
                                                                 "use_qk_norm"})
# the only routing GLM has (its configs do not name it)
ROUTING = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


def check_config(config: ModelConfig) -> None:
    """Refuse what GLM does not have, naming the key; fill its routing."""
    e = config.extra
    for key, value in ROUTING.items():
        if e.setdefault(key, value) != value:
            raise ValueError(f"config {key}={e[key]!r}: Glm4MoeForCausalLM routes only with "
                             f"{value!r}")
    dense = e["first_k_dense_replace"]
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ValueError(f"config first_k_dense_replace={dense!r}: must be an int >= 0")
    if not isinstance(e["use_qk_norm"], bool):
        raise ValueError(f"config use_qk_norm={e['use_qk_norm']!r}: must be true or false")


def build_layer(config: ModelConfig, layer_idx: int, cache_idx: int | None = None
                ) -> DecoderLayer:
    """Decoder layer ``layer_idx`` (attention + dense MLP or MoE, by ``first_k_dense_replace``)
    of ``config``'s shape, attending through KV-cache layer ``cache_idx`` (default
    ``layer_idx``; the MTP layer uses 0 of the draft's own cache)."""
    c = config
    attn = Attention(layer_idx if cache_idx is None else cache_idx, c.hidden_size,
                     c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                     qkv_bias=c.attention_bias,
                     qk_norm="head" if c.extra["use_qk_norm"] else None, eps=c.rms_norm_eps)
    mlp = MoEMLP(c) if is_moe_layer(c, layer_idx) else MLP(c.hidden_size, c.intermediate_size)
    return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps)


class Glm4MoeForCausalLM(DecoderForCausalLM):
    MODEL_TYPE = "glm4_moe"
    ATTENTION_BIAS = True  # q/k/v only
    CONFIG_KEYS = GLM4_MOE_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "num_key_value_heads": 8, "attention_bias": False, "hidden_act": "silu",
        "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "use_qk_norm": False,
        "first_k_dense_replace": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True}
    MTP_AFTER_LAYERS = True
    check_config = staticmethod(check_config)

    def build_layer(self, layer_idx: int) -> nn.Module:
        return build_layer(self.config, layer_idx)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(correction_bias_name(name))
