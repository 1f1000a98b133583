"""``ModelConfig``: the fields of an HF ``config.json`` that change a model's math, checked.

Every key of a config is one of: a field below (read), a rotary key (``layers.rotary``), a
key the model family reads (its ``CONFIG_KEYS``, kept in ``extra``), a draft-head key
(``HEAD_KEYS``, kept in ``extra``), or a key known not to change inference
(``IGNORED_KEYS``: bookkeeping and training-only). Anything else is refused with a
ValueError naming the key, so a config is never loaded and silently computed wrong.

A key the config leaves out takes the value transformers' config class gives it for the
family's ``model_type`` (the family's ``HF_DEFAULTS``, added by ``with_defaults``): published
``config.json`` files leave out keys equal to that default (gemma-2-2b has no
``tie_word_embeddings``: true). ``bos_token_id`` / ``eos_token_id`` are never defaulted: they
do not change the math, ``generation_config.json`` names the ids that stop, and a class default
(gpt-oss's eos 200002) would not fit a small vocabulary.

Both spellings load: transformers 4 (``rope_theta`` + ``rope_scaling``) and transformers 5
(``rope_parameters``); ``eos_token_id`` may be a list (and ``generation_config.json``'s ids are
added by ``from_folder``): every id stops generation.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import ClassVar

from specdec.models.layers.rotary import ROPE_CONFIG_KEYS, rope_parameters

# bookkeeping, generation defaults and training-only knobs: they never change a forward
IGNORED_KEYS = frozenset({
    "_name_or_path", "transformers_version", "model_type", "architectures", "auto_map",
    "torch_dtype", "dtype", "initializer_range", "use_cache", "pad_token_id",
    "attention_dropout", "hidden_dropout", "output_attentions", "output_hidden_states",
    "return_dict", "id2label", "label2id", "problem_type", "chunk_size_feed_forward",
    "is_encoder_decoder", "output_router_logits", "router_aux_loss_coef",
    "router_jitter_noise", "tokenizer_class", "pretraining_tp",
})
# read by _attention_layout (the sliding-window spellings)
LAYOUT_KEYS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers",
                         "layer_types", "full_attention_interval"})
# what draft-head folders add (read by specdec.models.heads)
HEAD_KEYS = frozenset({
    "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual",
    "target_hidden_size", "num_nextn_predict_layers", "eagle_config", "speculative_config",
    "use_aux_hidden_state", "tree_score_temperature",
})
# keys read here (fields) with the values they may take when not implemented; a family that
# reads one of them itself (its CONFIG_KEYS, e.g. Gemma's hidden_act) checks it instead
REFUSED_VALUES = {"hidden_act": ("silu",), "mlp_bias": (False,)}
LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")
# spellings of one setting: a default is not added when any of them is given
SPELLINGS = ({"num_experts", "num_local_experts", "n_routed_experts"},
             {"sliding_window_pattern", "_sliding_window_pattern"},
             {"partial_rotary_factor", "rotary_dim"}, {"rope_scaling", "rope_parameters"})


class Family:
    """What a model family says about its ``config.json``, as class attributes: the target
    classes (``models.decoder.DecoderForCausalLM`` subclasses) set them, ``ModelConfig`` reads
    them. This base is no family: no keys of its own, no defaults but ``ModelConfig``'s.

    ``MODEL_TYPE``: transformers' ``model_type`` of the config (``to_hf_dict`` writes it; a
    config naming no architectures is read by it: ``registry.ARCHITECTURE_OF_MODEL_TYPE``).
    ``MULTIMODAL_MODEL_TYPE``: the ``model_type`` of the multimodal checkpoint whose config.json
    nests this text model in ``text_config`` (None: a text model). ``CONFIG_KEYS``: the keys it
    reads beyond ``ModelConfig``'s fields (kept in ``extra``). ``HF_DEFAULTS``: key -> the value
    transformers' config class for ``MODEL_TYPE`` gives it when a config leaves it out, for the
    keys the loader reads (rotary ones in the transformers-4 spelling: ``rope_theta``,
    ``partial_rotary_factor``, ``rope_scaling`` without the theta, Gemma-3's
    ``rope_local_base_freq``); ``tests/test_hf_defaults.py`` checks each against transformers.
    ``ATTENTION_BIAS``: its layers read ``attention_bias`` (biases on q/k/v, and on o_proj
    where the family's layers put one: gpt-oss); else ``attention_bias: true`` is refused.
    ``QKV_BIAS_IMPLIED``: q/k/v always carry biases whatever the config says (Qwen2).
    ``MXFP4``: its ``quantization_config`` may be MXFP4 (experts dequantized at load).
    ``LINEAR_ATTENTION``: ``layer_types`` may say ``linear_attention`` (none given: every
    ``full_attention_interval``-th layer full, the others linear).
    """

    MODEL_TYPE: ClassVar[str] = ""
    MULTIMODAL_MODEL_TYPE: ClassVar[str | None] = None
    CONFIG_KEYS: ClassVar[frozenset[str]] = frozenset()
    HF_DEFAULTS: ClassVar[dict] = {}
    ATTENTION_BIAS: ClassVar[bool] = False
    QKV_BIAS_IMPLIED: ClassVar[bool] = False
    MXFP4: ClassVar[bool] = False
    LINEAR_ATTENTION: ClassVar[bool] = False


@dataclass
class ModelConfig:
    """The fields of an HF decoder ``config.json`` the models use.

    ``attention_bias`` means biases on q/k/v only (the Qwen2 layout); o_proj never has one.
    ``rope_scaling``: the normalised rotary parameters beyond ``rope_theta`` (transformers-5
    form: ``rope_type`` and its keys, e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``),
    None for the default rope. ``layer_types[i]`` is ``full_attention`` or
    ``sliding_attention`` (then layer i sees ``sliding_window`` keys) or, for a hybrid
    family (``Family.LINEAR_ATTENTION``), ``linear_attention``; None = all full.
    ``rope_by_layer_type``: the rotary parameters of the layers of a type that has its own
    (transformers-5 form each, ``rope_theta`` included; Gemma-3's ``sliding_attention``
    layers), the others use ``rope``; None = one rope for every layer. ``extra`` keeps the
    family's and a draft head's own keys (``num_experts``, ``draft_vocab_size``, ...) so they
    round-trip through ``to_hf_dict``.
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
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_by_layer_type: dict[str, dict] | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 0
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
                raise ValueError(f"config {name}={value!r}: must be a positive int")
        ids = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        for name, values in (("bos_token_id", [self.bos_token_id]), ("eos_token_id", ids)):
            for value in values:
                if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                          or not 0 <= value < self.vocab_size):
                    raise ValueError(f"config {name}={getattr(self, name)!r}: must be None, an "
                                     f"int or a list of ints in [0, vocab_size={self.vocab_size})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config num_key_value_heads={self.num_key_value_heads}: must divide "
                f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config head_dim={self.head_dim}: must be even for RoPE")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError(f"config rms_norm_eps={self.rms_norm_eps}, rope_theta="
                             f"{self.rope_theta}: both must be > 0")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int)
                                                or self.sliding_window < 1):
            raise ValueError(f"config sliding_window={self.sliding_window!r}: must be null or "
                             "an int >= 1")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers or \
                    not set(self.layer_types) <= set(LAYER_TYPES):
                raise ValueError(f"config layer_types={self.layer_types!r}: need one of "
                                 f"{LAYER_TYPES} per layer ({self.num_hidden_layers})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("config layer_types has sliding_attention layers but "
                                 "sliding_window is null")
        if self.rope_by_layer_type is not None and not set(self.rope_by_layer_type) <= (
                set(LAYER_TYPES) - {"full_attention"}):
            raise ValueError(f"config rope_by_layer_type={self.rope_by_layer_type!r}: keys "
                             f"must be layer types other than full_attention {LAYER_TYPES}")
        if not self.architectures or not all(isinstance(a, str) for a in self.architectures):
            raise ValueError(f"config architectures={self.architectures!r}: "
                             "must be a non-empty list of str")
        if self.torch_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"config torch_dtype={self.torch_dtype!r}: "
                             "allowed float16, bfloat16, float32")

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation (empty when the model names none)."""
        ids = self.eos_token_id if isinstance(self.eos_token_id, list) else [self.eos_token_id]
        return tuple(i for i in ids if i is not None)

    @property
    def rope(self) -> dict:
        """The normalised rotary parameters (transformers-5 form, ``rope_theta`` included)."""
        return {"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta}

    @property
    def weight_block_size(self) -> tuple[int, int] | None:
        """The FP8 block size of a block-quantized checkpoint (None: not quantized)."""
        q = self.extra.get("quantization_config")
        return None if q is None or is_mxfp4(q) else fp8_block_size(q)

    def rope_of(self, layer: int) -> dict:
        """Layer ``layer``'s rotary parameters: its type's own (``rope_by_layer_type``) or
        ``rope``."""
        kind = self.layer_types[layer] if self.layer_types else "full_attention"
        return (self.rope_by_layer_type or {}).get(kind, self.rope)

    def sliding_window_of(self, layer: int) -> int | None:
        """Keys layer ``layer`` sees at most (None = every earlier key)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    @classmethod
    def from_dict(cls, d: dict, family: type[Family] = Family) -> ModelConfig:
        """Build from an HF config dict of ``family`` (its ``CONFIG_KEYS`` kept in ``extra``,
        its ``HF_DEFAULTS`` for the keys ``d`` leaves out; a config naming no architectures
        is the family's own, ``family.__name__``). A key nobody reads, or a value that is not
        implemented, raises ValueError naming it."""
        family_keys = family.CONFIG_KEYS
        d = with_defaults(d, family.HF_DEFAULTS)
        for key, allowed in REFUSED_VALUES.items():
            if key in d and key not in family_keys and d[key] not in allowed:
                raise ValueError(f"config {key}={d[key]!r}: allowed {list(allowed)}")
        if not d.get("architectures") and family is Family:
            raise ValueError("config names no architectures (and no family was given)")
        archs = d.get("architectures") or [family.__name__]
        if d.get("attention_bias") and not family.ATTENTION_BIAS:
            raise ValueError(f"config attention_bias=True with architectures={archs}: "
                             f"{family.__name__} implements no attention biases (transformers "
                             "puts one on o_proj too); allowed: false")
        names = {f.name for f in fields(cls)} - {"extra", "architectures", "rope_scaling",
                                                 "rope_theta", "layer_types", "sliding_window",
                                                 "rope_by_layer_type"}
        read = (names | set(ROPE_CONFIG_KEYS) | set(REFUSED_VALUES) | LAYOUT_KEYS
                | {"quantization_config"})
        unknown = sorted(set(d) - read - IGNORED_KEYS - HEAD_KEYS - family_keys)
        if unknown:
            raise ValueError(f"config keys {unknown} are not implemented for architectures="
                             f"{archs} and may change the math; remove them only if they do "
                             "not (see specdec/models/config.py)")
        missing = [n for n in ("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads") if n not in d]
        if missing:
            raise ValueError(f"config is missing required keys {missing}")
        kwargs = {k: v for k, v in d.items() if k in names and v is not None}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        kwargs["eos_token_id"] = d.get("eos_token_id")
        kwargs["bos_token_id"] = d.get("bos_token_id")
        if "torch_dtype" not in d and d.get("dtype") is not None:
            kwargs["torch_dtype"] = d["dtype"]
        if family.QKV_BIAS_IMPLIED:
            kwargs["attention_bias"] = True
        q = d.get("quantization_config")
        if q is not None and not (is_mxfp4(q) and family.MXFP4):
            fp8_block_size(q)  # refused unless implemented
        rope, by_type = _rope_by_layer_type(d)
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        extra = {k: v for k, v in d.items()
                 if k in HEAD_KEYS | family_keys | {"quantization_config"}}
        return cls(architectures=list(archs), extra=extra, rope_theta=rope["rope_theta"],
                   rope_scaling=None if scaling == {"rope_type": "default"} else scaling,
                   rope_by_layer_type=by_type, **_attention_layout(d, family.LINEAR_ATTENTION),
                   **kwargs)

    @classmethod
    def from_folder(cls, path: str | Path, family: type[Family] = Family) -> ModelConfig:
        """``config.json`` of a folder (its ``generation_config.json`` eos ids added)."""
        from specdec.models.checkpoint import load_config
        d = load_config(path)
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
            own = d.get("eos_token_id")
            own = [] if own is None else own if isinstance(own, list) else [own]
            merged = own + [i for i in ids if i not in own]
            d = dict(d, eos_token_id=merged[0] if len(merged) == 1 else merged or None)
        return cls.from_dict(d, family)

    def to_hf_dict(self, family: type[Family]) -> dict:
        """The transformers-4 spelling (``rope_theta`` + ``rope_scaling``), which both
        transformers 4 and 5 and vLLM read; a rope per layer type is written as transformers 5
        nests it (``rope_parameters: {"full_attention": ..., "sliding_attention": ...}``).
        ``family``: the config's (its ``MODEL_TYPE`` is written; ValueError for none)."""
        if not family.MODEL_TYPE:
            raise ValueError(f"config of {family.__name__}: no MODEL_TYPE to write; save through "
                             "the family class (e.g. LlamaForCausalLM)")
        d = {f.name: getattr(self, f.name) for f in fields(self)
             if f.name not in ("extra", "rope_by_layer_type")}
        d["model_type"] = family.MODEL_TYPE
        d["hidden_act"] = "silu"
        scaling = dict(self.rope_scaling or {})
        for key in ("partial_rotary_factor",):
            if key in scaling:
                d[key] = scaling.pop(key)
        d["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
        if self.rope_by_layer_type:
            for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
                d.pop(key, None)
            d["rope_parameters"] = {"full_attention": self.rope, **self.rope_by_layer_type}
        if family.QKV_BIAS_IMPLIED:
            del d["attention_bias"]  # implied by the architecture
        for key in ("layer_types", "sliding_window"):
            if d[key] is None:
                del d[key]
        d.update(self.extra)
        return dict(sorted(d.items()))


def with_defaults(d: dict, defaults: dict) -> dict:
    """``d`` with each key of ``defaults`` it does not give added (a copy). A rotary key is
    given at the top level or inside ``rope_parameters`` / ``rope_scaling`` (every rotary key by
    a ``rope_parameters`` nested by layer type, as transformers 5 writes Gemma-3's); a null
    rotary key is not given (transformers takes its default then too); a key of ``SPELLINGS``
    is given by any of its spellings.

    Example: ``({"hidden_size": 8}, {"tie_word_embeddings": True, "rope_theta": 1e4})`` ->
    ``{"hidden_size": 8, "tie_word_embeddings": True, "rope_theta": 1e4}``; with
    ``{"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}`` the theta is given.
    """
    ropes = [r for r in (d.get("rope_parameters"), d.get("rope_scaling"))
             if isinstance(r, dict) and r]
    nested = next((r for r in ropes if set(r) <= set(LAYER_TYPES)), None)
    if nested is not None:  # its sliding_attention entry is Gemma-3's rope_local_base_freq
        given = set(d) | ROPE_CONFIG_KEYS | (
            {"rope_local_base_freq"} if "sliding_attention" in nested else set())
    else:
        given = {k for k, v in d.items() if v is not None or k not in ROPE_CONFIG_KEYS}
        given |= {k for r in ropes for k in r}
    for same in SPELLINGS:
        if same & given:
            given |= same
    return dict(d, **copy.deepcopy({k: v for k, v in defaults.items() if k not in given}))


def _rope_by_layer_type(d: dict) -> tuple[dict, dict[str, dict] | None]:
    """(the rope of full-attention layers, {layer type: its rope} for the other types or None)
    from ``rope_parameters`` nested by layer type, as transformers 5 writes Gemma-3's
    (``{"full_attention": {...}, "sliding_attention": {...}}``), or from a flat spelling
    (one rope for every layer)."""
    nested = d.get("rope_parameters")
    if not (isinstance(nested, dict) and nested and set(nested) <= set(LAYER_TYPES)):
        return rope_parameters(d), None
    if d.get("rope_scaling"):
        raise ValueError(f"config rope_scaling={d['rope_scaling']!r} next to rope_parameters "
                         "nested by layer type: give one")
    ropes = {kind: rope_parameters({**d, "rope_parameters": params or {}})
             for kind, params in nested.items()}
    main = ropes.pop("full_attention", None) or rope_parameters({**d, "rope_parameters": {}})
    return main, ropes or None


def _attention_layout(d: dict, linear: bool) -> dict:
    """``sliding_window`` and ``layer_types`` from either spelling: transformers 5 writes
    ``layer_types``; Qwen2/3 (transformers 4) slide only with ``use_sliding_window``, on layers
    >= ``max_window_layers``; Mistral slides on every layer when ``sliding_window`` is set.
    ``linear``: the family's ``LINEAR_ATTENTION`` (its default schedule; else such layers are
    refused)."""
    window = d.get("sliding_window")
    if not linear and "linear_attention" in (d.get("layer_types") or ()):
        raise ValueError("config layer_types has linear_attention layers: this family does not "
                         "implement them (a hybrid family's LINEAR_ATTENTION)")
    if linear and d.get("layer_types") is None:
        every = d.get("full_attention_interval")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"config full_attention_interval={every!r}: must be an int >= 1")
        return {"sliding_window": window, "layer_types": [
            "full_attention" if (i + 1) % every == 0 else "linear_attention"
            for i in range(d["num_hidden_layers"])]}
    if d.get("layer_types") is not None:
        types = list(d["layer_types"])
    elif "use_sliding_window" in d:  # the Qwen spelling: a window only when switched on
        if not d["use_sliding_window"]:
            return {"sliding_window": None, "layer_types": None}
        start = d.get("max_window_layers", 0)
        types = ["sliding_attention" if i >= start else "full_attention"
                 for i in range(d["num_hidden_layers"])]
    else:
        types = None
    if types is not None and set(types) <= {"full_attention"}:
        return {"sliding_window": None, "layer_types": None}
    return {"sliding_window": window, "layer_types": types}


def is_mxfp4(q) -> bool:
    """Whether ``quantization_config`` is gpt-oss's ``{"quant_method": "mxfp4", ...}`` (which
    ``from_dict`` takes only for a family whose loader dequantizes it: ``Family.MXFP4``)."""
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def fp8_block_size(q) -> tuple[int, int]:
    """``quantization_config`` of a block-quantized FP8 checkpoint (DeepSeek-V3, Qwen3-FP8:
    ``{"quant_method": "fp8", "weight_block_size": [128, 128], ...}``) -> the block size;
    anything else is refused (the weights are dequantized at load, the math stays float)."""
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if not isinstance(q, dict) or q.get("quant_method") != "fp8" or not (
            isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"config quantization_config={q!r}: only block-quantized fp8 "
                         "(quant_method 'fp8' with weight_block_size [bo, bi]) is implemented")
    if q.get("fmt", "e4m3") != "e4m3" or q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"config quantization_config={q!r}: fmt must be 'e4m3' and "
                         "activation_scheme 'dynamic'")
    return block[0], block[1]
