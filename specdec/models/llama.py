"""Llama / Qwen2 target model in plain PyTorch (gpt-fast style), HF parameter names.

Two attention modes (the contract the engine relies on):
- ``kv=None``: inputs are batched ``[B, T]``, attention is dense causal SDPA (training, reference).
- ``kv`` given: inputs are flat ``[N]``; every attention calls
  ``kv.attend(layer_idx, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D]``
  with RoPE already applied to ``q`` and ``k``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from specdec import kernels
from specdec.models import checkpoint
from specdec.models.merged import MergedLinear, save_merged_as_parts

QWEN2_ARCHS = ("Qwen2ForCausalLM", "MiMoForCausalLM")  # q/k/v always carry biases
LLAMA_ARCHS = ("LlamaForCausalLM", "LlamaForCausalLMEagle3")


@dataclass
class LlamaConfig:
    """The fields of an HF Llama/Qwen2 ``config.json`` this model uses.

    ``attention_bias`` means biases on q/k/v only (the Qwen2 layout); o_proj never has one.
    ``extra`` keeps the keys a draft head adds (``draft_vocab_size``, ``num_nextn_predict_layers``,
    ``eagle_aux_hidden_state_layer_ids``, ...) so they round-trip through ``to_hf_dict``.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 0
    architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    torch_dtype: str = "float16"
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig.{name}={value!r}: must be a positive int")
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not \
                    0 <= value < self.vocab_size:
                raise ValueError(f"LlamaConfig.{name}={value!r}: must be an int in "
                                 f"[0, vocab_size={self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig.num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim={self.head_dim}: must be even for RoPE")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps={self.rms_norm_eps}, rope_theta="
                             f"{self.rope_theta}: both must be > 0")
        if not self.architectures or not all(isinstance(a, str) for a in self.architectures):
            raise ValueError(f"LlamaConfig.architectures={self.architectures!r}: "
                             "must be a non-empty list of str")
        if self.architectures[0] in QWEN2_ARCHS:
            self.attention_bias = True
        if self.torch_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"LlamaConfig.torch_dtype={self.torch_dtype!r}: "
                             "allowed float16, bfloat16, float32")

    @property
    def model_type(self) -> str:
        return "qwen2" if self.architectures[0] in QWEN2_ARCHS else "llama"

    @classmethod
    def from_dict(cls, d: dict) -> "LlamaConfig":
        """Build from an HF config dict; unknown keys go to ``extra``, unsupported options raise."""
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config hidden_act={d['hidden_act']!r}: only 'silu' is supported")
        if d.get("rope_scaling") is not None:
            raise ValueError(f"config rope_scaling={d['rope_scaling']!r}: only null is supported")
        if d.get("mlp_bias", False):
            raise ValueError("config mlp_bias=True: MLP biases are not supported")
        archs = d.get("architectures") or ["LlamaForCausalLM"]
        if archs[0] not in QWEN2_ARCHS and d.get("attention_bias", False):
            raise ValueError(f"config attention_bias=True with architectures={archs}: Llama puts a "
                             "bias on o_proj too, which is not supported (Qwen2 layout only)")
        names = {f.name for f in fields(cls)} - {"extra", "architectures"}
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if n not in d]
        if missing:
            raise ValueError(f"config is missing required keys {missing}")
        kwargs = {k: v for k, v in d.items() if k in names}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        if isinstance(kwargs.get("eos_token_id"), list):
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        skip = names | {"architectures", "model_type", "hidden_act", "rope_scaling", "mlp_bias"}
        extra = {k: v for k, v in d.items() if k not in skip}
        return cls(architectures=list(archs), extra=extra, **kwargs)

    def to_hf_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        d["model_type"] = self.model_type
        d["hidden_act"] = "silu"
        d["rope_scaling"] = None
        if self.model_type == "qwen2":
            del d["attention_bias"]  # implied by the architecture
        d.update(self.extra)
        return dict(sorted(d.items()))


class RMSNorm(nn.Module):
    """HF RMSNorm: ``w * x / sqrt(mean(x^2) + eps)``, statistics in float32, output in x's dtype.

    ``F.rms_norm``: one fused kernel on CUDA; x [..., H] -> [..., H].
    Example: x = [3, 4], w = [1, 2], eps -> 0: rms = sqrt(12.5) -> [0.8485, 2.2627].
    """

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Rope(NamedTuple):
    """Rotary cos/sin for a set of positions, computed once per forward and shared by all layers.

    cos, sin: [..., T, 1, D] in the model dtype (broadcast over heads). ``sin`` carries the sign of
    HF's ``rotate_half``: ``[-sin(a), sin(a)]``, so ``apply(x) = x * cos + swap_halves(x) * sin``
    equals HF's ``x * cos + cat(-x2, x1) * sin`` exactly. Channel pairs are (j, j + D/2) with
    angle ``pos * theta ** (-2j / D)``, computed in float32 then cast (as HF does).

    Example (D=2, theta any, pos=1): angle a = 1 -> x = [1, 0] becomes [cos 1, sin 1].
    """

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def at(cls, positions: torch.Tensor, head_dim: int, theta: float,
           dtype: torch.dtype) -> "Rope":
        """positions [..., T] (any int/float dtype) -> Rope with [..., T, 1, head_dim] tables."""
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device,
                                           dtype=torch.float32) / head_dim)
        angles = positions.to(torch.float32)[..., None, None] * inv_freq  # [..., T, 1, D/2]
        cos, sin = angles.cos(), angles.sin()
        return cls(torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, H, D] (may be a strided view) -> rotated copy, same shape and dtype
        (one kernel where Triton runs: ``specdec.kernels.apply_rope``)."""
        return kernels.apply_rope(x, self.cos, self.sin)


class Attention(nn.Module):
    """One ``qkv_proj`` matmul (checkpoint names q_proj/k_proj/v_proj), one RoPE pass on q and k."""

    def __init__(self, config: LlamaConfig, layer_idx: int, in_features: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        d = self.head_dim
        self.qkv_proj = MergedLinear(in_features, {"q_proj": self.n_heads * d,
                                                   "k_proj": self.n_kv * d,
                                                   "v_proj": self.n_kv * d},
                                     bias=config.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, config.hidden_size, bias=False)
        save_merged_as_parts(self)

    def forward(self, x: torch.Tensor, rope: Rope, kv=None) -> torch.Tensor:
        """x: [B, T, in] with kv=None, else [N, in]; rope: tables for the same leading dims."""
        lead, hq, hkv = x.shape[:-1], self.n_heads, self.n_kv
        qkv = self.qkv_proj(x).view(*lead, hq + 2 * hkv, self.head_dim)
        qk = rope.apply(qkv[..., :hq + hkv, :])
        q, k, v = qk[..., :hq, :], qk[..., hq:, :], qkv[..., hq + hkv:, :]
        if kv is not None:
            out = kv.attend(self.layer_idx, q, k, v)
        else:
            q, k, v = (t.transpose(-3, -2) for t in (q, k, v))  # [B, H, T, D]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 enable_gqa=hq != hkv).transpose(-3, -2)
        return self.o_proj(out.reshape(*lead, hq * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, [..., H] -> [..., H] (also each MoE expert).

    gate and up are one ``gate_up_proj`` matmul (checkpoint names gate_proj/up_proj).
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        h, i = hidden_size, intermediate_size
        self.gate_up_proj = MergedLinear(h, {"gate_proj": i, "up_proj": i}, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)
        save_merged_as_parts(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(attn_in); out = h + mlp(norm(h))``.

    ``attn_in`` defaults to ``input_layernorm(x)`` (or ``x`` when built with
    ``input_layernorm=False``, the EAGLE-1 layer); a head can pass its own (EAGLE-3 feeds
    ``[norm(embeds), norm(hidden)]`` of width ``qkv_in_features = 2H``). With ``num_experts``
    in the config the MLP is a :class:`~specdec.models.moe.MoEMLP` (heads built from a MoE
    config get one too, like DeepSeek's MTP layer).
    """

    def __init__(self, config: LlamaConfig, layer_idx: int, qkv_in_features: int | None = None,
                 input_layernorm: bool = True):
        super().__init__()
        h = config.hidden_size
        if input_layernorm:
            self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, qkv_in_features or h)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        if config.extra.get("num_experts"):
            from specdec.models.moe import MoEMLP  # moe builds its experts from MLP
            self.mlp = MoEMLP(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, rope: Rope, kv=None,
                attn_in: torch.Tensor | None = None) -> torch.Tensor:
        if attn_in is None:
            attn_in = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        norm = self.post_attention_layernorm
        h, normed = kernels.add_rms_norm(x, self.self_attn(attn_in, rope, kv), norm.weight,
                                         norm.eps)  # one kernel where Triton runs
        return h + self.mlp(normed)


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Target model; parameter names are HF's (``model.layers.{i}.self_attn.q_proj.weight``, ...)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv=None,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decoder.

        input_ids: [B, T] int64 (kv=None) or [N] (kv given); positions: same shape (or [T]).
        Returns ``hidden [..., H]`` (after the final norm) and ``aux [..., len(aux_layer_ids), H]``
        (None when no ids): aux for id ``i`` is the residual stream at the INPUT of layer ``i``
        (id 0 = the embeddings), vLLM's convention for EAGLE-3.
        """
        for i in aux_layer_ids:
            if not 0 <= i < self.config.num_hidden_layers:
                raise ValueError(f"aux_layer_ids contains {i}: allowed 0..{self.config.num_hidden_layers - 1}")
        x = self.model.embed_tokens(input_ids)
        rope = self.rope(positions, x.dtype)
        aux = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layer_ids:
                aux[i] = x
            x = layer(x, rope, kv)
        stacked = torch.stack([aux[i] for i in aux_layer_ids], dim=-2) if aux_layer_ids else None
        return self.model.norm(x), stacked

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary tables every layer of this forward uses (see :class:`Rope`)."""
        return Rope.at(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., vocab_size]."""
        return self.lm_head(hidden).float()

    def expected_tensors(self) -> dict[str, torch.Size]:
        """Name -> shape of every tensor a checkpoint holds (no ``lm_head.weight`` when tied)."""
        shapes = {k: v.shape for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            del shapes["lm_head.weight"]
        return shapes

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
        """Write ``config.json`` + ``model.safetensors`` (tensors cast to ``dtype``)."""
        tensors = {k: v for k, v in self.state_dict().items() if k in self.expected_tensors()}
        checkpoint.save_folder(path, self.config.to_hf_dict(), tensors, dtype)

    @classmethod
    def load_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "LlamaForCausalLM":
        """Load an HF-style folder; tensors are upcast/cast to ``dtype``; names must match exactly."""
        config = checkpoint.naming_folder(
            path, lambda: LlamaConfig.from_dict(checkpoint.load_config(path)))
        model = cls(config)
        tensors = checkpoint.load_tensors(path)
        checkpoint.check_names(model.expected_tensors(), tensors, path)
        model.load_state_dict(tensors, strict=False)
        return model.to(device=device, dtype=dtype).eval()


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> LlamaForCausalLM:
    return LlamaForCausalLM.load_pretrained(path, dtype, device)
