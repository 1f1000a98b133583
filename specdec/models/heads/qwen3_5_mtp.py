"""Qwen3.5's and Qwen3-Next's MTP layer as a draft head (method ``mtp``).

Stored in the target folder as ``mtp.*``: ``mtp.fc [H, 2H]``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.norm`` (zero-centred norms) and one full-attention decoder
layer ``mtp.layers.0.*`` (gated attention + an MLP, a MoE where the target's rule makes layer
index 0 one, as vLLM builds it); the embedding and the lm_head are the target's. One step
(vLLM's ``qwen3_5_mtp.py`` / ``qwen3_next_mtp.py``):

    x    = fc([pre_fc_norm_embedding(embed(input_ids)), pre_fc_norm_hidden(hidden)])
    out  = mtp.norm(layer(x))        (both the logits input and the next step's hidden)

``hidden`` is the target's final (normed) hidden for the first step, then ``out``; one layer
serves every step (K > 1 runs it K times). It attends through layer 0 of the draft's own
paged cache: the MTP layer has no linear attention, so the draft keeps no recurrent state.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.heads.base import DraftHead, read_tensors
from specdec.models.layers.norm import OffsetRMSNorm
from specdec.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3NextForCausalLM,
    full_attention_layer,
    rotary,
)

# the architectures holding this layout, with their family (its config keys and defaults)
ARCHS = {"Qwen3_5ForCausalLM": Qwen3_5ForCausalLM, "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
         "Qwen3_5ForConditionalGeneration": Qwen3_5ForCausalLM}
PREFIX = "mtp."


class Qwen3_5MtpHead(DraftHead):
    method = "mtp"
    FAMILY = Qwen3_5ForCausalLM

    def __init__(self, config: ModelConfig, target):
        super().__init__(config, target)
        n = config.extra.get("mtp_num_hidden_layers",
                             config.extra.get("num_nextn_predict_layers", 1))
        if config.architectures[0] not in ARCHS or n != 1:
            raise ValueError(f"Qwen3_5MtpHead config: architectures={config.architectures}, "
                             f"mtp_num_hidden_layers={n!r}; need one of {sorted(ARCHS)} "
                             "and 1")
        self.rotary = rotary(config)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.mtp = nn.Module()
        self.mtp.fc = nn.Linear(2 * h, h, bias=False)
        self.mtp.pre_fc_norm_embedding = OffsetRMSNorm(h, eps)
        self.mtp.pre_fc_norm_hidden = OffsetRMSNorm(h, eps)
        self.mtp.layers = nn.ModuleList([full_attention_layer(config, 0)])
        self.mtp.norm = OffsetRMSNorm(h, eps)

    @classmethod
    def skips(cls, name: str) -> bool:
        return not name.startswith(PREFIX)

    @classmethod
    def load(cls, path, target, aux_layer_ids=None):
        """The MTP layer (``mtp.*``) of a Qwen3.5 / Qwen3-Next folder; every ``mtp.*`` tensor
        must be present with its shape (ValueError naming them)."""
        arch = (checkpoint.load_config(path).get("architectures") or [None])[0]
        config = ModelConfig.from_folder(path, ARCHS.get(arch, Qwen3_5ForCausalLM))
        tensors = read_tensors(path, cls.skips)
        head = cls(config, target)
        head.load_tensors(tensors, path)
        return head

    @classmethod
    def holds_layer(cls, config: dict, names: set[str]) -> bool:
        """A Qwen3.5 / Qwen3-Next target folder holds ``mtp.fc``."""
        return PREFIX + "fc.weight" in names

    def kv_cache_spec(self):
        return [self.mtp.layers[0].self_attn.kv_cache_spec()]

    def forward(self, input_ids, positions, hidden, kv=None):
        m = self.mtp
        x = m.fc(torch.cat((m.pre_fc_norm_embedding(self._embed(input_ids)),
                            m.pre_fc_norm_hidden(hidden)), dim=-1))
        out = m.norm(m.layers[0](x, self._rope(positions, x.dtype), kv))
        return out, out
