"""DeepSeek-V3/R1 (``DeepseekV3ForCausalLM``): the pre-norm decoder with multi-head latent
attention (``layers.mla``), interleaved rotary on the rope channels only (YaRN with
``mscale``/``mscale_all_dim``), a dense MLP below ``first_k_dense_replace`` and above it
DeepSeek's MoE (sigmoid scores, ``noaux_tc`` group-limited top-k on score +
``e_score_correction_bias``, ``routed_scaling_factor``, ``n_shared_experts``: ``layers.moe``).

Softmax scale: ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times
``mscale(factor, mscale_all_dim) ** 2`` under YaRN (``mscale(s, m) = 0.1 m ln s + 1``); the
rotary tables carry ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``. E.g. qk 192,
factor 40, mscale_all_dim 1: 192 ** -0.5 * 1.3689 ** 2 = 0.1352.

Checkpoint names are HF's; ``mlp.gate.e_score_correction_bias`` loads into
``mlp.e_score_correction_bias``; the MTP layers stored after the target's
(``model.layers.{L..}``, L = ``num_hidden_layers``) are the head's, skipped here. The
paged cache keeps one latent row of ``kv_lora_rank + qk_rope_head_dim`` per token per layer.
"""

from __future__ import annotations

import math
import re
from typing import ClassVar

from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.layers.mla import MLAttention
from specdec.models.layers.mlp import MLP
from specdec.models.layers.moe import DEEPSEEK_MOE_KEYS, MOE_CONFIG_KEYS, MoEMLP
from specdec.models.layers.rotary import RotaryEmbedding

MLA_KEYS = frozenset({"kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                      "v_head_dim", "qk_head_dim", "rope_interleave"})
LAYOUT_KEYS = frozenset({"first_k_dense_replace", "moe_layer_freq"})
# published config keys that never change a forward: the aux-loss knobs of training and the
# expert-parallel size of DeepSeek's own launcher
TRAINING_KEYS = frozenset({"aux_loss_alpha", "seq_aux", "ep_size"})
DEEPSEEK_KEYS = MOE_CONFIG_KEYS | DEEPSEEK_MOE_KEYS | MLA_KEYS | LAYOUT_KEYS | TRAINING_KEYS


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek's ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` when the
    rotary is YaRN with a (non-zero) ``mscale_all_dim``, as transformers and vLLM do."""
    e = config.extra
    scale = (e["qk_nope_head_dim"] + e["qk_rope_head_dim"]) ** -0.5
    rope = config.rope
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def check_config(config: ModelConfig) -> None:
    """Refuse what this model does not implement (naming the key) and fill DeepSeek-V3's
    routing defaults (``save_pretrained`` omits ``scoring_func``/``topk_method``)."""
    e = config.extra
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = e.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config {key}={value!r}: must be a positive int")
    q_rank = e.get("q_lora_rank")
    if q_rank is not None and (isinstance(q_rank, bool) or not isinstance(q_rank, int)
                               or q_rank < 1):
        raise ValueError(f"config q_lora_rank={q_rank!r}: must be null or a positive int")
    qk = e["qk_nope_head_dim"] + e["qk_rope_head_dim"]
    if e.get("qk_head_dim", qk) != qk:
        raise ValueError(f"config qk_head_dim={e['qk_head_dim']!r}: must be qk_nope_head_dim + "
                         f"qk_rope_head_dim = {qk}")
    if e["qk_rope_head_dim"] % 2:
        raise ValueError(f"config qk_rope_head_dim={e['qk_rope_head_dim']}: must be even")
    if config.rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config partial_rotary_factor: DeepSeek rotates qk_rope_head_dim "
                         "channels; a partial factor is not implemented")
    freq = e.get("moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(f"config moe_layer_freq={freq!r}: only 1 is implemented")
    dense = e.get("first_k_dense_replace")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ValueError(f"config first_k_dense_replace={dense!r}: must be an int >= 0")
    for key, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if e.setdefault(key, value) != value:
            raise ValueError(f"config {key}={e[key]!r}: DeepseekV3ForCausalLM implements only "
                             f"{value!r}")


def is_moe_layer(config: ModelConfig, layer: int) -> bool:
    """DeepSeek's rule: MoE from layer ``first_k_dense_replace`` on (``moe_layer_freq`` 1)."""
    return (config.extra.get("n_routed_experts") or 0) > 0 and \
        layer >= config.extra["first_k_dense_replace"]


def build_layer(config: ModelConfig, layer_idx: int, scale: float,
                cache_idx: int | None = None) -> DecoderLayer:
    """Decoder layer ``layer_idx`` (MLA + dense MLP or MoE) of ``config``'s shape, attending
    through KV-cache layer ``cache_idx`` (default ``layer_idx``; an MTP layer uses 0 of the
    draft's own cache)."""
    c, e = config, config.extra
    attn = MLAttention(layer_idx if cache_idx is None else cache_idx, c.hidden_size, c.num_attention_heads,
                       q_lora_rank=e.get("q_lora_rank"), kv_lora_rank=e["kv_lora_rank"],
                       qk_nope_head_dim=e["qk_nope_head_dim"],
                       qk_rope_head_dim=e["qk_rope_head_dim"], v_head_dim=e["v_head_dim"],
                       scale=scale, eps=c.rms_norm_eps)
    mlp = MoEMLP(c) if is_moe_layer(c, layer_idx) else MLP(c.hidden_size, c.intermediate_size)
    return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps)


def rotary(config: ModelConfig) -> RotaryEmbedding:
    """The rope of the ``qk_rope_head_dim`` channels (interleaved unless ``rope_interleave``
    is false)."""
    return RotaryEmbedding(config.extra["qk_rope_head_dim"], config.rope,
                           config.max_position_embeddings,
                           interleaved=config.extra["rope_interleave"])


CORRECTION_BIAS = re.compile(r"(.*\.mlp)\.gate\.e_score_correction_bias")


def correction_bias_name(name: str) -> str:
    """HF's ``*.mlp.gate.e_score_correction_bias`` is the MoE's ``*.mlp.e_score_correction_bias``
    (DeepSeek-V3, GLM-4.5); any other name as it is."""
    m = CORRECTION_BIAS.fullmatch(name)
    return f"{m[1]}.e_score_correction_bias" if m else name


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    MODEL_TYPE = "deepseek_v3"
    CONFIG_KEYS = DEEPSEEK_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "num_key_value_heads": 128, "attention_bias": False, "hidden_act": "silu",
        "rope_theta": 10000.0, "rope_interleave": True, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "first_k_dense_replace": 3, "n_routed_experts": 256,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_shared_experts": 1,
        "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
    MTP_AFTER_LAYERS = True
    check_config = staticmethod(check_config)

    def build_layer(self, layer_idx: int) -> nn.Module:
        return build_layer(self.config, layer_idx, softmax_scale(self.config))

    def build_rotary(self):
        return rotary(self.config)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(correction_bias_name(name))
