"""Phi-3 / Phi-3.5 (``Phi3ForCausalLM``; also Phi-4-mini): the Llama decoder whose checkpoint
stores the q/k/v projections as one ``qkv_proj`` tensor and gate/up as one ``gate_up_proj``
(the merged layers' own names, so they load as they are; tensor parallelism is refused: a
rank's rows of a fused tensor are not one slice). Long context is ``longrope`` (``su``) rope
scaling: ``short_factor`` / ``long_factor`` per channel and an attention factor scaling
cos/sin; which factor set, once per model, is ``layers.rotary._longrope_is_long``. A
``sliding_window`` covers every layer (transformers' mask) unless it reaches past
``max_position_embeddings`` (Phi-3.5's 262144), where it is no window at all."""

from typing import ClassVar

from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.llama import LlamaForCausalLM, build_layer

# dropout probabilities: training only
PHI3_KEYS = frozenset({"resid_pdrop", "embd_pdrop"})


def check_config(config: ModelConfig) -> None:
    """Drop a window no position can reach (the cache then runs without one)."""
    if config.layer_types is None and config.sliding_window is not None and \
            config.sliding_window >= config.max_position_embeddings:
        config.sliding_window = None


class Phi3ForCausalLM(LlamaForCausalLM):
    MODEL_TYPE = "phi3"
    CONFIG_KEYS = PHI3_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096, "sliding_window": None,
        "hidden_act": "silu", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    check_config = staticmethod(check_config)

    def build_layer(self, layer_idx: int) -> nn.Module:
        return build_layer(self.config, layer_idx, fused_checkpoint=True,
                           sliding_window=self.config.sliding_window_of(layer_idx))
