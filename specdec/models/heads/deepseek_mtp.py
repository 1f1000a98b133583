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

Sharded like the target (``load`` of a target that ``layers.parallel.shard_model`` sharded or
whose experts it placed): the layer goes through the target's ``shard_layer`` -- MLA split by
heads (``q_b_proj`` / ``kv_b_proj`` rows, ``o_proj`` columns; the latent projection and its
cache row replicated), the MoE's routed experts the target's ``ExpertPlacement`` (EP: E/(D*T)
whole; else E/D at width 1/T), its shared expert split by width -- and its own
``embed_tokens`` / ``shared_head.head`` copies are vocab-parallel like the target's. A rank
reads only its slices and its experts' tensors (fp8 blocks too: ``checkpoint.load_into``).
``eh_proj``, the norms and the router stay whole. The layer's TP collectives never run under
sequence parallelism: the head's input is the target's gathered hidden, on every token.
E.g. T=2 (4 heads, 2 a rank): ``q_b_proj`` [2*48, 48], ``o_proj`` [64, 2*24], ``embed_tokens``
rows 256.. on rank 1 of a 512-token vocabulary.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace

import torch
from torch import nn

from specdec.distributed import TPContext
from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.deepseek import (DeepseekV3ForCausalLM, build_layer, correction_bias_name,
                                     rotary, softmax_scale)
from specdec.models.heads.base import SKIPPED, DraftHead
from specdec.models.layers.norm import RMSNorm
from specdec.models.layers.parallel import (ExpertPlacement, Slices, place_experts,
                                            shard_layer, vocab_parallel)
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
        names and config): only ``model.layers.L.*`` is read, fp8 blocks dequantized
        (``quantization_config``). Placed like ``target`` (its ``tp`` and
        ``expert_placement``): built on the meta device, sharded (``shard``), and only this
        rank's slices and experts read."""
        config = ModelConfig.from_folder(path, cls.FAMILY)
        prefix = f"model.layers.{config.num_hidden_layers}."
        names = dict(checkpoint.iter_tensors(path, skip=lambda name: not name.startswith(prefix),
                                             shape_only=lambda _: True))  # headers only
        tp = replace(getattr(target, "tp", TPContext()), sequence_parallel=False)
        experts = getattr(target, "expert_placement", ExpertPlacement())
        sharded = tp.size > 1 or experts.size > 1
        with torch.device("meta") if sharded else nullcontext():
            head = cls.from_checkpoint(config, target, names)
        slices, not_held = None, set()
        if sharded:
            whole = set(head.state_dict())
            slices = head.shard(tp, experts)
            not_held = whole - set(head.state_dict())  # the other ranks' experts: never read
            head = head.to_empty(device="cpu")

        def ignore(name: str) -> bool:
            return not name.startswith(prefix) or name in not_held or \
                SKIPPED.fullmatch(name) is not None

        state = head.state_dict()
        checkpoint.load_into(state, path, rename=correction_bias_name, ignore=ignore,
                             weight_block_size=config.weight_block_size,
                             shard=None if slices is None else slices.get)
        return head

    def shard(self, tp: TPContext, experts: ExpertPlacement) -> Slices:
        """Swap the layer's modules for this rank's, as ``layers.parallel.shard_model`` does
        the target's layers (module docstring); -> the slice of every sharded tensor."""
        out: Slices = {}
        if tp.size == 1:
            place_experts(self, tp, experts)
            return out
        layer, prefix = self.layer, f"model.layers.{self.index}."
        shard_layer(layer, tp, prefix, out, experts, f"{type(self).__name__}'s MTP layer",
                    self.index)
        vocab = self.config.vocab_size
        if hasattr(layer, "embed_tokens"):
            layer.embed_tokens = vocab_parallel(layer.embed_tokens, vocab, tp,
                                                prefix + "embed_tokens.weight", out)
        if hasattr(layer.shared_head, "head"):
            layer.shared_head.head = vocab_parallel(layer.shared_head.head, vocab, tp,
                                                    prefix + "shared_head.head.weight", out)
        return out

    @classmethod
    def holds_layer(cls, config: dict, names: set[str]) -> bool:
        """A target folder holds ``model.layers.L.eh_proj`` (L = its layer count)."""
        return f"model.layers.{config['num_hidden_layers']}.eh_proj.weight" in names

    def kv_cache_spec(self):
        return [self.layer.mixer.kv_cache_spec()]

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
