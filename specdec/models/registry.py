"""Target architectures: ``config.json``'s ``architectures[0]`` -> model class (as vLLM's model
registry does). The engine, the loader and the proposers go through here; a new family is a
subclass of the decoder skeleton (``decoder.py``) named as its architecture, with its facts
(``config.Family``), and one line in ``FAMILIES``: the other tables derive from it.

Example: ``load_model("Qwen3-0.6B/")`` reads its config, builds ``Qwen3ForCausalLM`` and
streams the weights in; ``load_model`` of a StarCoder2 folder -> ``ValueError: config
architectures=['Starcoder2ForCausalLM'] is not supported; supported: [...]``.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.distributed import TPContext
from specdec.models import checkpoint
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.layers.parallel import ExpertPlacement
from specdec.models.deepseek import DeepseekV3ForCausalLM
from specdec.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from specdec.models.glm4_moe import Glm4MoeForCausalLM
from specdec.models.gpt_oss import GptOssForCausalLM
from specdec.models.llama import (
    LlamaForCausalLM,
    MiMoForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
)
from specdec.models.minimax_m2 import MiniMaxM2ForCausalLM
from specdec.models.phi3 import Phi3ForCausalLM
from specdec.models.qwen3 import Qwen3ForCausalLM, Qwen3MoeForCausalLM
from specdec.models.qwen3_5 import (
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3NextForCausalLM,
)

# one line per family: each class is named as its architecture and holds its facts
# (config.Family: model_type, transformers' defaults, attention biases, ...)
FAMILIES: tuple[type[DecoderForCausalLM], ...] = (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,  # q/k/v biases, implied by the architecture
    MiMoForCausalLM,  # a Qwen2 target; its MTP layers are the head's
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
    MiniMaxM2ForCausalLM,
    DeepseekV3ForCausalLM,
    Glm4MoeForCausalLM,  # GQA + DeepSeek-V3's MoE, partial rotary
    Qwen3_5ForCausalLM,  # hybrid: gated DeltaNet + gated attention
    Qwen3NextForCausalLM,  # the same, fused projections, MoE
    Qwen3_5ForConditionalGeneration,  # its text model (see qwen3_5)
    Gemma2ForCausalLM,  # soft caps, alternating sliding window
    Gemma3ForCausalLM,  # 5 local : 1 global, local rope, q/k norm
    Phi3ForCausalLM,  # fused qkv / gate_up tensors, longrope
    GptOssForCausalLM,  # sinks, alternating window, MXFP4 MoE
)
ARCHITECTURES: dict[str, type[DecoderForCausalLM]] = {cls.__name__: cls for cls in FAMILIES}
# transformers picks the class by model_type where a config names no architectures
# (AutoModelForCausalLM); a multimodal checkpoint by its own (outer) model_type
ARCHITECTURE_OF_MODEL_TYPE = {cls.MULTIMODAL_MODEL_TYPE or cls.MODEL_TYPE: arch
                              for arch, cls in ARCHITECTURES.items()}


def model_class(architectures: list[str] | None) -> type[DecoderForCausalLM]:
    """The class for ``architectures[0]``; ValueError naming it and the supported ones."""
    arch = (architectures or ["LlamaForCausalLM"])[0]
    if arch not in ARCHITECTURES:
        raise ValueError(f"config architectures={architectures!r} is not supported; "
                         f"supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def load_model(path: str | Path, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", tp: TPContext | None = None,
               experts: ExpertPlacement = ExpertPlacement()) -> DecoderForCausalLM:
    """The target model of an HF folder, its class picked by ``architectures[0]``; with
    ``tp`` (size > 1) this rank's shard of it, with ``experts`` its routed experts."""
    archs = checkpoint.naming_folder(
        path, lambda: checkpoint.load_config(path, ARCHITECTURE_OF_MODEL_TYPE).get("architectures"))
    cls = checkpoint.naming_folder(path, lambda: model_class(archs))
    return cls.load_pretrained(path, dtype, device, tp=tp, experts=experts)


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> DecoderForCausalLM:
    """Any registered architecture (``load_model`` without tensor parallelism)."""
    return load_model(path, dtype, device)
