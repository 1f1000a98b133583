"""GLM-4.5 / 4.6's MTP layer as a draft head (method ``mtp`` / ``glm4_moe_mtp``).

DeepSeek-V3's layout and step (``deepseek_mtp``; vLLM's ``glm4_moe_mtp.py`` is the same math)
with GLM's decoder layer: ``model.layers.L.{enorm, hnorm, eh_proj [H, 2H], shared_head.norm}``
plus a GLM layer L (GQA with q/k/v biases, optional q/k norm, MoE) under the same prefix,
attending through layer 0 of the draft's own KV cache with the target's partial rotary.
GLM-4.5 ships ``model.layers.L.{embed_tokens, shared_head.head}`` copies, GLM-4.6 does not:
the target's are shared then. E.g. GLM-4.5 (92 layers): tensors ``model.layers.92.*``.
"""

from __future__ import annotations

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderLayer
from specdec.models.glm4_moe import Glm4MoeForCausalLM, build_layer
from specdec.models.heads.deepseek_mtp import DeepseekMtpHead
from specdec.models.layers.rotary import RotaryEmbedding


class Glm4MoeMtpHead(DeepseekMtpHead):
    FAMILY = Glm4MoeForCausalLM

    @staticmethod
    def build_block(config: ModelConfig, index: int) -> DecoderLayer:
        """GLM's layer ``index`` (L: a MoE layer), attending through KV layer 0."""
        return build_layer(config, index, cache_idx=0)

    @staticmethod
    def build_rotary(config: ModelConfig) -> RotaryEmbedding:
        """The target's rope (rotate-half, partial)."""
        return RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)
