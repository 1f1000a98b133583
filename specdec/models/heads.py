"""Draft heads (MTP, EAGLE-1, EAGLE-3) in the checkpoint layouts vLLM's loaders accept.

What vLLM does (read in vllm/model_executor/models/{mimo_mtp,llama_eagle,llama_eagle3,
deepseek_mtp,qwen2,llama}.py and config/speculative.py; summarised here, nothing copied):

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
``residual + mlp_out`` goes straight to the shared lm_head and is also the next hidden. Embeddings
are skipped on load (shared with the target); the input hidden is the target's final hidden.

EAGLE-3 (llama_eagle3.py): ``architectures: ["LlamaForCausalLMEagle3"]``; ``midlayer.*`` is
renamed to ``layers.0.*``. The target supplies aux states (the residual stream at the input of
layers ``eagle_aux_hidden_state_layer_ids``, read from the draft config; vLLM's Llama adds
``hidden + residual`` before running those layers); ``combine_hidden_states`` = ``fc [H, 3H]`` over
their concatenation in id order, only for the target's states. Layer: attention input is
``cat(input_layernorm(embeds), hidden_norm(hidden))`` (EMBEDS FIRST, q/k/v in_features 2H), the
residual is the un-normed hidden (``norm_before_residual`` false); then the usual post-attention
norm + MLP. Output: ``norm(residual + mlp_out)`` feeds ``lm_head [draft_vocab, H]``; the pre-norm
sum is the next step's hidden. ``d2t`` (optional, int64) maps ``target = draft + d2t[draft]``;
``t2d`` is ignored; ``embed_tokens`` is optional (shared when absent).

All three run their single layer as KV layer 0 of the draft's own cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.attention import KVCacheSpec
from specdec.models import checkpoint
from specdec.models.config import ModelConfig
from specdec.models.layers.attention import Attention
from specdec.models.layers.moe import MOE_CONFIG_KEYS
from specdec.models.layers.norm import RMSNorm
from specdec.models.layers.rotary import Rope, RotaryEmbedding
from specdec.models.llama import DecoderLayer, LlamaForCausalLM, build_layer

MTP_ARCH = "MiMoForCausalLM"
EAGLE_ARCHS = ("LlamaForCausalLM", "EagleLlamaForCausalLM")
EAGLE3_ARCHS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass
class SharedWeights:
    """The target's embedding and lm_head, referenced (not owned, not saved) by a head."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear


class DraftHead(nn.Module):
    """Common interface the proposers call; subclasses define the layer and the layout."""

    method = ""
    aux_layer_ids: tuple[int, ...] = ()  # target layers whose input states feed the head

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
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
        return dict(self.state_dict())

    def expected_tensors(self) -> dict[str, torch.Size]:
        return {k: v.shape for k, v in self.checkpoint_tensors().items()}

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> None:
        checkpoint.save_folder(path, self.config.to_hf_dict(), self.checkpoint_tensors(), dtype)

    def load_tensors(self, tensors: dict[str, torch.Tensor], path: str | Path) -> None:
        checkpoint.check_names(self.expected_tensors(), tensors, path)
        self.load_state_dict({k: v for k, v in tensors.items() if k in self.state_dict()})

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.shared.embed_tokens(input_ids)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        return self.rotary.tables(positions, dtype)


class MtpHead(DraftHead):
    """MiMo-style MTP layer: ``model.mtp_layers.0.*`` (Qwen2 decoder layer + input projection)."""

    method = "mtp"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__(config, target)
        if config.architectures[0] != MTP_ARCH or config.extra.get("num_nextn_predict_layers") != 1:
            raise ValueError(f"MtpHead config: architectures={config.architectures}, "
                             f"num_nextn_predict_layers={config.extra.get('num_nextn_predict_layers')}"
                             f"; need ['{MTP_ARCH}'] and 1")
        self.model = nn.Module()
        self.model.mtp_layers = nn.ModuleList([_MtpLayer(config)])

    def forward(self, input_ids, positions, hidden, kv=None):
        layer = self.model.mtp_layers[0]
        emb = self._embed(input_ids).masked_fill((positions == 0)[..., None], 0.0)
        x = layer.input_proj(torch.cat((layer.hidden_layernorm(hidden),
                                        layer.token_layernorm(emb)), dim=-1))
        out = layer.final_layernorm(layer(x, self._rope(positions, x.dtype), kv))
        return out, out

    def checkpoint_tensors(self):
        # vLLM's MiMo loader requires these two in the folder; they are the target's.
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


class EagleHead(DraftHead):
    """EAGLE-1: ``fc [H, 2H]`` over ``cat(embeds, hidden)`` + ``layers.0`` without input norm."""

    method = "eagle"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__(config, target)
        if config.num_hidden_layers != 1:
            raise ValueError(f"EagleHead config num_hidden_layers={config.num_hidden_layers}: "
                             "only 1 is supported")
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([build_layer(config, 0, input_layernorm=False)])

    def forward(self, input_ids, positions, hidden, kv=None):
        x = self.fc(torch.cat((self._embed(input_ids), hidden), dim=-1))
        out = self.layers[0](x, self._rope(positions, x.dtype), kv)
        return out, out


class Eagle3Head(DraftHead):
    """EAGLE-3: ``fc [H, 3H]`` over target aux states, ``midlayer`` with 2H-wide q/k/v,
    ``norm``, own ``lm_head [draft_vocab, H]`` and optional ``d2t``."""

    method = "eagle3"

    def __init__(self, config: ModelConfig, target: LlamaForCausalLM):
        super().__init__(config, target)
        extra = config.extra
        ids = extra.get("eagle_aux_hidden_state_layer_ids")
        n_layers = target.config.num_hidden_layers
        if (not isinstance(ids, list) or len(ids) != 3
                or not all(isinstance(i, int) and 0 <= i < n_layers for i in ids)):
            raise ValueError(f"Eagle3Head config eagle_aux_hidden_state_layer_ids={ids!r}: need 3 "
                             f"target layer ids in 0..{n_layers - 1}")
        if extra.get("norm_before_residual", False):
            raise ValueError("Eagle3Head config norm_before_residual=True is not supported")
        if extra.get("target_hidden_size", config.hidden_size) != config.hidden_size:
            raise ValueError(f"Eagle3Head config target_hidden_size={extra['target_hidden_size']}: "
                             f"must equal hidden_size={config.hidden_size}")
        draft_vocab = extra.get("draft_vocab_size") or config.vocab_size
        if not 0 < draft_vocab <= config.vocab_size:
            raise ValueError(f"Eagle3Head config draft_vocab_size={draft_vocab}: "
                             f"allowed 1..{config.vocab_size}")
        self.aux_layer_ids = tuple(ids)
        self.draft_vocab_size = draft_vocab
        h = config.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = _Eagle3Layer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        if draft_vocab < config.vocab_size:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

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


def head_config(method: str, target_config: ModelConfig, **extra) -> ModelConfig:
    """A head config sized like the target (one layer), with the keys vLLM reads for ``method``.

    Eagle3 takes ``eagle_aux_hidden_state_layer_ids=[...]`` and optional ``draft_vocab_size``.
    """
    archs = {"mtp": [MTP_ARCH], "eagle": ["LlamaForCausalLM"], "eagle3": ["LlamaForCausalLMEagle3"]}
    if method not in archs:
        raise ValueError(f"head method={method!r}: allowed {sorted(archs)}")
    d = dict(target_config.to_hf_dict(), architectures=archs[method], num_hidden_layers=1,
             tie_word_embeddings=False, **extra)
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
    if arch in EAGLE3_ARCHS:
        return Eagle3Head
    if arch in EAGLE_ARCHS:
        return EagleHead
    raise ValueError(f"head config architectures={config.architectures}: allowed "
                     f"[{MTP_ARCH}], one of {EAGLE_ARCHS} (EAGLE-1) or {EAGLE3_ARCHS}")


def load_head(path: str | Path, target: LlamaForCausalLM, dtype: torch.dtype = torch.float32,
              device: str | torch.device = "cpu") -> DraftHead:
    """Load a head folder (class picked from ``config.json``), sharing ``target``'s embed/lm_head."""
    head = checkpoint.naming_folder(path, lambda: _build_head(path, target))
    head.load_tensors(checkpoint.load_tensors(path), path)
    if hasattr(head, "d2t"):
        checkpoint.naming_folder(path, lambda: head.check_d2t())
    return head.to(device=device, dtype=dtype).eval()


def _build_head(path: str | Path, target: LlamaForCausalLM) -> DraftHead:
    config = ModelConfig.from_dict(checkpoint.load_config(path), MOE_CONFIG_KEYS)
    return head_class_for(config)(config, target)
