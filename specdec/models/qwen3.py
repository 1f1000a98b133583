"""Qwen3 and Qwen3-MoE: the Llama decoder with a per-head ``q_norm``/``k_norm`` (RMSNorm over
each head's D channels, before rotary), no q/k/v biases, ``head_dim`` from the config (it may
differ from H / heads). Qwen3-MoE's MLPs are softmax-routed MoEs (``layers.moe``) on the
layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick."""

from typing import ClassVar

from specdec.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    MODEL_TYPE = "qwen3"
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28,
        "hidden_act": "silu", "rope_theta": 10000.0}
    QK_NORM = "head"


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    MODEL_TYPE = "qwen3_moe"
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
        "num_key_value_heads": 4, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": None, "hidden_act": "silu", "rope_theta": 10000.0,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": []}
