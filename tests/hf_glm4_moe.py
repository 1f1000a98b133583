"""Tiny random GLM-4.5 / 4.6 models (``Glm4MoeForCausalLM``) built and saved by transformers
(the reference specdec must match), in the layout of the published checkpoints: the target
sharded, its MTP layer ``model.layers.L.*`` (L = ``num_hidden_layers``, DeepSeek-V3's layout:
``hf_deepseek.mtp_tensors``) appended as a last shard.
"""

from __future__ import annotations

from pathlib import Path

import hf_deepseek as D
import hf_models as H

# GLM-4.5's config keys with the shapes shrunk: head_dim 32 != hidden / heads (16), rotary
# on 16 of its 32 channels, 1 dense layer then 1 MoE layer (4 experts, top-2, one group as
# published, routed_scaling_factor 2.5, a shared expert); the MTP layer is model.layers.2
GLM = dict(vocab_size=H.VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
           n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
           routed_scaling_factor=2.5, n_shared_experts=1, first_k_dense_replace=1,
           norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
           num_nextn_predict_layers=1, max_position_embeddings=256, rms_norm_eps=1e-5,
           tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
           rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.5})


def build_glm(path, mtp=D.mtp_tensors, post=H._routing_bias, **overrides) -> Path:
    """transformers writes the target (sharded), ``mtp(path)`` is appended as a last shard."""
    path = H._build(path, "Glm4MoeConfig", "Glm4MoeForCausalLM", post=post,
                    **{**GLM, **overrides})
    H.add_shard(path, mtp(path))
    return path


BUILDERS = {
    # GLM-4.5: its MTP layer ships copies of the embedding and lm_head
    "glm45": build_glm,
    # no q/k norm (GLM-4.5-Air), MTP without the copies (GLM-4.6), config.json in the Hub
    # spelling (top-level rope_theta and partial_rotary_factor, torch_dtype)
    "glm_air_t4": lambda path: H.to_t4_spelling(build_glm(
        path, mtp=lambda p: D.mtp_tensors(p, copies=False), use_qk_norm=False)),
    # a cycle target whose MTP layer predicts it exactly (hf_deepseek.exact_mtp_tensors)
    "glm_cycle": lambda path: build_glm(path, mtp=D.exact_mtp_tensors, post=lambda m, g: (
        H._routing_bias(m, g), H.cycle_weights(m, g))),
}
