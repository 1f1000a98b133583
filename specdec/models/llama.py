"""The Llama decoder: Llama-2/3/3.1/3.2 and, as thin subclasses (their own config facts, the
same layers), Mistral, Qwen2/2.5 and MiMo's target. Qwen3 and Qwen3-MoE are this model with
other layer options (``qwen3.py``). Its layer (``build_layer``, which MiniMax-M2 and Phi-3 use
too): attention (``layers.attention``: GQA, optional q/k/v biases, q/k norms and sliding
windows) + an MLP, a MoE on the layers ``is_moe_layer`` picks; the engine's contract is the
skeleton's (``decoder.py``)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.layers.attention import Attention
from specdec.models.layers.mlp import MLP
from specdec.models.layers.moe import MoEMLP, is_moe_layer


def build_layer(config: ModelConfig, layer_idx: int, *, qk_norm: str | None = None,
                in_features: int | None = None, input_layernorm: bool = True,
                sliding_window: int | None = None, fused_checkpoint: bool = False
                ) -> DecoderLayer:
    """One decoder layer of ``config``'s shape (its MLP a MoE where ``is_moe_layer``);
    ``fused_checkpoint``: its tensors are stored as ``qkv_proj`` and ``gate_up_proj``."""
    c = config
    attn = Attention(layer_idx, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                     c.head_dim, in_features=in_features, qkv_bias=c.attention_bias,
                     qk_norm=qk_norm, eps=c.rms_norm_eps, sliding_window=sliding_window,
                     fused_checkpoint=fused_checkpoint)
    mlp = (MoEMLP(c) if is_moe_layer(c, layer_idx) else
           MLP(c.hidden_size, c.intermediate_size, fused_checkpoint=fused_checkpoint))
    return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps, input_layernorm)


class LlamaForCausalLM(DecoderForCausalLM):
    """``QK_NORM``: the q/k norm option a subclass sets (see ``layers.attention``)."""

    MODEL_TYPE = "llama"
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
        "attention_bias": False, "mlp_bias": False, "hidden_act": "silu", "rope_theta": 10000.0}
    QK_NORM: str | None = None

    def build_layer(self, layer_idx: int) -> nn.Module:
        return build_layer(self.config, layer_idx, qk_norm=self.QK_NORM,
                           sliding_window=self.config.sliding_window_of(layer_idx))


class MistralForCausalLM(LlamaForCausalLM):
    MODEL_TYPE = "mistral"
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 131072,
        "num_key_value_heads": 8, "sliding_window": 4096, "hidden_act": "silu",
        "rope_theta": 10000.0}


class Qwen2ForCausalLM(LlamaForCausalLM):
    """q/k/v always carry biases (the architecture implies them)."""

    MODEL_TYPE = "qwen2"
    ATTENTION_BIAS = True
    QKV_BIAS_IMPLIED = True
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": 28, "hidden_act": "silu", "rope_theta": 10000.0}


class MiMoForCausalLM(Qwen2ForCausalLM):
    """MiMo's target: a Qwen2 (its remote-code config class subclasses ``Qwen2Config``, whose
    defaults it keeps); its MTP layers are the head's (``heads.mimo_mtp``)."""

    MODEL_TYPE = "mimo"
