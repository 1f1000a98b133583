"""Qwen3 and Qwen3-MoE: the Llama decoder with a per-head ``q_norm``/``k_norm`` (RMSNorm over
each head's D channels, before rotary), no q/k/v biases, ``head_dim`` from the config (it may
differ from H / heads). Qwen3-MoE's MLPs are softmax-routed MoEs (``layers.moe``) on the
layers ``decoder_sparse_step`` / ``mlp_only_layers`` pick."""

from specdec.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    QK_NORM = "head"


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    pass
