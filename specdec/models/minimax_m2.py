"""MiniMax-M2: the decoder skeleton with Llama's layer (``llama.build_layer``): ``q_norm`` /
``k_norm`` over the whole projection (widths Hq*D and Hkv*D, before the per-head split),
partial rotary (``rotary_dim``), and on every layer
a sigmoid-routed MoE that chooses on score + ``e_score_correction_bias`` and weighs by the
unbiased scores, renormalised (``layers.moe``). Checkpoint names on disk:
``block_sparse_moe.{gate.weight, e_score_correction_bias, experts.E.w1/w2/w3}`` (w1 = gate,
w3 = up, w2 = down). The published MTP modules (``use_mtp``) are not read (vLLM skips them
too): their keys are refused only when they would change the target's own forward."""

import re
from typing import ClassVar

from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.layers.moe import MOE_CONFIG_KEYS
from specdec.models.llama import build_layer

EXPERT_NAMES = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}
# read here and checked in check_config; the MTP keys describe modules the target never runs
MINIMAX_KEYS = frozenset({"use_qk_norm", "qk_norm_type", "attn_type_list",
                          "shared_intermediate_size", "use_mtp", "num_mtp_modules",
                          "mtp_transformer_layers"})


def check_config(config: ModelConfig) -> None:
    """Refuse the MiniMax options this model does not implement, naming the key; fill its
    routing defaults."""
    extra = config.extra
    wanted = {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
              "shared_intermediate_size": 0}
    for key, value in wanted.items():
        if extra.get(key, value) != value:
            raise ValueError(f"config {key}={extra[key]!r}: only {value!r} is implemented")
    types = extra.get("attn_type_list")
    if types is not None and set(types) != {1}:
        raise ValueError(f"config attn_type_list={types!r}: only full attention (1) on every "
                         "layer is implemented")
    extra.setdefault("scoring_func", "sigmoid")
    extra.setdefault("use_routing_bias", True)
    extra.setdefault("moe_intermediate_size", config.intermediate_size)


class MiniMaxM2ForCausalLM(DecoderForCausalLM):
    MODEL_TYPE = "minimax_m2"
    CONFIG_KEYS = MOE_CONFIG_KEYS | MINIMAX_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 196608,
        "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rope_theta": 5e6,
        "num_local_experts": 256, "num_experts_per_tok": 8}
    MTP_AFTER_LAYERS = True
    _EXPERT = re.compile(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
    check_config = staticmethod(check_config)

    def build_layer(self, layer_idx: int) -> nn.Module:
        """Llama's layer with q/k norms over the whole projection; every MLP a MoE."""
        return build_layer(self.config, layer_idx, qk_norm="full",
                           sliding_window=self.config.sliding_window_of(layer_idx))

    def checkpoint_name(self, name: str) -> str | None:
        m = self._EXPERT.fullmatch(name)
        if m:
            name = f"{m[1]}.mlp.experts.{m[2]}.{EXPERT_NAMES[m[3]]}.weight"
        return super().checkpoint_name(name.replace(".block_sparse_moe.", ".mlp."))
