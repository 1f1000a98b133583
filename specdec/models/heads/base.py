"""The draft-head interface (``DraftHead``) and what every head family shares: the target's
weights a head references (``SharedWeights``), the default folder loader and the load checks.

The families, one module each, picked by the ``architectures[0]`` of the folder
(``registry``): ``mimo_mtp`` (MiMo's MTP layer), ``eagle`` (EAGLE-1, EAGLE-3),
``deepseek_mtp``, ``glm4_moe_mtp`` and ``qwen3_5_mtp`` (the MTP layer a DeepSeek-V3 / GLM-4.5 /
Qwen3.5 target folder holds). Each reads the checkpoint layouts vLLM's loaders accept, including the folders people
download; what vLLM does is summarised in each module (read in vllm/model_executor/models/ and
vllm/v1/, nothing copied).

Every head runs its single layer as KV layer 0 of the draft's own cache, shares the target's
embedding and lm_head unless its folder ships its own, and skips ``*.rotary_emb.inv_freq``
(an old exporter's buffer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.attention import KVCacheSpec
from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.layers.attention import Attention
from specdec.models.layers.rotary import Rope, RotaryEmbedding
from specdec.models.llama import LlamaForCausalLM

# checkpoint tensors no head reads: an old exporter's rotary buffer
SKIPPED = re.compile(r".*rotary_emb\.inv_freq")


@dataclass
class SharedWeights:
    """The target's embedding and lm_head, referenced (not owned, not saved) by a head."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


class DraftHead(nn.Module):
    """Common interface the proposers call; subclasses define the layer and the layout.

    Checkpoint layout hooks: ``skips(name)`` (tensors of the folder the head never reads),
    ``SHARED_COPIES`` (checkpoint name -> the ``SharedWeights`` field it copies: only its shape
    is checked), ``from_checkpoint`` (what the tensors present decide, e.g. an own
    embedding), ``load`` (folder -> head, when the default flow does not fit) and
    ``holds_layer`` (an MTP head a target folder may hold: ``(config dict, tensor names) ->
    bool``; None: never a target's). ``FAMILY``: the target family whose config layout the
    head's ``config.json`` has (its keys, defaults and facts: ``config.Family``)."""

    method = ""
    FAMILY: type[DecoderForCausalLM] = LlamaForCausalLM
    aux_layer_ids: tuple[int, ...] = ()  # target layers whose input states feed the head
    SHARED_COPIES: dict[str, str] = {}
    holds_layer = None

    def __init__(self, config: ModelConfig, target: DecoderForCausalLM, *,
                 own_embed: bool = False):
        super().__init__()
        t = target.config
        if (config.hidden_size, config.vocab_size) != (t.hidden_size, t.vocab_size):
            raise ValueError(f"{type(self).__name__}: head hidden_size/vocab_size "
                             f"{config.hidden_size}/{config.vocab_size} != target's "
                             f"{t.hidden_size}/{t.vocab_size}")
        self.config = config
        self.shared = SharedWeights(target.model.embed_tokens, target.lm_head)
        self.draft_vocab_size = config.vocab_size
        self.rotary = RotaryEmbedding(config.head_dim, config.rope,
                                      config.max_position_embeddings)
        if own_embed:  # a head that ships an embedding other than the target's uses its own
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    @classmethod
    def skips(cls, name: str) -> bool:
        """True for a checkpoint tensor this head never reads (it is not even loaded)."""
        return SKIPPED.fullmatch(name) is not None

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, target: DecoderForCausalLM,
                        tensors: dict[str, torch.Tensor], **options) -> DraftHead:
        """The head the folder's ``tensors`` (not yet loaded) describe."""
        return cls(config, target, **options)

    @classmethod
    def load(cls, path: str | Path, target: DecoderForCausalLM,
             aux_layer_ids: list[int] | tuple[int, ...] | None = None) -> DraftHead:
        """The head of folder ``path``, in float32 on the CPU (``registry.load_head`` names
        the folder in errors and casts): ``config.json`` (``read_config``; EAGLE's ``bias``
        flag popped), the class ``for_config`` picks, its ``load_options``, the folder's tensors but those it
        ``skips`` (shared copies as meta tensors of their shape), ``from_checkpoint`` and
        ``load_tensors``."""
        d = cls.read_config(path)
        fc_bias = d.pop("bias", None)  # EAGLE's flag for an fc bias (EAGLE-1 heads only)
        if fc_bias is not None and not isinstance(fc_bias, bool):
            raise ValueError(f"config bias={fc_bias!r}: must be true or false")
        config = ModelConfig.from_dict(d, cls.FAMILY)
        head_cls = cls.for_config(config)
        options = head_cls.load_options(fc_bias, aux_layer_ids)
        tensors = read_tensors(path, head_cls.skips, shape_only=head_cls.SHARED_COPIES)
        head = head_cls.from_checkpoint(config, target, tensors, **options)
        head.load_tensors(tensors, path)
        return head

    @classmethod
    def read_config(cls, path: str | Path) -> dict:
        """The folder's config as this class reads it (a family may translate another
        format's)."""
        return checkpoint.load_config(path)

    @classmethod
    def for_config(cls, config: ModelConfig) -> type[DraftHead]:
        """The class of a folder of this class's architecture with ``config``."""
        return cls

    @classmethod
    def load_options(cls, fc_bias: bool | None,
                     aux_layer_ids: list[int] | tuple[int, ...] | None) -> dict:
        """``from_checkpoint``'s options from the config's ``bias`` flag and the aux layer
        ids configured for the head."""
        if fc_bias:
            raise ValueError(f"config bias=True: only an EAGLE-1 head's fc bias is supported "
                             f"(this is a {cls.method!r} head)")
        return {}

    def kv_cache_spec(self) -> list[KVCacheSpec]:
        """One spec per attention layer of the head (its own KV cache)."""
        return [m.kv_cache_spec() for m in self.modules() if isinstance(m, Attention)]

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden [N, H] -> the head's input hidden [N, H] (identity here)."""
        return target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step.

        input_ids: [N] int64 (the token after the one ``hidden`` was computed at);
        positions: [N] (the position of ``hidden``'s token); hidden: [N, H].
        With kv=None the leading dims are [B, T] and attention is dense causal.
        Returns ``(logits_hidden [N, H], next_hidden [N, H])``.
        """
        raise NotImplementedError

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> float32 [..., draft_vocab_size]."""
        return self.shared.lm_head(logits_hidden).float()

    def draft_to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What ``save_pretrained`` writes (the head's tensors, plus any shared copies)."""
        return dict(self.state_dict())

    def expected_tensors(self) -> dict[str, torch.Size]:
        """What a folder must hold for this head (shared copies are optional)."""
        return {k: v.shape for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
        checkpoint.save_folder(path, self.config.to_hf_dict(self.FAMILY),
                               self.checkpoint_tensors(), dtype)

    def load_tensors(self, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
        """Load the folder's tensors: every expected one present with its shape, no other
        (shared copies: shape checked, then dropped); ValueError naming the offenders."""
        tensors = dict(tensors)
        for name, field in self.SHARED_COPIES.items():
            if name in tensors:
                want = full_shape(getattr(self.shared, field))
                if tensors[name].shape != want:
                    raise ValueError(f"checkpoint {str(path)!r}: wrong shapes "
                                     f"['{name}: {tuple(tensors[name].shape)} != {tuple(want)}'] "
                                     "(a copy of the target's)")
                del tensors[name]
        checkpoint.check_names(self.expected_tensors(), tensors, path)
        self.load_state_dict(tensors)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        own = getattr(self, "embed_tokens", None)
        return (own if own is not None else self.shared.embed_tokens)(input_ids)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary.tables(positions, dtype)


def full_shape(layer: nn.Module) -> torch.Size:
    """The unsharded shape of a target's embedding / lm_head (vocab-parallel under TP)."""
    w = layer.weight
    tp = getattr(layer, "tp", None)
    return torch.Size((w.shape[0] * (tp.size if tp is not None else 1), *w.shape[1:]))


def read_tensors(path: str | Path, skips, shape_only=()) -> dict[str, torch.Tensor]:
    """The folder's tensors but those ``skips(name)`` (never read from safetensors: a MiMo
    target's shards cost a header read each); ``shape_only`` names as meta tensors of their
    shape."""
    return dict(checkpoint.iter_tensors(path, skip=skips, shape_only=shape_only.__contains__))
