"""EAGLE-1 and EAGLE-3 draft heads (methods ``eagle``, ``eagle3``): one Llama layer over the
target's hidden states.

What vLLM does (read in vllm/model_executor/models/{llama_eagle,llama_eagle3,llama,utils}.py,
v1/spec_decode/llm_base_proposer.py, v1/worker/gpu_model_runner.py and
config/speculative.py; summarised here, nothing copied):

EAGLE-1 (llama_eagle.py): a ``LlamaForCausalLM`` folder with ``fc.weight [H, 2H]`` applied to
``cat(embeds, hidden)`` (EMBEDS FIRST, no norms), then ``layers.0`` whose input_layernorm is an
identity (so ``layers.0.input_layernorm`` is absent), no final norm: the output
``residual + mlp_out`` goes straight to the shared lm_head and is also the next hidden. The
input hidden is the target's final hidden.

EAGLE-3 (llama_eagle3.py): ``architectures: ["LlamaForCausalLMEagle3"]``; ``midlayer.*`` is
renamed to ``layers.0.*``. The target supplies aux states (the residual stream at the input of
layers ``eagle_aux_hidden_state_layer_ids``; vLLM's Llama adds ``hidden + residual`` before
running those layers); ``combine_hidden_states`` = ``fc [H, 3H]`` over their concatenation in
id order, only for the target's states. Layer: attention input is
``cat(input_layernorm(embeds), hidden_norm(hidden))`` (EMBEDS FIRST, q/k/v in_features 2H), the
residual is the un-normed hidden (``norm_before_residual`` false); then the usual
post-attention norm + MLP. Output: ``norm(residual + mlp_out)`` feeds
``lm_head [draft_vocab, H]``; the pre-norm sum is the next step's hidden. ``d2t`` (optional,
int64) maps ``target = draft + d2t[draft]`` (absent: zeros, i.e. the first
``draft_vocab_size`` target ids); ``t2d`` is skipped. Aux layer ids (gpu_model_runner
``_get_eagle3_aux_layers_from_config``): the head config's
``eagle_aux_hidden_state_layer_ids``, else its
``eagle_config.eagle_aux_hidden_state_layer_ids``, else the target's default
``(2, L // 2, L - 3)``.

Embeddings (llm_base_proposer ``has_own_embed_tokens``, set by utils ``process_eagle_weight``
when a checkpoint name holds ``embed_tokens``): an EAGLE head that ships
``embed_tokens.weight`` keeps its own unless it is identical to the target's, in which case
the target's is shared; without one the target's is shared. (Older vLLM skipped an EAGLE-1
head's copy outright; for the published heads, whose copy is the target's, both give the same
tokens.)

Published folders:
- EAGLE-1 as yuhuili/EAGLE-* ship it: ``LlamaForCausalLM`` config (``"bias"``: EAGLE's flag for
  an ``fc.bias``; absent, the file decides), ``pytorch_model.bin`` with ``embed_tokens.weight``,
  ``fc.weight`` (+ ``fc.bias``), ``layers.0.*``. vLLM's v1 EAGLE-1 ``fc`` has no bias (its
  loader refuses, or in one version drops, ``fc.bias``); EAGLE's own model
  (eagle/model/cnets1.py) adds it, so the heads were trained with it and it is applied here.
- EAGLE-3 as yuhuili/EAGLE3-* and the Qwen3 EAGLE-3 heads ship it: ``midlayer.*``, ``fc``,
  ``norm``, ``lm_head [draft_vocab, H]``, ``d2t`` int64, ``t2d`` bool (skipped), optional
  ``embed_tokens.weight``; a ``LlamaForCausalLM`` architecture with ``draft_vocab_size`` or aux
  ids in its config counts as EAGLE-3. MoE keys copied from a MoE target's config are not read
  (vLLM's Llama layer reads none: the head's MLP is dense).
- EAGLE-3 in the ``speculators`` format (RedHatAI/*-speculator.eagle3, e.g. gpt-oss-20b's;
  vLLM detects it by the config's ``speculators_model_type`` and translates it in
  transformers_utils/configs/speculators/): the config is rewritten by
  ``speculators_to_eagle3_config``; tensors are ``layers.0.*`` (vLLM's own name, which
  ``midlayer.*`` is renamed to), ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``, optional
  ``embed_tokens``. ``norm_before_residual`` (true by default there, as vLLM reads it) makes
  the layer's residual the ``hidden_norm``-ed hidden instead of the raw one.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from specdec.config import default_aux_layer_ids
from specdec.models.config import ModelConfig
from specdec.models.decoder import DecoderForCausalLM, DecoderLayer
from specdec.models.heads.base import DraftHead, full_shape
from specdec.models.layers.moe import MOE_CONFIG_KEYS
from specdec.models.layers.norm import RMSNorm
from specdec.models.llama import build_layer

# config keys that make a LlamaForCausalLM-architecture head folder an EAGLE-3 head
EAGLE3_KEYS = ("draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "eagle_config")
AUX_IDS_KEY = "eagle_aux_hidden_state_layer_ids"
OWN_EMBED = "embed_tokens.weight"  # an EAGLE head's optional own embedding


class _LlamaStyleHead(DraftHead):
    """An EAGLE head: a Llama layer (whatever the target's family: MoE keys copied from a MoE
    target's config are not read, as vLLM's Llama layer reads none) with an optional own
    ``embed_tokens``."""

    def __init__(self, config: ModelConfig, target: DecoderForCausalLM, *,
                 own_embed: bool = False):
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

    def __init__(self, config: ModelConfig, target: DecoderForCausalLM, *,
                 own_embed: bool = False, fc_bias: bool = False):
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
    def for_config(cls, config):
        """An EAGLE-1 architecture whose config has EAGLE-3 keys holds an EAGLE-3 head."""
        return Eagle3Head if any(config.extra.get(k) for k in EAGLE3_KEYS) else cls

    @classmethod
    def load_options(cls, fc_bias, aux_layer_ids):
        return {"fc_bias": fc_bias}

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

    def __init__(self, config: ModelConfig, target: DecoderForCausalLM, *,
                 own_embed: bool = False,
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
        norm_before_residual = extra.get("norm_before_residual", False)
        if type(norm_before_residual) is not bool:
            raise ValueError(f"Eagle3Head config norm_before_residual={norm_before_residual!r}: "
                             "must be true or false")
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
        self.midlayer = _Eagle3Layer(config, norm_before_residual)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        if draft_vocab < config.vocab_size:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))

    @classmethod
    def skips(cls, name):
        return super().skips(name) or name == "t2d"  # target -> draft mask: unused (vLLM too)

    @classmethod
    def read_config(cls, path):
        """The folder's config; a ``speculators``-format one translated
        (``speculators_to_eagle3_config``)."""
        d = super().read_config(path)
        return speculators_to_eagle3_config(d) if SPECULATORS_KEY in d else d

    @classmethod
    def load_options(cls, fc_bias, aux_layer_ids):
        return dict(super().load_options(fc_bias, aux_layer_ids), aux_layer_ids=aux_layer_ids)

    def load_tensors(self, tensors, path):
        """As the base's, ``layers.0.*`` read as ``midlayer.*``, ``d2t`` (absent: zeros)
        checked to be integer and to map every draft id into the target vocabulary."""
        tensors = _midlayer_names(tensors)
        if hasattr(self, "d2t"):
            d2t = tensors.setdefault("d2t", torch.zeros_like(self.d2t))  # absent: vLLM's zeros
            if d2t.is_floating_point() or d2t.dtype == torch.bool:
                raise ValueError(f"checkpoint {str(path)!r}: d2t has dtype {d2t.dtype}; need "
                                 "integer offsets (int64)")
            tensors["d2t"] = d2t.to(torch.int64)
        super().load_tensors(tensors, path)
        if hasattr(self, "d2t"):
            self.check_d2t()

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
    """``norm_before_residual``: the residual is ``hidden_norm(hidden)`` (else ``hidden``)."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool = False):
        base = build_layer(config, 0, in_features=2 * config.hidden_size)
        super().__init__(base.self_attn, base.mlp, config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = norm_before_residual

    def run(self, embeds, hidden, rope, kv):
        normed = self.hidden_norm(hidden)
        attn_in = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        return self(normed if self.norm_before_residual else hidden, rope, kv, attn_in=attn_in)


def head_aux_layer_ids(config: dict) -> list | None:
    """A head config's aux layer ids as vLLM reads them: ``eagle_aux_hidden_state_layer_ids``,
    else ``eagle_config.eagle_aux_hidden_state_layer_ids``; None when neither is set (an empty
    list counts as unset, as in vLLM)."""
    ids = config.get(AUX_IDS_KEY)
    if not ids and isinstance(config.get("eagle_config"), dict):
        ids = config["eagle_config"].get(AUX_IDS_KEY)
    return ids or None


def _keeps_own_embedding(tensors: dict[str, torch.Tensor], target: DecoderForCausalLM) -> bool:
    """Whether an EAGLE head uses its own ``embed_tokens.weight``: when it ships one that is
    not identical to the target's (vLLM's ``has_own_embed_tokens`` + ``torch.equal``); an
    identical copy is dropped from ``tensors`` and the target's is shared."""
    t = tensors.get(OWN_EMBED)
    if t is None:
        return False
    embed = target.model.embed_tokens
    w = embed.weight  # a tensor-parallel rank holds rows start.. of the table
    if t.shape != full_shape(embed) or t.is_floating_point() != w.is_floating_point():
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


SPECULATORS_KEY = "speculators_model_type"  # marks a config in the ``speculators`` format
# speculators top-level keys that change nothing here (bookkeeping, training-only, the dtype
# the tensors are stored in); any key outside these and the ones translated is refused
_SPECULATORS_IGNORED = frozenset({
    "architectures", "auto_map", "speculators_version", "has_no_defaults_at_init",
    "embed_requires_grad", "torch_dtype", "dtype", "transformers_version", "model_type",
    "_name_or_path", "name_or_path"})


def speculators_to_eagle3_config(config: dict) -> dict:
    """A ``speculators``-format EAGLE-3 head config -> the config ``Eagle3Head`` reads.

    Key mapping (as vLLM's speculators config reads it):

    - ``speculators_model_type``: must be ``"eagle3"`` (else ValueError naming it), as must
      ``speculators_config.algorithm`` when given;
    - ``transformer_layer_config`` (a Llama config: sizes, heads, rope, eps, vocab): the base
      of the result, its ``architectures`` set to ``["Eagle3LlamaForCausalLM"]``;
    - ``draft_vocab_size``, ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (when
      non-empty): copied to the top level, read (and checked) as an EAGLE-layout head's;
    - ``norm_before_residual``: copied, **true when absent** (vLLM's default for this format);
    - ``norm_before_fc``: only false is supported (true: ValueError naming it);
    - ``speculators_config.proposal_methods[0].speculative_tokens``: ignored. specdec's
      ``num_speculative_tokens`` is required in the speculative config and has no
      head-provided default; ``proposal_type`` and ``verifier`` are informational;
    - ``torch_dtype`` / ``dtype``: kept (the stored dtype); ``architectures``, ``auto_map``,
      ``speculators_version``, ``has_no_defaults_at_init``, ``embed_requires_grad``: ignored;
    - any other top-level key: ValueError naming it (it may change the math).
    """
    kind = config.get(SPECULATORS_KEY)
    if kind != "eagle3":
        raise ValueError(f"speculators config {SPECULATORS_KEY}={kind!r}: only 'eagle3' is "
                         "supported")
    spec = config.get("speculators_config") or {}
    if type(spec) is not dict:  # JSON objects load as dicts
        raise ValueError(f"speculators config speculators_config={spec!r}: must be an object")
    if spec.get("algorithm", kind) != kind:
        raise ValueError(f"speculators config speculators_config.algorithm="
                         f"{spec['algorithm']!r}: only 'eagle3' is supported")
    layer = config.get("transformer_layer_config")
    if type(layer) is not dict:
        raise ValueError(f"speculators config transformer_layer_config={layer!r}: must be a "
                         "Llama config object")
    if config.get("norm_before_fc", False) is not False:
        raise ValueError(f"speculators config norm_before_fc={config['norm_before_fc']!r}: "
                         "only false is supported")
    translated = {SPECULATORS_KEY, "speculators_config", "transformer_layer_config",
                  "draft_vocab_size", "target_hidden_size", AUX_IDS_KEY,
                  "norm_before_residual", "norm_before_fc"}
    unknown = sorted(set(config) - translated - _SPECULATORS_IGNORED)
    if unknown:
        raise ValueError(f"speculators config keys {unknown}: not supported (they may change "
                         "the head's math)")
    out = dict(layer, architectures=["Eagle3LlamaForCausalLM"])
    for key in ("torch_dtype", "dtype"):
        if key in config and key not in out:
            out[key] = config[key]
    out["draft_vocab_size"] = config.get("draft_vocab_size")
    if config.get("target_hidden_size") is not None:
        out["target_hidden_size"] = config["target_hidden_size"]
    out["norm_before_residual"] = config.get("norm_before_residual", True)
    if config.get(AUX_IDS_KEY):
        out[AUX_IDS_KEY] = config[AUX_IDS_KEY]
    return out


def _midlayer_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``layers.0.*`` (the speculators / vLLM name) -> ``midlayer.*``, unless the folder also
    holds that ``midlayer.*`` name: then it keeps its name and the load names it unexpected."""
    out = {}
    for name, t in tensors.items():
        key = "midlayer." + name.removeprefix("layers.0.")
        out[key if name.startswith("layers.0.") and key not in tensors else name] = t
    return out
