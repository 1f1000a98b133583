"""The pre-norm decoder family: Llama-2/3/3.1/3.2, Mistral, Qwen2/2.5 (and MiMo's target), in
plain PyTorch (gpt-fast style) with HF parameter names. Qwen3, Qwen3-MoE and MiniMax-M2 are
this model with other layer options (``qwen3.py``, ``minimax_m2.py``).

The engine's contract (every target family keeps it):
- ``forward(input_ids, positions, kv=None, aux_layer_ids=()) -> (hidden, aux)``: with
  ``kv=None`` inputs are batched ``[B, T]`` and attention is dense causal (training,
  reference); with ``kv`` (a ``PagedKV``) inputs are flat ``[N]``.
- ``compute_logits(hidden [..., H]) -> float32 [..., V]``.
- ``kv_cache_spec() -> list[KVCacheSpec]``: what each layer keeps per token (the engine
  allocates the cache from it, so heads, head dims and windows follow the model).
- ``load_pretrained(path, dtype, device)``: the HF folder, shard by shard.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from specdec import kernels
from specdec.attention import KVCacheSpec
from specdec.distributed import TPContext
from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.layers.attention import Attention
from specdec.models.layers.mlp import MLP
from specdec.models.layers.moe import MOE_CONFIG_KEYS, MoEMLP, is_moe_layer
from specdec.models.layers.norm import RMSNorm
from specdec.models.layers.parallel import shard_model
from specdec.models.layers.rotary import Rope, RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(attn_in); out = h + mlp(norm(h))``.

    ``attn_in`` defaults to ``input_layernorm(x)`` (or ``x`` when built with
    ``input_layernorm=False``, the EAGLE-1 layer); a head can pass its own (EAGLE-3 feeds
    ``[norm(embeds), norm(hidden)]`` of width ``2H``). ``mlp``: an MLP or a MoE.
    """

    def __init__(self, self_attn: Attention, mlp: nn.Module, hidden_size: int, eps: float,
                 input_layernorm: bool = True):
        super().__init__()
        if input_layernorm:
            self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: Rope, kv=None,
                attn_in: torch.Tensor | None = None) -> torch.Tensor:
        if attn_in is None:
            attn_in = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        norm = self.post_attention_layernorm
        h, normed = kernels.add_rms_norm(x, self.self_attn(attn_in, rope, kv), norm.weight,
                                         norm.eps)  # one kernel where Triton runs
        return h + self.mlp(normed)


def build_layer(config: ModelConfig, layer_idx: int, *, qk_norm: str | None = None,
                in_features: int | None = None, input_layernorm: bool = True,
                sliding_window: int | None = None) -> DecoderLayer:
    """One decoder layer of ``config``'s shape (its MLP a MoE where ``is_moe_layer``)."""
    c = config
    attn = Attention(layer_idx, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                     c.head_dim, in_features=in_features, qkv_bias=c.attention_bias,
                     qk_norm=qk_norm, eps=c.rms_norm_eps, sliding_window=sliding_window)
    mlp = MoEMLP(c) if is_moe_layer(c, layer_idx) else MLP(c.hidden_size, c.intermediate_size)
    return DecoderLayer(attn, mlp, c.hidden_size, c.rms_norm_eps, input_layernorm)


class LlamaForCausalLM(nn.Module):
    """Target model; parameter names are HF's (``model.layers.{i}.self_attn.q_proj.weight``, ...).

    Family options a subclass sets: ``QK_NORM`` (see ``layers.attention``), ``CONFIG_KEYS``
    (the config keys it reads beyond ``ModelConfig``'s), ``IGNORED_TENSORS`` (checkpoint names
    it skips, as vLLM does) and ``checkpoint_name`` (HF name on disk -> parameter name).
    """

    QK_NORM: str | None = None
    tp = TPContext()  # this rank's TP group once layers.parallel.shard_model sharded the model
    CONFIG_KEYS: frozenset[str] = MOE_CONFIG_KEYS
    # rotary caches some exporters save; MiMo's MTP layers (the head loader reads them)
    IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$|model\.mtp_layers\..*")

    NORM = RMSNorm  # the final norm's class

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(self.build_layer(i)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = self.NORM(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = self.build_rotary()

    def build_layer(self, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx`` of this family (the families override it)."""
        return build_layer(self.config, layer_idx, qk_norm=self.QK_NORM,
                           sliding_window=self.config.sliding_window_of(layer_idx))

    def build_rotary(self):
        c = self.config
        return RotaryEmbedding(c.head_dim, c.rope, c.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv=None,
                aux_layer_ids: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the decoder.

        input_ids: [B, T] int64 (kv=None) or [N] (kv given); positions: same shape (or [T]).
        Returns ``hidden [..., H]`` (after the final norm) and ``aux [..., len(aux_layer_ids), H]``
        (None when no ids): aux for id ``i`` is the residual stream at the INPUT of layer ``i``
        (id 0 = the embeddings), vLLM's convention for EAGLE-3. Under sequence parallelism
        (kv given) the layers run on this rank's N/T tokens; both outputs are gathered.
        """
        for i in aux_layer_ids:
            if not 0 <= i < self.config.num_hidden_layers:
                raise ValueError(f"aux_layer_ids contains {i}: allowed "
                                 f"0..{self.config.num_hidden_layers - 1}")
        tp = self.tp
        if tp.sp and kv is None:
            raise ValueError("sequence parallelism runs the paged (kv) path only; the dense "
                             "kv=None forward needs sequence_parallel=False")
        x = tp.shard(self.model.embed_tokens(input_ids))
        rope = self.rope(positions, x.dtype)
        inputs = []  # each layer's input: a list, which compile_dynamic's symbolic ids index
        for layer in self.model.layers:
            inputs.append(x)
            x = layer(x, rope, kv)
        stacked = (tp.gather(torch.stack([inputs[i] for i in aux_layer_ids], dim=-2))
                   if aux_layer_ids else None)
        return tp.gather(self.model.norm(x)), stacked

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary tables every layer of this forward uses."""
        return self.rotary.tables(positions, dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., vocab_size]."""
        return self.lm_head(hidden).float()

    def kv_cache_spec(self) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_cache_spec() for layer in self.model.layers]

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into (None: skipped)."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None  # a tied model's copy of the embedding
        return None if self.IGNORED_TENSORS.fullmatch(name) else name

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
                        device: str | torch.device = "cpu",
                        config: ModelConfig | None = None,
                        tp: TPContext | None = None) -> LlamaForCausalLM:
        """Load an HF folder (one file, shards with an index, or ``pytorch_model.bin``) shard
        by shard into the model's parameters, cast to ``dtype``; every parameter must be
        found, and every tensor used or known to be skipped. ``tp`` (size > 1): the model is
        built on the meta device, sharded (``layers.parallel.shard_model``) and only this
        rank's slice of each tensor is read."""
        if config is None:
            config = checkpoint.naming_folder(
                path, lambda: ModelConfig.from_folder(path, cls.CONFIG_KEYS))
        slices = None
        if tp is not None and tp.size > 1:
            with torch.device("meta"):
                model = checkpoint.naming_folder(path, lambda: cls(config)).to(dtype)
            slices = checkpoint.naming_folder(path, lambda: shard_model(model, tp))
            model = model.to_empty(device=device)
            if config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
        else:
            model = checkpoint.naming_folder(path, lambda: cls(config)).to(dtype)
        state = model.state_dict()  # views of the parameters (merged ones as their parts)
        checkpoint.load_into({k: state[k] for k in model.expected_tensors()}, path,
                             rename=model.checkpoint_name,
                             weight_block_size=config.weight_block_size,
                             shard=None if slices is None else slices.get)
        return model.to(device=device).eval()


def load_pretrained(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: str | torch.device = "cpu") -> nn.Module:
    """Any registered architecture (``specdec.models.registry``)."""
    from specdec.models.registry import load_model
    return load_model(path, dtype, device)
