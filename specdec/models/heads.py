"""Draft heads (MTP, EAGLE-1, EAGLE-3) in the checkpoint layouts vLLM's loaders accept,
including the folders people download (see "Published folders" below).

What vLLM does (read in vllm/model_executor/models/{mimo_mtp,llama_eagle,llama_eagle3,
deepseek_mtp,qwen2,llama,utils}.py, v1/spec_decode/llm_base_proposer.py, v1/worker/
gpu_model_runner.py and config/speculative.py; summarised here, nothing copied):

MTP, MiMo layout (mimo_mtp.py). vLLM recognises it by ``architectures[0] == "MiMoForCausalLM"``
and rewrites the config to ``MiMoMTPModel`` with ``num_hidden_layers = 0`` and
``n_predict = num_nextn_predict_layers``, so the file names are ``model.mtp_layers.0.*``.
Step: the token embedding is zeroed where ``position == 0``; ``token_layernorm(embeds)`` and
``hidden_layernorm(hidden)`` are concatenated HIDDEN FIRST and mapped by ``input_proj [H, 2H]``;
then a Qwen2 decoder layer (q/k/v WITH biases, o_proj without; its tensors are stored flat under
``model.mtp_layers.0.{input_layernorm,post_attention_layernorm,self_attn,mlp}``, vLLM inserts
``mtp_block``); ``final_layernorm(residual + mlp_out)`` is the single output, used for the
logits (shared lm_head) and as the next step's hidden. The input hidden is the target's final
(normed) hidden. vLLM's loader returns the set of loaded names, so the strict "weights not
initialized" check applies: it owns ``model.embed_tokens`` and ``lm_head`` and needs them in the
folder; we therefore save copies of the target's two matrices there and ignore them on load.
(DeepSeek MTP differs: ``enorm``/``hnorm``/``eh_proj`` with EMBEDS FIRST, and a ``shared_head``
norm applied before the lm_head instead of a final_layernorm; same position-0 masking.)

EAGLE-1 (llama_eagle.py): a ``LlamaForCausalLM`` folder with ``fc.weight [H, 2H]`` applied to
``cat(embeds, hidden)`` (EMBEDS FIRST, no norms), then ``layers.0`` whose input_layernorm is an
identity (so ``layers.0.input_layernorm`` is absent), no final norm: the output
``residual + mlp_out`` goes straight to the shared lm_head and is also the next hidden. The input
hidden is the target's final hidden.

EAGLE-3 (llama_eagle3.py): ``architectures: ["LlamaForCausalLMEagle3"]``; ``midlayer.*`` is
renamed to ``layers.0.*``. The target supplies aux states (the residual stream at the input of
layers ``eagle_aux_hidden_state_layer_ids``; vLLM's Llama adds ``hidden + residual`` before
running those layers); ``combine_hidden_states`` = ``fc [H, 3H]`` over their concatenation in id
order, only for the target's states. Layer: attention input is
``cat(input_layernorm(embeds), hidden_norm(hidden))`` (EMBEDS FIRST, q/k/v in_features 2H), the
residual is the un-normed hidden (``norm_before_residual`` false); then the usual post-attention
norm + MLP. Output: ``norm(residual + mlp_out)`` feeds ``lm_head [draft_vocab, H]``; the pre-norm
sum is the next step's hidden. ``d2t`` (optional, int64) maps ``target = draft + d2t[draft]``
(absent: zeros, i.e. the first ``draft_vocab_size`` target ids); ``t2d`` is skipped.
Aux layer ids (gpu_model_runner ``_get_eagle3_aux_layers_from_config``): the head config's
``eagle_aux_hidden_state_layer_ids``, else its ``eagle_config.eagle_aux_hidden_state_layer_ids``,
else the target's default ``(2, L // 2, L - 3)``.

Embeddings (llm_base_proposer ``has_own_embed_tokens``, set by utils ``process_eagle_weight``
when a checkpoint name holds ``embed_tokens``): an EAGLE head that ships ``embed_tokens.weight``
keeps its own unless it is identical to the target's, in which case the target's is shared;
without one the target's is shared. (Older vLLM skipped an EAGLE-1 head's copy outright; for the
published heads, whose copy is the target's, both give the same tokens.)

All three run their single layer as KV layer 0 of the draft's own cache.

Published folders this module loads (``load_head``):
- EAGLE-1 as yuhuili/EAGLE-* ship it: ``LlamaForCausalLM`` config (``"bias"``: EAGLE's flag for an
  ``fc.bias``; absent, the file decides), ``pytorch_model.bin`` with ``embed_tokens.weight``,
  ``fc.weight`` (+ ``fc.bias``), ``layers.0.*``. vLLM's v1 EAGLE-1 ``fc`` has no bias (its loader
  refuses, or in one version drops, ``fc.bias``); EAGLE's own model (eagle/model/cnets1.py) adds
  it, so the heads were trained with it and it is applied here.
- EAGLE-3 as yuhuili/EAGLE3-* and the Qwen3 EAGLE-3 heads ship it: ``midlayer.*``, ``fc``,
  ``norm``, ``lm_head [draft_vocab, H]``, ``d2t`` int64, ``t2d`` bool (skipped), optional
  ``embed_tokens.weight``; a ``LlamaForCausalLM`` architecture with ``draft_vocab_size`` or aux
  ids in its config counts as EAGLE-3. MoE keys copied from a MoE target's config are not read
  (vLLM's Llama layer reads none: the head's MLP is dense).
- MiMo: ONE folder holding the target and ``model.mtp_layers.0.*``; the target's own tensors
  (``model.layers.*``, ``model.norm``) are never read by the head, the two shared copies only
  have their shapes checked.
Every head skips ``*.rotary_emb.inv_freq`` (an old exporter's buffer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from specdec.attention import KVCacheSpec
from specdec.config import default_aux_layer_ids
from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.layers.attention import Attention
from specdec.models.layers.moe import MOE_CONFIG_KEYS
from specdec.models.layers.norm import RMSNorm
from specdec.models.layers.rotary import Rope, RotaryEmbedding
from specdec.models.llama import DecoderLayer, LlamaForCausalLM, build_layer
from specdec.models.registry import ARCHITECTURES

MTP_ARCH = "MiMoForCausalLM"
DEEPSEEK_ARCH = "DeepseekV3ForCausalLM"  # its MTP layer: models/deepseek_mtp.py
QWEN3_5_ARCH = "Qwen3_5ForCausalLM"  # its MTP layer (mtp.*): models/qwen3_5_mtp.py
QWEN3_NEXT_ARCH = "Qwen3NextForCausalLM"  # the same layout
QWEN3_5_VL_ARCH = "Qwen3_5ForConditionalGeneration"  # the same layout
QWEN3_5_MTP_ARCHS = (QWEN3_5_ARCH, QWEN3_NEXT_ARCH, QWEN3_5_VL_ARCH)
EAGLE_ARCHS = ("LlamaForCausalLM", "EagleLlamaForCausalLM")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# config keys that make a LlamaForCausalLM-architecture head folder an EAGLE-3 head
EAGLE3_KEYS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "eagle_config")
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
OWN_EMBED = "embed_tokens.weight"  # an EAGLE head's optional own embedding
# checkpoint tensors no head reads: an old exporter's rotary buffer
SKIPPED = re.compile(r".*rotary_emb\.inv_freq")


@dataclass
class SharedWeights:
    """The target's embedding and lm_head, referenced (not owned, not saved) by a head."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


class DraftHead(nn.Module):
    """Common interface the proposers call; subclasses define the layer and the layout.

    Checkpoint layout hooks: ``skips(name)`` (tensors of the folder the head never reads),
    ``SHARED_COPIES`` (checkpoint name -> the ``SharedWeights`` field it copies: only its shape
    is checked) and ``from_checkpoint`` (what the tensors present decide, e.g. an own
    embedding)."""

    method = ""
    aux_layer_ids: tuple[int, ...] = ()  # target layers whose input states feed the head
    SHARED_COPIES: dict[str, str] = {}

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, *, own_embed: bool = False):
        super().__init__()
        t = target.config
        if (config.hidden_size, config.vocab_size) != (t.hidden_size, t.vocab_size):
            raise ValueError(f"{type(self).__name__}: head hidden_size/vocab_size "
                             f"{config.hidden_size}/{config.vocab_size} != target's "
                             f"{t.hidden_size}/{t.vocab_size}")
        self.config = config
        self.shared = SharedWeights(target.model.embed_tokens, target.lm_head)
        self.draft_vocab_size = config.vocab_size
        self.rotary = RotaryEmbedding(config.head_dim, config.rope,
                                      config.max_position_embeddings)
        if own_embed:  # a head that ships an embedding other than the target's uses its own
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)

    @classmethod
    def skips(cls, name: str) -> bool:
        """True for a checkpoint tensor this head never reads (it is not even loaded)."""
        return SKIPPED.fullmatch(name) is not None

    @classmethod
    def from_checkpoint(cls, config: ModelConfig, target: LlamaForCausalLM,
                        tensors: dict[str, torch.Tensor], **options) -> DraftHead:
        """The head the folder's ``tensors`` (not yet loaded) describe."""
        return cls(config, target, **options)

    def kv_cache_spec(self) -> list[KVCacheSpec]:
        """One spec per attention layer of the head (its own KV cache)."""
        return [m.kv_cache_spec() for m in self.modules() if isinstance(m, Attention)]

    def combine_hidden_states(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Target hidden [N, H] -> the head's input hidden [N, H] (identity here)."""
        return target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv=None) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step.

        input_ids: [N] int64 (the token after the one ``hidden`` was computed at);
        positions: [N] (the position of ``hidden``'s token); hidden: [N, H].
        With kv=None the leading dims are [B, T] and attention is dense causal.
        Returns ``(logits_hidden [N, H], next_hidden [N, H])``.
        """
        raise NotImplementedError

    def compute_logits(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> float32 [..., draft_vocab_size]."""
        return self.shared.lm_head(logits_hidden).float()

    def draft_to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """What ``save_pretrained`` writes (the head's tensors, plus any shared copies)."""
        return dict(self.state_dict())

    def expected_tensors(self) -> dict[str, torch.Size]:
        """What a folder must hold for this head (shared copies are optional)."""
        return {k: v.shape for k, v in self.state_dict().items()}

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
        checkpoint.save_folder(path, self.config.to_hf_dict(), self.checkpoint_tensors(), dtype)

    def load_tensors(self, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
        """Load the folder's tensors: every expected one present with its shape, no other
        (shared copies: shape checked, then dropped); ValueError naming the offenders."""
        tensors = dict(tensors)
        for name, field in self.SHARED_COPIES.items():
            if name in tensors:
                want = _full_shape(getattr(self.shared, field))
                if tensors[name].shape != want:
                    raise ValueError(f"checkpoint {str(path)!r}: wrong shapes "
                                     f"['{name}: {tuple(tensors[name].shape)} != {tuple(want)}'] "
                                     "(a copy of the target's)")
                del tensors[name]
        checkpoint.check_names(self.expected_tensors(), tensors, path)
        self.load_state_dict(tensors)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        own = getattr(self, "embed_tokens", None)
        return (own if own is not None else self.shared.embed_tokens)(input_ids)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary.tables(positions, dtype)


class MtpHead(DraftHead):
    """MiMo-style MTP layer: ``model.mtp_layers.0.*`` (Qwen2 decoder layer + input projection),
    in a head folder of its own or in the MiMo target's folder."""

    method = "mtp"
    # vLLM's MiMo loader requires these two in the folder; they are the target's
    SHARED_COPIES = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}
    # a MiMo checkpoint's target tensors (the target loader reads them, the head never does)
    TARGET_TENSORS = re.compile(r"model\.(layers\.\d+\..*|norm\.weight)")

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__(config, target)
        if config.architectures[0] != MTP_ARCH or config.extra.get("num_nextn_predict_layers") != 1:
            raise ValueError(f"MtpHead config: architectures={config.architectures}, "
                             f"num_nextn_predict_layers={config.extra.get('num_nextn_predict_layers')}"
                             f"; need ['{MTP_ARCH}'] and 1")
        self.model = nn.Module()
        self.model.mtp_layers = nn.ModuleList([_MtpLayer(config)])

    @classmethod
    def skips(cls, name):
        return super().skips(name) or cls.TARGET_TENSORS.fullmatch(name) is not None

    def forward(self, input_ids, positions, hidden, kv=None):
        layer = self.model.mtp_layers[0]
        emb = self._embed(input_ids).masked_fill((positions == 0)[..., None], 0.0)
        x = layer.input_proj(torch.cat((layer.hidden_layernorm(hidden),
                                        layer.token_layernorm(emb)), dim=-1))
        out = layer.final_layernorm(layer(x, self._rope(positions, x.dtype), kv))
        return out, out

    def checkpoint_tensors(self):
        return dict(self.state_dict(), **{"model.embed_tokens.weight": self.shared.embed_tokens.weight,
                                          "lm_head.weight": self.shared.lm_head.weight})


class _MtpLayer(DecoderLayer):
    def __init__(self, config: ModelConfig):
        base = build_layer(config, 0)
        super().__init__(base.self_attn, base.mlp, config.hidden_size, config.rms_norm_eps)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, eps)


class _LlamaStyleHead(DraftHead):
    """An EAGLE head: a Llama layer (whatever the target's family: MoE keys copied from a MoE
    target's config are not read, as vLLM's Llama layer reads none) with an optional own
    ``embed_tokens``."""

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, *, own_embed: bool = False):
        config = replace(config, extra={k: v for k, v in config.extra.items()
                                        if k not in MOE_CONFIG_KEYS})
        super().__init__(config, target, own_embed=own_embed)

    @classmethod
    def from_checkpoint(cls, config, target, tensors, **options):
        return cls(config, target, own_embed=_keeps_own_embedding(tensors, target), **options)


class EagleHead(_LlamaStyleHead):
    """EAGLE-1: ``fc [H, 2H]`` (bias optional) over ``cat(embeds, hidden)`` + ``layers.0``
    without input norm."""

    method = "eagle"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, *, own_embed: bool = False,
                 fc_bias: bool = False):
        super().__init__(config, target, own_embed=own_embed)
        config = self.config
        if config.num_hidden_layers != 1:
            raise ValueError(f"EagleHead config num_hidden_layers={config.num_hidden_layers}: "
                             "only 1 is supported")
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([build_layer(config, 0, input_layernorm=False)])
        if fc_bias:
            self.config.extra["bias"] = True  # EAGLE's own spelling, written back on save

    @classmethod
    def from_checkpoint(cls, config, target, tensors, *, fc_bias=None, **options):
        # EAGLE's ``bias`` config flag when given, else the file decides
        return super().from_checkpoint(config, target, tensors, **options,
                                       fc_bias="fc.bias" in tensors if fc_bias is None else fc_bias)

    def forward(self, input_ids, positions, hidden, kv=None):
        x = self.fc(torch.cat((self._embed(input_ids), hidden), dim=-1))
        out = self.layers[0](x, self._rope(positions, x.dtype), kv)
        return out, out


class Eagle3Head(_LlamaStyleHead):
    """EAGLE-3: ``fc [H, 3H]`` over target aux states, ``midlayer`` with 2H-wide q/k/v,
    ``norm``, own ``lm_head [draft_vocab, H]`` and optional ``d2t``.

    Aux layer ids: the config's (top level or under ``eagle_config``), else ``aux_layer_ids``
    (the speculative config's ``draft_model_config``), else vLLM's default (2, L // 2, L - 3)."""

    method = "eagle3"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM, *, own_embed: bool = False,
                 aux_layer_ids: list[int] | tuple[int, ...] | None = None):
        super().__init__(config, target, own_embed=own_embed)
        config = self.config
        extra = config.extra
        n_layers = target.config.num_hidden_layers
        ids, where = head_aux_layer_ids(extra), "the head config"
        if ids is None and aux_layer_ids is not None:
            ids, where = list(aux_layer_ids), "speculative_config.draft_model_config"
        if ids is None:
            ids = list(default_aux_layer_ids(n_layers))
            where = f"vLLM's default (2, L // 2, L - 3) for L={n_layers}"
        if (not isinstance(ids, list) or len(ids) != 3 or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in ids)):
            raise ValueError(f"Eagle3Head {AUX_IDS_KEY}={ids!r} (from {where}): need 3 "
                             f"target layer ids in 0..{n_layers - 1}")
        eagle_config = extra.get("eagle_config") or {}
        if not isinstance(eagle_config, dict) or not eagle_config.get("use_aux_hidden_state", True):
            raise ValueError(f"Eagle3Head config eagle_config={eagle_config!r}: only "
                             "use_aux_hidden_state=true (fc over 3 target layers) is supported")
        if extra.get("norm_before_residual", False):
            raise ValueError("Eagle3Head config norm_before_residual=True is not supported")
        if extra.get("target_hidden_size", config.hidden_size) != config.hidden_size:
            raise ValueError(f"Eagle3Head config target_hidden_size={extra['target_hidden_size']}: "
                             f"must equal hidden_size={config.hidden_size}")
        draft_vocab = extra.get("draft_vocab_size") or config.vocab_size
        if not 0 < draft_vocab <= config.vocab_size:
            raise ValueError(f"Eagle3Head config draft_vocab_size={draft_vocab}: "
                             f"allowed 1..{config.vocab_size}")
        extra.setdefault(AUX_IDS_KEY, list(ids))  # a saved head names the ids it was run with
        self.aux_layer_ids = tuple(ids)
        self.draft_vocab_size = draft_vocab
        h = config.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = _Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        if draft_vocab < config.vocab_size:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

    @classmethod
    def skips(cls, name):
        return super().skips(name) or name == "t2d"  # target -> draft mask: unused (vLLM too)

    def load_tensors(self, tensors, path):
        if hasattr(self, "d2t"):
            tensors = dict(tensors)
            d2t = tensors.setdefault("d2t", torch.zeros_like(self.d2t))  # absent: vLLM's zeros
            if d2t.is_floating_point() or d2t.dtype == torch.bool:
                raise ValueError(f"checkpoint {str(path)!r}: d2t has dtype {d2t.dtype}; need "
                                 "integer offsets (int64)")
            tensors["d2t"] = d2t.to(torch.int64)
        super().load_tensors(tensors, path)

    def combine_hidden_states(self, target_aux: torch.Tensor) -> torch.Tensor:
        """Aux states [..., 3, H] (stacked, as the target returns them) or [..., 3H] -> [..., H]."""
        h = self.config.hidden_size
        if target_aux.shape[-2:] == (3, h):
            target_aux = target_aux.flatten(-2)
        if target_aux.shape[-1] != 3 * h:
            raise ValueError(f"Eagle3Head.combine_hidden_states: shape {tuple(target_aux.shape)}; "
                             f"need [..., 3, {h}] or [..., {3 * h}]")
        return self.fc(target_aux)

    def forward(self, input_ids, positions, hidden, kv=None):
        out = self.midlayer.run(self._embed(input_ids), hidden,
                                self._rope(positions, hidden.dtype), kv)
        return self.norm(out), out

    def compute_logits(self, logits_hidden):
        return self.lm_head(logits_hidden).float()

    def check_d2t(self) -> None:
        """Every draft id must map into the target vocabulary."""
        mapped = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        bad = ((mapped < 0) | (mapped >= self.config.vocab_size)).nonzero().flatten()
        if len(bad):
            i = int(bad[0])
            raise ValueError(f"d2t[{i}]={int(self.d2t[i])} maps draft id {i} to {int(mapped[i])}, "
                             f"outside the target vocab [0, {self.config.vocab_size}) "
                             f"({len(bad)} bad entries)")

    def draft_to_target_ids(self, ids):
        """``target = draft + d2t[draft]``; e.g. d2t=[0, 4, 4] maps [0, 1, 2] -> [0, 5, 6]."""
        return ids + self.d2t[ids] if hasattr(self, "d2t") else ids


class _Eagle3Layer(DecoderLayer):
    def __init__(self, config: ModelConfig):
        base = build_layer(config, 0, in_features=2 * config.hidden_size)
        super().__init__(base.self_attn, base.mlp, config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def run(self, embeds, hidden, rope, kv):
        attn_in = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        return self(hidden, rope, kv, attn_in=attn_in)


def head_aux_layer_ids(config: dict) -> list | None:
    """A head config's aux layer ids as vLLM reads them: ``eagle_aux_hidden_state_layer_ids``,
    else ``eagle_config.eagle_aux_hidden_state_layer_ids``; None when neither is set (an empty
    list counts as unset, as in vLLM)."""
    ids = config.get(AUX_IDS_KEY)
    if not ids and isinstance(config.get("eagle_config"), dict):
        ids = config["eagle_config"].get(AUX_IDS_KEY)
    return ids or None


def _keeps_own_embedding(tensors: dict[str, torch.Tensor], target: LlamaForCausalLM) -> bool:
    """Whether an EAGLE head uses its own ``embed_tokens.weight``: when it ships one that is
    not identical to the target's (vLLM's ``has_own_embed_tokens`` + ``torch.equal``); an
    identical copy is dropped from ``tensors`` and the target's is shared."""
    t = tensors.get(OWN_EMBED)
    if t is None:
        return False
    embed = target.model.embed_tokens
    w = embed.weight  # a tensor-parallel rank holds rows start.. of the table
    if t.shape != _full_shape(embed) or t.is_floating_point() != w.is_floating_point():
        return True  # kept: the load names the wrong shape
    start = getattr(embed, "start", 0)
    t = t[start:start + w.shape[0]]
    rows = max(1, (1 << 24) // max(w.shape[1], 1))  # compare ~64 MB at a time
    with torch.no_grad():
        same = all(torch.equal(t[i:i + rows].to(device=w.device, dtype=w.dtype), w[i:i + rows])
                   for i in range(0, w.shape[0], rows))
    if same:
        del tensors[OWN_EMBED]
    return not same


def _full_shape(layer: nn.Module) -> torch.Size:
    """The unsharded shape of a target's embedding / lm_head (vocab-parallel under TP)."""
    w = layer.weight
    tp = getattr(layer, "tp", None)
    return torch.Size((w.shape[0] * (tp.size if tp is not None else 1), *w.shape[1:]))


def head_config(method: str, target_config: ModelConfig, **extra) -> ModelConfig:
    """A head config sized like the target (one layer), with the keys vLLM reads for ``method``.

    The target family's own keys that no head reads are left out: q/k-norm and attention-type
    keys (MiniMax-M2), the sliding window (a head attends to every earlier token), and for the
    Llama-style EAGLE heads the MoE keys (their MLP is dense; an MTP layer of a MoE target stays
    a MoE). Eagle3 takes ``eagle_aux_hidden_state_layer_ids=[...]`` (default: vLLM's
    (2, L // 2, L - 3)) and optional ``draft_vocab_size``.
    """
    archs = {"mtp": [MTP_ARCH], "eagle": ["LlamaForCausalLM"], "eagle3": ["LlamaForCausalLMEagle3"]}
    if method not in archs:
        raise ValueError(f"head method={method!r}: allowed {sorted(archs)}")
    family = ARCHITECTURES.get(target_config.architectures[0], LlamaForCausalLM).CONFIG_KEYS
    unread = (family - MOE_CONFIG_KEYS) | {"layer_types", "sliding_window"}
    if method != "mtp":
        unread |= MOE_CONFIG_KEYS
    d = {k: v for k, v in target_config.to_hf_dict().items() if k not in unread}
    d.update(architectures=archs[method], num_hidden_layers=1, tie_word_embeddings=False, **extra)
    if method == "mtp":
        d["num_nextn_predict_layers"] = 1
    if method == "eagle3":
        d.setdefault("draft_vocab_size", target_config.vocab_size)
        d["norm_before_residual"] = False
    return ModelConfig.from_dict(d, MOE_CONFIG_KEYS)


HEAD_CLASSES = {"mtp": MtpHead, "eagle": EagleHead, "eagle3": Eagle3Head}


def build_head(method: str, target: LlamaForCausalLM, **extra) -> DraftHead:
    """A freshly initialised head for ``target`` (training)."""
    return HEAD_CLASSES[method](head_config(method, target.config, **extra), target)


def head_class_for(config: ModelConfig) -> type[DraftHead]:
    arch = config.architectures[0]
    if arch == MTP_ARCH:
        return MtpHead
    if arch in EAGLE3_ARCHS or (arch in EAGLE_ARCHS
                                and any(config.extra.get(k) for k in EAGLE3_KEYS)):
        return Eagle3Head
    if arch in EAGLE_ARCHS:
        return EagleHead
    raise ValueError(f"head config architectures={config.architectures}: allowed "
                     f"[{MTP_ARCH}], one of {EAGLE_ARCHS} (EAGLE-1) or {EAGLE3_ARCHS}")


def load_head(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu",
              aux_layer_ids: list[int] | tuple[int, ...] | None = None) -> DraftHead:
    """Load a head folder (class picked from ``config.json``), sharing ``target``'s embed/lm_head.

    ``path`` may be a head folder of its own, a MiMo target folder holding
    ``model.mtp_layers.*`` (the target's tensors there are skipped unread), or a DeepSeek-V3
    folder holding its MTP layer ``model.layers.L.*`` (``deepseek_mtp.load_deepseek_mtp``), or a
    Qwen3.5 / Qwen3-Next folder holding ``mtp.*`` (``qwen3_5_mtp.load_qwen3_5_mtp``).
    ``aux_layer_ids``:
    an EAGLE-3 head's aux layers when its config names none (the speculative config's
    ``draft_model_config``); else vLLM's default. Every tensor the head needs must be present
    with its shape, and every other one known to be skipped: ValueError naming them.
    """
    arch = (checkpoint.load_config(path).get("architectures") or [None])[0]
    if arch == DEEPSEEK_ARCH:
        from specdec.models.deepseek_mtp import load_deepseek_mtp  # (it imports this module)
        return load_deepseek_mtp(path, target, dtype, device)
    if arch in QWEN3_5_MTP_ARCHS:
        from specdec.models.qwen3_5_mtp import load_qwen3_5_mtp  # (it imports this module)
        return load_qwen3_5_mtp(path, target, dtype, device)

    def build() -> DraftHead:
        d = checkpoint.load_config(path)
        fc_bias = d.pop("bias", None)  # EAGLE's flag for an fc bias (EAGLE-1 heads only)
        if fc_bias is not None and not isinstance(fc_bias, bool):
            raise ValueError(f"config bias={fc_bias!r}: must be true or false")
        config = ModelConfig.from_dict(d, MOE_CONFIG_KEYS)
        cls = head_class_for(config)
        options = {}
        if cls is EagleHead:
            options["fc_bias"] = fc_bias
        elif fc_bias:
            raise ValueError(f"config bias=True: only an EAGLE-1 head's fc bias is supported "
                             f"(this is a {cls.method!r} head)")
        if cls is Eagle3Head:
            options["aux_layer_ids"] = aux_layer_ids
        tensors = _read_tensors(path, cls.skips, shape_only=cls.SHARED_COPIES)
        head = cls.from_checkpoint(config, target, tensors, **options)
        head.load_tensors(tensors, path)
        if hasattr(head, "d2t"):
            head.check_d2t()
        return head

    head = checkpoint.naming_folder(path, build)
    return head.to(device=device, dtype=dtype).eval()


def _read_tensors(path: str | Path, skips, shape_only=()) -> dict[str, torch.Tensor]:
    """The folder's tensors but those ``skips(name)`` (never read from safetensors: a MiMo
    target's shards cost a header read each); ``shape_only`` names as meta tensors of their
    shape."""
    return dict(checkpoint.iter_tensors(path, skip=skips, shape_only=shape_only.__contains__))
