"""The decoder skeleton every target family fills in plain PyTorch (gpt-fast style) with HF
parameter names: token embedding, a stack of layers, the final norm, the lm_head, aux hidden
states, tensor-parallel sharding and the HF-folder loader. A family (``llama.py``,
``qwen3.py``, ``minimax_m2.py``, ``deepseek.py``, ``qwen3_5.py``, ``gemma.py``, ``phi3.py``,
``gpt_oss.py``) is a subclass supplying its layers, norm, rotary, config check and checkpoint
names; ``DecoderLayer`` is the pre-norm block most of them stack.

The engine's contract (every target family keeps it):
- ``forward(input_ids, positions, kv=None, aux_layer_ids=()) -> (hidden, aux)``: with
  ``kv=None`` inputs are batched ``[B, T]`` and attention is dense causal (training,
  reference); with ``kv`` (a ``PagedKV``) inputs are flat ``[N]``.
- ``compute_logits(hidden [..., H]) -> float32 [..., V]``.
- ``kv_cache_spec() -> list[KVCacheSpec | LinearStateSpec]``: what each layer keeps per token
  or per request (the engine allocates the cache from it, so heads, head dims and windows
  follow the model).
- ``load_pretrained(path, dtype, device)``: the HF folder, shard by shard.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from specdec import kernels
from specdec.distributed import TPContext
from specdec.models import checkpoint
from specdec.models.config import Family, ModelConfig
from specdec.models.layers.moe import MOE_CONFIG_KEYS
from specdec.models.layers.norm import RMSNorm
from specdec.models.layers.parallel import ExpertPlacement, shard_model
from specdec.models.layers.rotary import Rope, RotaryEmbedding


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(attn_in); out = h + mlp(norm(h))``.

    ``attn_in`` defaults to ``input_layernorm(x)`` (or ``x`` when built with
    ``input_layernorm=False``, the EAGLE-1 layer); a head can pass its own (EAGLE-3 feeds
    ``[norm(embeds), norm(hidden)]`` of width ``2H``). ``self_attn``: an ``Attention`` or an
    ``MLAttention``; ``mlp``: an MLP or a MoE.
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float,
                 input_layernorm: bool = True):
        super().__init__()
        if input_layernorm:
            self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = mlp

    @property
    def mixer(self) -> nn.Module:
        """The token mixer, whose cache the layer keeps."""
        return self.self_attn

    def forward(self, x: torch.Tensor, rope: Rope, kv=None,
                attn_in: torch.Tensor | None = None) -> torch.Tensor:
        if attn_in is None:
            attn_in = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        norm = self.post_attention_layernorm
        h, normed = kernels.add_rms_norm(x, self.self_attn(attn_in, rope, kv), norm.weight,
                                         norm.eps)  # one kernel where Triton runs
        return h + self.mlp(normed)

    def forward_carried(self, x: torch.Tensor, carried: torch.Tensor | None, rope: Rope,
                        kv=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``forward`` with the residual adds on both sides fused into the norms: the layer's
        input is ``x + carried`` (``carried`` None: ``x``), added in the input norm's kernel;
        its output ``h + mlp`` is left to the next norm. -> (input, h, mlp out), each
        [..., H]: the next layer's input is ``h + mlp out``, the same sum ``forward`` makes."""
        norm = self.input_layernorm
        if carried is None:
            attn_in = norm(x)
        else:
            x, attn_in = kernels.add_rms_norm(x, carried, norm.weight, norm.eps)
        norm = self.post_attention_layernorm
        h, normed = kernels.add_rms_norm(x, self.self_attn(attn_in, rope, kv), norm.weight,
                                         norm.eps)
        return x, h, self.mlp(normed)


class DecoderForCausalLM(nn.Module, Family):
    """Target model; parameter names are HF's (``model.embed_tokens.weight``,
    ``model.layers.{i}.*``, ``model.norm.weight``, ``lm_head.weight``). The class is named as
    the architecture it reads (``config.json``'s ``architectures[0]``).

    What a family supplies: its facts (``config.Family``: ``MODEL_TYPE``, ``HF_DEFAULTS``,
    ...), ``build_layer`` (its layer ``i``, with a ``mixer`` whose
    ``kv_cache_spec`` the engine reads), ``NORM`` (the final norm's class), ``build_rotary``
    (a layer type with a rope of its own, ``ModelConfig.rope_by_layer_type``, gets that one
    instead), ``embed`` and ``compute_logits`` where they differ (Gemma scales the embedding
    and caps the logits), ``check_config`` (refuses or fills its config keys before anything is
    built), ``CONFIG_KEYS`` (the config keys it reads beyond ``ModelConfig``'s),
    ``IGNORED_TENSORS`` (checkpoint names it skips, as vLLM does), ``MTP_AFTER_LAYERS``,
    ``convert_tensors`` (the stored tensors rewritten: gpt-oss's stacked, MXFP4 experts) and
    ``checkpoint_name`` (HF name on disk -> parameter name).
    """

    tp = TPContext()  # this rank's TP group once layers.parallel.shard_model sharded the model
    expert_placement = ExpertPlacement()  # this rank's routed experts (shard_model's)
    CONFIG_KEYS: frozenset[str] = MOE_CONFIG_KEYS
    # rotary caches some exporters save; MiMo's MTP layers (the head loader reads them)
    IGNORED_TENSORS = re.compile(r".*rotary_emb\.inv_freq$|model\.mtp_layers\..*")
    # the folder stores MTP layers as ``model.layers.{L..}``, after the target's L layers: they
    # are the head's, skipped here
    MTP_AFTER_LAYERS = False
    NORM: type[nn.Module] = RMSNorm

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.check_config(config)
        self.config = config
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList(self.build_layer(i)
                                          for i in range(config.num_hidden_layers))
        self.model.norm = self.NORM(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # pre-norm layers and an RMSNorm at the end: each residual add runs in the next norm's
        # kernel (DecoderLayer.forward_carried), one kernel per norm where Triton runs
        self.carries_residual = type(self.model.norm) is RMSNorm and all(
            type(layer) is DecoderLayer and hasattr(layer, "input_layernorm")
            for layer in self.model.layers)
        self.rotary = self.build_rotary()
        self.type_rotary = {kind: RotaryEmbedding(config.head_dim, params,
                                                  config.max_position_embeddings)
                            for kind, params in (config.rope_by_layer_type or {}).items()}

    @staticmethod
    def check_config(config: ModelConfig) -> None:
        """Refuse what the family does not implement (naming the key), fill its defaults."""

    def build_layer(self, layer_idx: int) -> nn.Module:
        """Decoder layer ``layer_idx`` of this family."""
        raise NotImplementedError

    def build_rotary(self) -> RotaryEmbedding:
        """The rope of every attention layer (here: all ``head_dim`` channels)."""
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
        x, carried = tp.shard(self.embed(input_ids)), None
        inputs = []  # each layer's input: a list, which compile_dynamic's symbolic ids index
        for layer, rope in zip(self.model.layers, self.layer_ropes(positions, x.dtype)):
            if self.carries_residual:  # the layer's input is x + carried
                layer_input, x, carried = layer.forward_carried(x, carried, rope, kv)
                inputs.append(layer_input)
            else:
                inputs.append(x)
                x = layer(x, rope, kv)
        stacked = (tp.gather(torch.stack([inputs[i] for i in aux_layer_ids], dim=-2))
                   if aux_layer_ids else None)
        norm = self.model.norm
        if carried is None:
            return tp.gather(norm(x)), stacked
        return tp.gather(kernels.add_rms_norm(x, carried, norm.weight, norm.eps)[1]), stacked

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [...] -> the first layer's input [..., H]: the embedding rows."""
        return self.model.embed_tokens(input_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotary tables of this forward's layers (but those of a type with its own)."""
        return self.rotary.tables(positions, dtype)

    def layer_ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> list[Rope]:
        """Each layer's rotary tables for this forward: its type's own rope
        (``type_rotary``), else ``rope``'s; each computed once."""
        rope = self.rope(positions, dtype)
        own = {kind: r.tables(positions, dtype) for kind, r in self.type_rotary.items()}
        kinds = self.config.layer_types or ["full_attention"] * self.config.num_hidden_layers
        return [own.get(kind, rope) for kind in kinds]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> float32 logits [..., vocab_size]."""
        return self.lm_head(hidden).float()

    def kv_cache_spec(self) -> list:
        """Per layer: a ``KVCacheSpec`` (paged attention) or a ``LinearStateSpec``."""
        return [layer.mixer.kv_cache_spec() for layer in self.model.layers]

    # ---- checkpoints ---------------------------------------------------------------------
    def checkpoint_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into (None: skipped); a family renames
        first, then calls this."""
        if self.config.tie_word_embeddings and name == "lm_head.weight":
            return None  # a tied model's copy of the embedding
        if self.MTP_AFTER_LAYERS and name.startswith("model.layers.") and \
                int(name.split(".")[2]) >= self.config.num_hidden_layers:
            return None  # the MTP layers, stored after the target's (the head reads them)
        return None if self.IGNORED_TENSORS.fullmatch(name) else name

    def convert_tensors(self, tensors, folder: str):
        """The checkpoint's (stored name, tensor) pairs as this family loads them (before
        ``checkpoint_name``); here as stored."""
        return tensors

    def stored_slice(self, name: str) -> tuple[int, int, int] | None:
        """Of a tensor as stored (before ``convert_tensors``): the ``(dim, start, stop)`` this
        rank reads when the family knows better than the sharded names; None: as sharded."""
        return None

    def expected_tensors(self) -> dict[str, torch.Size]:
        """Name -> shape of every tensor a checkpoint holds (no ``lm_head.weight`` when tied)."""
        shapes = {k: v.shape for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            del shapes["lm_head.weight"]
        return shapes

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
        """Write ``config.json`` + ``model.safetensors`` (tensors cast to ``dtype``)."""
        tensors = {k: v for k, v in self.state_dict().items() if k in self.expected_tensors()}
        checkpoint.save_folder(path, self.config.to_hf_dict(type(self)), tensors, dtype)

    @classmethod
    def load_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        config: ModelConfig | None = None,
                        tp: TPContext | None = None,
                        experts: ExpertPlacement = ExpertPlacement()) -> DecoderForCausalLM:
        """Load an HF folder (one file, shards with an index, or ``pytorch_model.bin``) shard
        by shard into the model's parameters, cast to ``dtype``; every parameter must be
        found, and every tensor used or known to be skipped. ``tp`` (size > 1) or ``experts``
        (this rank's routed experts, ``layers.parallel.ExpertPlacement``): the model is built
        on the meta device, sharded (``layers.parallel.shard_model``) and only this rank's
        slice of each tensor, and its experts' tensors, are read."""
        if config is None:
            config = checkpoint.naming_folder(
                path, lambda: ModelConfig.from_folder(path, cls))
        slices = not_held = None
        tp = tp or TPContext()
        if tp.size > 1 or experts.size > 1:
            with torch.device("meta"):
                model = checkpoint.naming_folder(path, lambda: cls(config)).to(dtype)
            whole = set(model.expected_tensors())
            slices = checkpoint.naming_folder(path, lambda: shard_model(model, tp, experts))
            # the other ranks' experts (and biases added once, on TP rank 0): never read
            not_held = (whole - set(model.expected_tensors())).__contains__
            model = model.to_empty(device=device)
            if config.tie_word_embeddings:
                model.lm_head.weight = model.model.embed_tokens.weight
        else:
            model = checkpoint.naming_folder(path, lambda: cls(config)).to(dtype)
        state = model.state_dict()  # views of the parameters (merged ones as their parts)
        checkpoint.load_into({k: state[k] for k in model.expected_tensors()}, path,
                             rename=model.checkpoint_name, ignore=not_held,
                             weight_block_size=config.weight_block_size,
                             shard=None if slices is None
                             else lambda name: model.stored_slice(name) or slices.get(name),
                             convert=model.convert_tensors if type(model).convert_tensors
                             is not DecoderForCausalLM.convert_tensors else None)
        return model.to(device=device).eval()
