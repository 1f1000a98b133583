"""DeepSeek-V3/R1's MTP layer as a draft head (method ``mtp`` / ``deepseek_mtp``).

Stored in the target folder as layer ``L = num_hidden_layers`` (or in a head folder of its own
under the same names): ``model.layers.L.{enorm, hnorm, eh_proj [H, 2H], shared_head.norm}``,
optional ``model.layers.L.{embed_tokens, shared_head.head}`` (the target's are shared when
absent), and a full DeepSeek decoder layer (MLA + MoE, as layer L of the target would be) under
the same prefix. One step (vLLM's ``deepseek_mtp.py``):

    emb  = embed(input_ids), zeroed where position == 0
    x    = eh_proj([enorm(emb), hnorm(hidden)])        (embedding FIRST)
    out  = decoder_layer(x)                            (the next step's hidden, un-normed)
    logits = shared_head.head(shared_head.norm(out))

``hidden`` is the target's final (normed) hidden for the first step, then ``out``. One layer
serves every step (K > 1 runs it K times). It attends through layer 0 of the draft's own
latent cache. E.g. a 3-layer tiny target: tensors ``model.layers.3.*``; the target loader
skips them, this head reads nothing else of the folder.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.deepseek import DeepseekV3ForCausalLM, build_layer, rotary, softmax_scale
from specdec.models.heads.base import DraftHead, read_tensors
from specdec.models.layers.norm import RMSNorm
from specdec.models.layers.rotary import RotaryEmbedding

OWN_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


class DeepseekMtpHead(DraftHead):
    """The MTP layer of a ``FAMILY`` target (the class named as its architecture: its config
    keys, checks and defaults); another family storing the same layout subclasses this with
    its ``FAMILY``, ``build_block`` and ``build_rotary`` (``glm4_moe_mtp``)."""

    method = "mtp"
    FAMILY: type[DecoderForCausalLM] = DeepseekV3ForCausalLM

    def __init__(self, config: ModelConfig, target, *, own_embed: bool = False,
                 own_head: bool = False):
        arch, n = self.FAMILY.__name__, config.extra.get("num_nextn_predict_layers")
        if config.architectures[0] != arch or n != 1:
            raise ValueError(f"{type(self).__name__} config: architectures="
                             f"{config.architectures}, num_nextn_predict_layers={n!r}; need "
                             f"['{arch}'] and 1")
        self.FAMILY.check_config(config)  # the family's defaults, before any layer is built
        super().__init__(config, target)
        self.rotary = self.build_rotary(config)
        self.index = config.num_hidden_layers
        layer = self.build_block(config, self.index)
        h, eps = config.hidden_size, config.rms_norm_eps
        layer.enorm, layer.hnorm = RMSNorm(h, eps), RMSNorm(h, eps)
        layer.eh_proj = nn.Linear(2 * h, h, bias=False)
        layer.shared_head = nn.Module()
        layer.shared_head.norm = RMSNorm(h, eps)
        if own_embed:
            layer.embed_tokens = nn.Embedding(config.vocab_size, h)
        if own_head:
            layer.shared_head.head = nn.Linear(h, config.vocab_size, bias=False)
        self.model = nn.Module()
        self.model.layers = nn.ModuleDict({str(self.index): layer})
        self._bias = re.compile(rf"(model\.layers\.{self.index}\.mlp)\.gate\."
                                r"e_score_correction_bias")

    @staticmethod
    def build_block(config: ModelConfig, index: int) -> DecoderLayer:
        """The target's layer ``index`` (L), attending through KV layer 0 of the draft's cache."""
        return build_layer(config, index, softmax_scale(config), cache_idx=0)

    @staticmethod
    def build_rotary(config: ModelConfig) -> RotaryEmbedding:
        """The target's rope."""
        return rotary(config)

    @property
    def layer(self) -> nn.Module:
        return self.model.layers[str(self.index)]

    @classmethod
    def from_checkpoint(cls, config, target, tensors, **options):
        """Own embedding / head when the folder holds them, else the target's."""
        prefix = f"model.layers.{config.num_hidden_layers}."
        return cls(config, target, own_embed=prefix + OWN_COPIES[0] in tensors,
                   own_head=prefix + OWN_COPIES[1] in tensors)

    @classmethod
    def load(cls, path, target, aux_layer_ids=None):
        """The MTP layer of a ``FAMILY`` folder (the target's, or a head folder with the same
        names and config): only ``model.layers.L.*`` is read."""
        config = ModelConfig.from_folder(path, cls.FAMILY)
        prefix = f"model.layers.{config.num_hidden_layers}."
        tensors = read_tensors(path, lambda name: not name.startswith(prefix))
        head = cls.from_checkpoint(config, target, tensors)
        head.load_tensors(tensors, path)
        return head

    @classmethod
    def holds_layer(cls, config: dict, names: set[str]) -> bool:
        """A target folder holds ``model.layers.L.eh_proj`` (L = its layer count)."""
        return f"model.layers.{config['num_hidden_layers']}.eh_proj.weight" in names

    def kv_cache_spec(self):
        return [self.layer.mixer.kv_cache_spec()]

    def load_tensors(self, tensors, path):
        """HF's ``mlp.gate.e_score_correction_bias`` loads into ``mlp.e_score_correction_bias``."""
        renamed = {}
        for name, t in tensors.items():
            m = self._bias.fullmatch(name)
            renamed[f"{m[1]}.e_score_correction_bias" if m else name] = t
        super().load_tensors(renamed, path)

    def forward(self, input_ids, positions, hidden, kv=None):
        layer = self.layer
        own = getattr(layer, "embed_tokens", None)
        emb = (own if own is not None else self.shared.embed_tokens)(input_ids)
        emb = emb.masked_fill((positions == 0)[..., None], 0.0)
        x = layer.eh_proj(torch.cat((layer.enorm(emb), layer.hnorm(hidden)), dim=-1))
        out = layer(x, self._rope(positions, x.dtype), kv)
        return out, out

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        head = self.layer.shared_head
        lm_head = head.head if hasattr(head, "head") else self.shared.lm_head
        return lm_head(head.norm(logits_hidden)).float()
