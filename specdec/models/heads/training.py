"""Freshly initialised heads for a target (training, tests, synthetic benchmarks): a head
config sized like the target and the head built from it."""

from __future__ import annotations

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.heads.base import DraftHead
from specdec.models.heads.eagle import Eagle3Head, EagleHead
from specdec.models.heads.mimo_mtp import MTP_ARCH, MtpHead
from specdec.models.layers.moe import MOE_CONFIG_KEYS

HEAD_CLASSES = {"mtp": MtpHead, "eagle": EagleHead, "eagle3": Eagle3Head}


def head_config(method: str, target: DecoderForCausalLM, **extra) -> ModelConfig:
    """A head config sized like ``target`` (one layer), with the keys vLLM reads for ``method``.

    The target family's own keys that no head reads are left out: q/k-norm and attention-type
    keys (MiniMax-M2), the sliding window (a head attends to every earlier token), and for the
    Llama-style EAGLE heads the MoE keys (their MLP is dense; an MTP layer of a MoE target stays
    a MoE), ``attention_bias`` (their attention has none, as published heads of gpt-oss or
    GLM) and the target's ``quantization_config``. Eagle3 takes ``eagle_aux_hidden_state_layer_ids=[...]`` (default: vLLM's
    (2, L // 2, L - 3)) and optional ``draft_vocab_size``.
    """
    archs = {"mtp": [MTP_ARCH], "eagle": ["LlamaForCausalLM"], "eagle3": ["LlamaForCausalLMEagle3"]}
    if method not in archs:
        raise ValueError(f"head method={method!r}: allowed {sorted(archs)}")
    family, target_config = type(target), target.config
    unread = (family.CONFIG_KEYS - MOE_CONFIG_KEYS) | {"layer_types", "sliding_window"}
    if method != "mtp":
        unread |= MOE_CONFIG_KEYS | {"attention_bias", "quantization_config"}
    d = {k: v for k, v in target_config.to_hf_dict(family).items() if k not in unread}
    d.update(architectures=archs[method], num_hidden_layers=1, tie_word_embeddings=False, **extra)
    if method == "mtp":
        d["num_nextn_predict_layers"] = 1
    if method == "eagle3":
        d.setdefault("draft_vocab_size", target_config.vocab_size)
        d["norm_before_residual"] = False
    return ModelConfig.from_dict(d, HEAD_CLASSES[method].FAMILY)


def build_head(method: str, target: DecoderForCausalLM, **extra) -> DraftHead:
    """A freshly initialised head for ``target`` (training)."""
    return HEAD_CLASSES[method](head_config(method, target, **extra), target)
