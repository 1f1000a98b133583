"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b).

The Llama decoder (pre-norm ``DecoderLayer``, RMSNorm, untied lm_head) with:
- attention (``layers.attention``): biases on q/k/v and o_proj (``attention_bias``), a learned
  sink logit per query head (``self_attn.sinks [Hq]``: one more softmax entry with no value),
  ``layer_types`` alternating a ``sliding_window`` (128) with full attention (default: layers
  0, 2, 4, ... slide), YaRN rope;
- every MLP a MoE (``layers.moe``) of ``num_local_experts`` E (32 / 128) experts, k =
  ``num_experts_per_tok`` (4): the router ``mlp.router`` has a bias, weights are the softmax of
  the k largest logits (top-k first, then softmax); each expert's gate/up/down carry biases and
  its activation is the clamped SwiGLU ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``,
  ``g = min(gate, l)`` (``swiglu_alpha`` 1.702, ``swiglu_limit`` l 7.0).

Checkpoint: the experts of a layer are stacked, ``mlp.experts.gate_up_proj [E, H, 2I]`` (gate
and up interleaved: columns 0, 2, 4, ... gate, 1, 3, 5, ... up), ``gate_up_proj_bias [E, 2I]``,
``down_proj [E, I, H]``, ``down_proj_bias [E, H]`` (bf16 copies), or, as published, MXFP4:
``gate_up_proj_blocks [E, 2I, H/32, 16]`` + ``gate_up_proj_scales [E, 2I, H/32]`` (and the same
for down_proj), dequantized at load to ``[E, H, 2I]`` (``checkpoint.dequantized_mxfp4``) and
cast to the model dtype. ``convert_tensors`` splits them into each expert's
``experts.{e}.{gate,up,down}_proj.{weight,bias}``; ``mlp.router`` loads as ``mlp.gate``.
Tensor parallelism (``layers.parallel.shard_model``): the sinks split with their query heads,
q/k/v biases with their rows, o_proj's bias added once after the sum; each expert's gate/up
biases split with their rows and its down bias kept on TP rank 0 (the experts' partial sums
add it once); MXFP4 experts are dequantized, then sliced by width. A rank holding some of the
experts (expert or data parallelism) reads only their rows of each stacked tensor
(``stored_slice``).
"""

from __future__ import annotations

import re
from typing import ClassVar

from torch import nn

from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.layers.attention import Attention
from specdec.models.layers.moe import MOE_CONFIG_KEYS, MoEMLP

# experts_per_token: the Hub config's second spelling of num_experts_per_tok (must agree);
# initial_context_length: informational (transformers ignores it; the rope's
# original_max_position_embeddings is what the math reads)
GPT_OSS_KEYS = MOE_CONFIG_KEYS | {"swiglu_alpha", "swiglu_limit", "experts_per_token",
                                  "initial_context_length"}
STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias)?")
# a stacked tensor as stored: a bf16 copy or either half of an MXFP4 pair
STORED_STACKED = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)"
                            r"(_bias|_blocks|_scales)?")


class GptOssForCausalLM(DecoderForCausalLM):
    MODEL_TYPE = "gpt_oss"
    ATTENTION_BIAS = True  # q/k/v and o_proj
    MXFP4 = True
    CONFIG_KEYS = GPT_OSS_KEYS
    HF_DEFAULTS: ClassVar[dict] = {
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
        "num_key_value_heads": 8, "head_dim": 64, "attention_bias": True, "sliding_window": 128,
        "hidden_act": "silu", "rope_theta": 150000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096},
        "num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0}

    @staticmethod
    def check_config(config: ModelConfig) -> None:
        """Fill the default ``layer_types`` (layers 0, 2, 4, ... slide); refuse what
        disagrees."""
        e = config.extra
        for key in ("swiglu_alpha", "swiglu_limit"):
            if isinstance(e[key], bool) or not isinstance(e[key], (int, float)) or \
                    not e[key] > 0:
                raise ValueError(f"config {key}={e[key]!r}: must be a number > 0")
        if e.get("experts_per_token", e.get("num_experts_per_tok")) != \
                e.get("num_experts_per_tok"):
            raise ValueError(f"config experts_per_token={e['experts_per_token']!r} and "
                             f"num_experts_per_tok={e.get('num_experts_per_tok')!r} disagree")
        if config.layer_types is None:
            config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                                  for i in range(config.num_hidden_layers)]

    def build_layer(self, layer_idx: int) -> nn.Module:
        c, e = self.config, self.config.extra
        attn = Attention(layer_idx, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                         c.head_dim, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                         sinks=True, sliding_window=c.sliding_window_of(layer_idx))
        mlp = MoEMLP(c, router_bias=True, softmax_after_topk=True, expert_bias=True,
                     clamped_swiglu=(e["swiglu_alpha"], e["swiglu_limit"]))
        return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps)

    def checkpoint_name(self, name: str) -> str | None:
        return super().checkpoint_name(name.replace(".mlp.router.", ".mlp.gate."))

    def held_experts(self) -> tuple[int, int] | None:
        """The routed experts this rank holds, ``[lo, hi)`` (contiguous: ExpertPlacement's);
        None: all of them."""
        moe = self.model.layers[0].mlp
        if len(moe.experts) == moe.num_experts:
            return None
        ids = sorted(map(int, moe.experts))
        return ids[0], ids[-1] + 1

    def stored_slice(self, name: str) -> tuple[int, int, int] | None:
        """A stacked expert tensor of a rank holding some experts: only their rows,
        ``(0, lo, hi)`` (its other experts' bytes are never read)."""
        held = self.held_experts()
        return None if held is None or STORED_STACKED.fullmatch(name) is None \
            else (0, *held)

    def convert_tensors(self, tensors, folder: str):
        """MXFP4 pairs dequantized, then each stacked expert tensor (module docstring) split
        into its experts' tensors (views of it; read as this rank's experts only when it holds
        some, ``stored_slice``); the other tensors as stored."""
        held = self.held_experts()
        for name, t in checkpoint.dequantized_mxfp4(tensors, folder):
            match = STACKED.fullmatch(name)
            if match is None:
                yield name, t
                continue
            prefix, proj, bias = match.groups()
            kind = "bias" if bias else "weight"
            first = held[0] if held is not None and len(t) == held[1] - held[0] else 0
            for i, part in enumerate(t, start=first):  # [H, 2I] / [2I] / [I, H] / [H]
                part = part if bias else part.T  # -> nn.Linear's [out, in]
                if proj == "down_proj":
                    yield f"{prefix}{i}.down_proj.{kind}", part
                else:
                    yield f"{prefix}{i}.gate_proj.{kind}", part[0::2]
                    yield f"{prefix}{i}.up_proj.{kind}", part[1::2]
            del t
