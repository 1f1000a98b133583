"""Draft-head families by the ``architectures[0]`` of the folder a head is read from, as vLLM
picks its draft model class: one line per architecture in ``HEADS``. ``load_head`` reads any
of them; ``holds_mtp_layers`` says whether a target folder holds its own MTP layer (then it is
the ``mtp`` head's folder, as vLLM takes the target as the MTP model).

A new family: a ``DraftHead`` subclass in a module of its own (its ``load`` where the default
flow does not fit its folder, its ``holds_layer`` where a target folder may hold it) and its
architectures below.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError

from specdec.models import checkpoint
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.heads.base import DraftHead
from specdec.models.heads.deepseek_mtp import DeepseekMtpHead
from specdec.models.heads.eagle import (
    SPECULATORS_KEY,
    Eagle3Head,
    EagleHead,
    speculators_to_eagle3_config,
)
from specdec.models.heads.glm4_moe_mtp import Glm4MoeMtpHead
from specdec.models.heads.mimo_mtp import MtpHead
from specdec.models.heads.qwen3_5_mtp import Qwen3_5MtpHead
from specdec.models.registry import ARCHITECTURE_OF_MODEL_TYPE, ARCHITECTURES

HEADS: dict[str, type[DraftHead]] = {
    "MiMoForCausalLM": MtpHead,  # a head folder, or the MiMo target's (model.mtp_layers.*)
    "DeepseekV3ForCausalLM": DeepseekMtpHead,  # the target's layer L (model.layers.L.*)
    "Glm4MoeForCausalLM": Glm4MoeMtpHead,  # the same layout, GLM's layer
    "Qwen3_5ForCausalLM": Qwen3_5MtpHead,  # the target's mtp.*
    "Qwen3NextForCausalLM": Qwen3_5MtpHead,
    "Qwen3_5ForConditionalGeneration": Qwen3_5MtpHead,
    "LlamaForCausalLM": EagleHead,  # EAGLE-3 when its config has EAGLE-3 keys
    "EagleLlamaForCausalLM": EagleHead,
    "LlamaForCausalLMEagle3": Eagle3Head,
    "Eagle3LlamaForCausalLM": Eagle3Head,
}
# the target architectures whose folder may hold its MTP layer (a multimodal one is named by
# its text model's)
MTP_TARGETS = tuple(arch for arch, cls in HEADS.items() if cls.holds_layer is not None
                    and ARCHITECTURES[arch].MULTIMODAL_MODEL_TYPE is None)


def load_head(path: str | Path, target: DecoderForCausalLM, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu",
              aux_layer_ids: list[int] | tuple[int, ...] | None = None) -> DraftHead:
    """Load a head folder (class picked by ``config.json``'s architecture), sharing
    ``target``'s embed/lm_head.

    ``path`` may be a head folder of its own, a MiMo target folder holding
    ``model.mtp_layers.*`` (the target's tensors there are skipped unread), a DeepSeek-V3 or
    GLM-4.5 / 4.6 folder holding its MTP layer ``model.layers.L.*``, or a Qwen3.5 /
    Qwen3-Next folder holding ``mtp.*``, or an EAGLE-3 head in the ``speculators`` format
    (``speculators_model_type``: eagle3). ``aux_layer_ids``: an EAGLE-3 head's aux layers when
    its config names none (the speculative config's ``draft_model_config``); else vLLM's
    default. Every tensor the head needs must be present with its shape, and every other one
    known to be skipped: ValueError naming them.
    """
    config = checkpoint.load_config(path, ARCHITECTURE_OF_MODEL_TYPE)

    def build() -> DraftHead:
        # a ``speculators``-format folder (``speculators_model_type``, as vLLM detects it):
        # its translated config names the class
        d = speculators_to_eagle3_config(config) if SPECULATORS_KEY in config else config
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in HEADS:
            raise ValueError(f"head config architectures={archs}: allowed one of "
                             f"{list(HEADS)}")
        return HEADS[archs[0]].load(path, target, aux_layer_ids)

    head = checkpoint.naming_folder(path, build)
    return head.to(device=device, dtype=dtype).eval()


def target_architecture(path: str | Path) -> str | None:
    """The folder's architecture as the loader reads it (a multimodal one's: its text
    model's); None when its config cannot be read."""
    try:
        config = checkpoint.load_config(Path(path), ARCHITECTURE_OF_MODEL_TYPE)
        return (config.get("architectures") or [None])[0]
    except (ValueError, OSError):
        return None


def holds_mtp_layers(path: str | Path) -> bool:
    """Whether ``path`` is a target checkpoint holding its own MTP layer (its head class's
    ``holds_layer``: MiMo, DeepSeek-V3, GLM-4.5 / 4.6, Qwen3.5 / Qwen3-Next); names from the
    files' headers."""
    path = Path(path)
    try:
        config = checkpoint.load_config(path, ARCHITECTURE_OF_MODEL_TYPE)
        cls = HEADS.get((config.get("architectures") or [None])[0])
        if cls is None or cls.holds_layer is None:
            return False
        return cls.holds_layer(config, _tensor_names(path))
    except (ValueError, OSError, RuntimeError, SafetensorError):
        return False  # unreadable: the head loader names the problem if this folder is used


def _tensor_names(path: Path) -> set[str]:
    """The folder's tensor names, no tensor read (meta tensors of the stored shapes)."""
    return {name for name, _ in checkpoint.iter_tensors(path, shape_only=lambda _: True)}
