"""MiMo's MTP layer as a draft head (method ``mtp``).

What vLLM does (read in vllm/model_executor/models/{mimo_mtp,qwen2}.py and
config/speculative.py; summarised here, nothing copied): it recognises the layout by
``architectures[0] == "MiMoForCausalLM"`` and rewrites the config to ``MiMoMTPModel`` with
``num_hidden_layers = 0`` and ``n_predict = num_nextn_predict_layers``, so the file names are
``model.mtp_layers.0.*``. Step: the token embedding is zeroed where ``position == 0``;
``token_layernorm(embeds)`` and ``hidden_layernorm(hidden)`` are concatenated HIDDEN FIRST and
mapped by ``input_proj [H, 2H]``; then a Qwen2 decoder layer (q/k/v WITH biases, o_proj
without; its tensors are stored flat under
``model.mtp_layers.0.{input_layernorm,post_attention_layernorm,self_attn,mlp}``, vLLM inserts
``mtp_block``); ``final_layernorm(residual + mlp_out)`` is the single output, used for the
logits (shared lm_head) and as the next step's hidden. The input hidden is the target's final
(normed) hidden. vLLM's loader returns the set of loaded names, so the strict "weights not
initialized" check applies: it owns ``model.embed_tokens`` and ``lm_head`` and needs them in
the folder; we therefore save copies of the target's two matrices there and ignore them on
load. (DeepSeek's MTP layer, ``deepseek_mtp``, concatenates EMBEDS FIRST.)

Published folders: ONE folder holding the MiMo target and ``model.mtp_layers.0.*``; the
target's own tensors (``model.layers.*``, ``model.norm``) are never read by the head, the two
shared copies only have their shapes checked. A head folder of its own holds the same names.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.heads.base import DraftHead
from specdec.models.layers.norm import RMSNorm
from specdec.models.llama import MiMoForCausalLM, build_layer

MTP_ARCH = "MiMoForCausalLM"
MTP_PREFIX = "model.mtp_layers."


class MtpHead(DraftHead):
    """MiMo-style MTP layer: ``model.mtp_layers.0.*`` (Qwen2 decoder layer + input projection),
    in a head folder of its own or in the MiMo target's folder."""

    method = "mtp"
    FAMILY = MiMoForCausalLM
    # vLLM's MiMo loader requires these two in the folder; they are the target's
    SHARED_COPIES = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
    # a MiMo checkpoint's target tensors (the target loader reads them, the head never does)
    TARGET_TENSORS = re.compile(r"model\.(layers\.\d+\..*|norm\.weight)")

    def __init__(self, config: ModelConfig, target: DecoderForCausalLM):
        super().__init__(config, target)
        n = config.extra.get("num_nextn_predict_layers")
        if config.architectures[0] != MTP_ARCH or n != 1:
            raise ValueError(f"MtpHead config: architectures={config.architectures}, "
                             f"num_nextn_predict_layers={n}; need ['{MTP_ARCH}'] and 1")
        self.model = nn.Module()
        self.model.mtp_layers = nn.ModuleList([_MtpLayer(config)])

    @classmethod
    def skips(cls, name):
        return super().skips(name) or cls.TARGET_TENSORS.fullmatch(name) is not None

    @classmethod
    def holds_layer(cls, config: dict, names: set[str]) -> bool:
        """A MiMo target folder holds ``model.mtp_layers.*``."""
        return any(n.startswith(MTP_PREFIX) for n in names)

    def forward(self, input_ids, positions, hidden, kv=None):
        layer = self.model.mtp_layers[0]
        emb = self._embed(input_ids).masked_fill((positions == 0)[..., None], 0.0)
        x = layer.input_proj(torch.cat((layer.hidden_layernorm(hidden),
                                        layer.token_layernorm(emb)), dim=-1))
        out = layer.final_layernorm(layer(x, self._rope(positions, x.dtype), kv))
        return out, out

    def checkpoint_tensors(self):
        return dict(self.state_dict(),
                    **{"model.embed_tokens.weight": self.shared.embed_tokens.weight,
                       "lm_head.weight": self.shared.lm_head.weight})


class _MtpLayer(DecoderLayer):
    def __init__(self, config: ModelConfig):
        base = build_layer(config, 0)
        super().__init__(base.self_attn, base.mlp, config.hidden_size, config.rms_norm_eps)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)
