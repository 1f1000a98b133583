"""Gemma-2 (``Gemma2ForCausalLM``) and Gemma-3 text (``Gemma3ForCausalLM``, gemma-3-1b/270m).

The decoder: the embedding times ``sqrt(hidden_size)`` (rounded to the model dtype, as
transformers does); each layer ``h = x + post_attention_layernorm(attn(input_layernorm(x)))``,
``out = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))`` with every norm
zero-centred (``x * (1 + w)``, ``OffsetRMSNorm``) and a GeGLU MLP (``gelu_pytorch_tanh``);
tied embeddings; the logits capped to ``c * tanh(z / c)`` (``final_logit_softcapping``).

Attention (``layers.attention`` options, per layer): scores scaled by
``query_pre_attn_scalar ** -0.5``, capped by ``attn_logit_softcapping``; ``layer_types`` says
which layers see only the last ``sliding_window`` keys (default: Gemma-2 every other layer from
layer 0, Gemma-3 all but every ``sliding_window_pattern``-th, default 6). Gemma-3 adds a
per-head zero-centred ``q_norm``/``k_norm`` and gives its sliding layers their own rope
(``rope_local_base_freq``, or transformers 5's ``rope_parameters.sliding_attention``); its
full layers take ``rope_theta``/``rope_scaling``. Defaults are transformers' (``HF_DEFAULTS``):
Gemma-2 caps 50 (attention) and 30 (logits), Gemma-3 none; ``query_pre_attn_scalar`` 256; tied
embeddings (the published config.json files leave ``tie_word_embeddings`` out).

KV cache: every layer keeps its whole sequence's keys; a sliding layer's window is a mask over
them (``KVCacheSpec.sliding_window``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM
from specdec.models.layers.attention import Attention
from specdec.models.layers.mlp import MLP
from specdec.models.layers.norm import OffsetRMSNorm
from specdec.models.layers.rotary import Rope, rope_parameters

# read here; hidden_act is ignored as transformers does (hidden_activation decides), and
# cache_implementation ("hybrid") only names transformers' cache class
GEMMA2_KEYS = frozenset({"query_pre_attn_scalar", "attn_logit_softcapping",
                         "final_logit_softcapping", "hidden_activation", "hidden_act",
                         "cache_implementation", "use_bidirectional_attention",
                         "sliding_window_size"})
# the pattern keys only build layer_types when a config has none (transformers 5 writes both
# spellings)
GEMMA3_KEYS = GEMMA2_KEYS | {"rope_local_base_freq", "sliding_window_pattern",
                             "_sliding_window_pattern"}
ACTIVATION = "gelu_pytorch_tanh"


def _positive(key: str, value, *, optional: bool) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"config {key}={value!r}: must be a number > 0"
                         + (" or null" if optional else ""))


class GemmaDecoderLayer(nn.Module):
    """Sandwich-norm block (module docstring): x [..., H] -> [..., H]."""

    def __init__(self, self_attn: Attention, mlp: MLP, hidden_size: int, eps: float):
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(hidden_size, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = OffsetRMSNorm(hidden_size, eps)

    @property
    def mixer(self) -> nn.Module:
        return self.self_attn

    def forward(self, x: torch.Tensor, rope: Rope, kv=None) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, kv))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma2ForCausalLM(DecoderForCausalLM):
    """``QK_NORM``: Gemma-3's per-head q/k norm."""

    MODEL_TYPE = "gemma2"
    CONFIG_KEYS = GEMMA2_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
        "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False,
        "sliding_window": 4096, "rope_theta": 10000.0, "hidden_activation": ACTIVATION,
        "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0, "use_bidirectional_attention": None}
    NORM = OffsetRMSNorm
    QK_NORM: str | None = None

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        # sqrt(hidden_size) rounded to each dtype the embedding may take: transformers
        # multiplies by it in the model dtype (a host float here, so a forward makes no tensor)
        self.embed_scales = {
            dtype: torch.tensor(config.hidden_size ** 0.5, dtype=dtype, device="cpu").item()
            for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Refuse what is not implemented, naming the key; fill the default ``layer_types``."""
        e = config.extra
        _positive("query_pre_attn_scalar", e["query_pre_attn_scalar"], optional=False)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            _positive(key, e[key], optional=True)
        if e.get("hidden_activation", ACTIVATION) != ACTIVATION:
            raise ValueError(f"config hidden_activation={e['hidden_activation']!r}: allowed "
                             f"[{ACTIVATION!r}]")
        if e.get("use_bidirectional_attention"):
            raise ValueError("config use_bidirectional_attention=True: only causal attention "
                             "is implemented")
        if e.get("sliding_window_size", config.sliding_window) != config.sliding_window:
            raise ValueError(f"config sliding_window_size={e['sliding_window_size']!r} and "
                             f"sliding_window={config.sliding_window!r} disagree")
        if config.layer_types is None and config.sliding_window is not None:
            config.layer_types = [cls.default_layer_type(config, i)
                                  for i in range(config.num_hidden_layers)]

    @staticmethod
    def default_layer_type(config: ModelConfig, layer_idx: int) -> str:
        """Gemma-2: layers 0, 2, 4, ... slide."""
        return "sliding_attention" if layer_idx % 2 == 0 else "full_attention"

    def build_layer(self, layer_idx: int) -> nn.Module:
        c, e = self.config, self.config.extra
        attn = Attention(layer_idx, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, qk_norm=self.QK_NORM, eps=c.rms_norm_eps,
                         sliding_window=c.sliding_window_of(layer_idx),
                         scale=e["query_pre_attn_scalar"] ** -0.5,
                         softcap=e["attn_logit_softcapping"], norm=OffsetRMSNorm)
        mlp = MLP(c.hidden_size, c.intermediate_size, act=ACTIVATION)
        return GemmaDecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows times ``sqrt(hidden_size)`` rounded to their dtype."""
        x = self.model.embed_tokens(input_ids)
        return x * self.embed_scales[x.dtype]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., V], capped in the model dtype (as
        transformers does) when ``final_logit_softcapping`` is set."""
        logits = self.lm_head(hidden)
        cap = self.config.extra["final_logit_softcapping"]
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    MODEL_TYPE = "gemma3_text"
    CONFIG_KEYS = GEMMA3_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        **Gemma2ForCausalLM.HF_DEFAULTS, "max_position_embeddings": 131072,
        "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "attn_logit_softcapping": None,
        "final_logit_softcapping": None, "use_bidirectional_attention": False,
        "_sliding_window_pattern": 6}
    QK_NORM = "head"

    @classmethod
    def check_config(cls, config: ModelConfig) -> None:
        """Gemma-2's checks; the sliding layers' rope: ``rope_local_base_freq`` or the nested
        ``rope_parameters.sliding_attention`` (they must agree)."""
        super().check_config(config)
        own = dict(config.rope_by_layer_type or {})
        local = config.extra.get("rope_local_base_freq")
        if local is not None:
            from_key = rope_parameters({"rope_parameters": {"rope_type": "default",
                                                            "rope_theta": local}})
            if own.get("sliding_attention", from_key) != from_key:
                raise ValueError(f"config rope_local_base_freq={local!r} and rope_parameters."
                                 f"sliding_attention={own['sliding_attention']!r} disagree")
            own["sliding_attention"] = from_key
        if "sliding_attention" not in own:
            raise ValueError("config rope_parameters nested by layer type has no "
                             "sliding_attention entry (and no rope_local_base_freq)")
        config.rope_by_layer_type = own

    @staticmethod
    def default_layer_type(config: ModelConfig, layer_idx: int) -> str:
        """Gemma-3: every ``sliding_window_pattern``-th layer is full."""
        e = config.extra
        every = e.get("sliding_window_pattern", e.get("_sliding_window_pattern"))
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"config sliding_window_pattern={every!r}: must be an int >= 1")
        return "full_attention" if (layer_idx + 1) % every == 0 else "sliding_attention"
