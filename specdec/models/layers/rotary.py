"""Rotary position embedding (RoPE) as transformers 5.23 computes it, for every model family.

``rope_parameters(config)`` turns an HF ``config.json`` dict (transformers 4 or 5 spelling) into
one transformers-5 ``rope_parameters`` dict; :class:`RotaryEmbedding` turns that into the
inverse frequencies of its ``rope_type`` (default, linear, llama3, yarn, longrope) and, once
per forward, into the cos/sin tables of a :class:`Rope`; ``Rope.apply`` rotates q/k heads
(one kernel where Triton runs: ``specdec.kernels.apply_rope``).

Example (head_dim 4, theta 100, position 1): inv_freq = [1, 0.1]; channels (0, 2) turn by
1 rad and (1, 3) by 0.1 rad, so x = [1, 0, 0, 0] -> [cos 1, 0, sin 1, 0].
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from specdec import kernels, platform

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
LEGACY_ROPE_TYPES = {"su": "longrope"}  # early Phi-3 configs' name (transformers and vLLM read it)

# The top-level config.json keys ``rope_parameters`` reads (the model config can mark them as
# read). ``original_max_position_embeddings`` outside the dict overrides the one inside for
# llama3/yarn, as transformers does when it computes the frequencies.
ROPE_CONFIG_KEYS = frozenset({"rope_parameters", "rope_scaling", "rope_theta",
                              "partial_rotary_factor", "rotary_dim",
                              "original_max_position_embeddings"})

# The keys each type reads besides rope_type, rope_theta and partial_rotary_factor.
_TYPE_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor",
                         "original_max_position_embeddings"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor",
                       "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}),
    "longrope": frozenset({"short_factor", "long_factor", "factor", "attention_factor",
                           "original_max_position_embeddings"}),
}
# per-channel factor lists (their length is checked against the rotary width by
# RotaryEmbedding)
_FACTOR_LISTS = ("short_factor", "long_factor")
_REQUIRED = {"default": (), "linear": ("factor",),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",),
             "longrope": _FACTOR_LISTS}
# Keys a type may carry without using them and without changing its math.
_HARMLESS = frozenset({"type", "original_max_position_embeddings"})


def _number(where: str, value, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (positive and not value > 0):
        raise ValueError(f"config {where}={value!r}: must be a {'positive ' * positive}number")
    return value


def _agree(where: str, inner, outer, outer_name: str):
    """The dict's value (transformers' priority), which must equal the top-level one if both."""
    if inner is not None and outer is not None and inner != outer:
        raise ValueError(f"config {where}={inner!r} and {outer_name}={outer!r} disagree")
    return inner if inner is not None else outer


def rope_parameters(config: dict) -> dict:
    """An HF config dict's rotary settings in the transformers-5 form.

    Reads ``rope_parameters`` (transformers 5) or ``rope_scaling`` (transformers 4, legacy
    ``type`` accepted) plus the top-level keys in ``ROPE_CONFIG_KEYS``; ``rotary_dim``
    becomes ``partial_rotary_factor = rotary_dim / head_dim`` as transformers' MiniMax-M2
    config does. Returns ``rope_type``, ``rope_theta`` (default 10000), ``partial_rotary_factor``
    if given, and the keys the type reads (``None`` values dropped; llama3/yarn get
    ``original_max_position_embeddings``, default ``max_position_embeddings``; longrope must
    name it: transformers' Phi-3 defaults it to 4096, not to another key). Raises ValueError for
    a rope_type outside ``ROPE_TYPES`` (``su`` is read as ``longrope``), a key the type does
    not read that would change the math, a missing required key, or a bad value.

    Example: ``{"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}}`` ->
    ``{"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}``.
    """
    scaling, params = config.get("rope_scaling"), config.get("rope_parameters")
    if scaling and params and scaling != params:
        raise ValueError(f"config rope_scaling={scaling!r} and rope_parameters={params!r} "
                         "disagree")
    where = "rope_scaling" if scaling else "rope_parameters"
    raw = {k: v for k, v in dict(scaling or params or {}).items() if v is not None}
    rope_type = _agree(f"{where}.rope_type", raw.pop("rope_type", None), raw.get("type"),
                       f"{where}.type") or "default"
    rope_type = LEGACY_ROPE_TYPES.get(rope_type, rope_type)
    if rope_type == "dynamic":
        raise ValueError(f"config {where}.rope_type='dynamic' is refused: dynamic NTK rescales "
                         "by the largest position in the batch, so a request's tokens would "
                         "depend on the requests batched with it and cached keys would keep "
                         f"stale rotations; allowed rope types: {', '.join(ROPE_TYPES)}")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config {where}.rope_type={rope_type!r} is not supported; allowed "
                         f"rope types: {', '.join(ROPE_TYPES)}")
    theta = _agree(f"{where}.rope_theta", raw.pop("rope_theta", None), config.get("rope_theta"),
                   "rope_theta")
    out = {"rope_type": rope_type, "rope_theta": _number("rope_theta", 10000.0 if theta is None
                                                         else theta)}
    partial = _agree(f"{where}.partial_rotary_factor", raw.pop("partial_rotary_factor", None),
                     config.get("partial_rotary_factor"), "partial_rotary_factor")
    if config.get("rotary_dim") is not None:
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        rotary_dim = config["rotary_dim"]
        from_dim = rotary_dim / head_dim
        if int(head_dim * from_dim) != rotary_dim:
            raise ValueError(f"config rotary_dim={rotary_dim} with head_dim={head_dim}: "
                             f"transformers rotates int({head_dim} * {rotary_dim}/{head_dim}) = "
                             f"{int(head_dim * from_dim)} channels instead")
        partial = _agree("partial_rotary_factor", partial, from_dim,
                         f"rotary_dim/head_dim={rotary_dim}/{head_dim}")
    if partial is not None:
        if not 0 < _number("partial_rotary_factor", partial) <= 1:
            raise ValueError(f"config partial_rotary_factor={partial!r}: must be in (0, 1]")
        out["partial_rotary_factor"] = partial
    for key, value in raw.items():
        if key in _TYPE_KEYS[rope_type]:
            out[key] = value
        elif key not in _HARMLESS:
            raise ValueError(
                f"config {where}.{key}={value!r} is not read by rope_type={rope_type!r} and would "
                f"change the rotary embedding; that type reads "
                f"{sorted(_TYPE_KEYS[rope_type] | {'rope_theta', 'partial_rotary_factor'})}")
    for key in _REQUIRED[rope_type]:
        if key not in out:
            raise ValueError(f"config {where}.{key} is required by rope_type={rope_type!r}")
        if key in _FACTOR_LISTS:
            _factor_list(f"{where}.{key}", out[key])
        else:
            _number(f"{where}.{key}", out[key])
    if rope_type in ("llama3", "yarn", "longrope"):
        fallback = config.get("max_position_embeddings") if rope_type != "longrope" else None
        original = next((v for v in (config.get("original_max_position_embeddings"),
                                     out.get("original_max_position_embeddings"), fallback)
                         if v is not None), None)
        if original is None:
            raise ValueError(f"config {where}.original_max_position_embeddings is required by "
                             f"rope_type={rope_type!r}")
        out["original_max_position_embeddings"] = _number(
            "original_max_position_embeddings", original)
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        if key in out:
            _number(f"{where}.{key}", out[key], positive=False)
    if rope_type == "longrope" and "factor" in out:
        _number(f"{where}.factor", out["factor"])
    return out


def _factor_list(where: str, value) -> list:
    """``value`` when it is a non-empty list of positive numbers, else ValueError naming it."""
    if not isinstance(value, list) or not value or not all(
            not isinstance(v, bool) and isinstance(v, (int, float)) and v > 0 for v in value):
        raise ValueError(f"config {where}={value!r}: must be a non-empty list of positive numbers")
    return value


# ---- inverse frequencies [dim/2] float32 on `device`, op for op as transformers'
# modeling_rope_utils ----

def _exponents(dim: int, device) -> torch.Tensor:
    """[dim/2] float32: 2j / dim."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _default(p: dict, dim: int, max_pos, device) -> torch.Tensor:
    return 1.0 / (p["rope_theta"] ** _exponents(dim, device))


def _linear(p: dict, dim: int, max_pos, device) -> torch.Tensor:
    return _default(p, dim, max_pos, device) / p["factor"]


def _llama3(p: dict, dim: int, max_pos, device) -> torch.Tensor:
    inv_freq = _default(p, dim, max_pos, device)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    old_len = p["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn_attention_factor(p: dict) -> float:
    """``attention_factor``, else from mscale/mscale_all_dim when both are set, else
    ``0.1 * ln(factor) + 1`` (1 for factor <= 1)."""
    factor, mscale, mscale_all_dim = p["factor"], p.get("mscale"), p.get("mscale_all_dim")

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("attention_factor") is not None:
        return p["attention_factor"]
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn(p: dict, dim: int, max_pos, device) -> torch.Tensor:
    base, factor = p["rope_theta"], p["factor"]
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations):
        return (dim * math.log(p["original_max_position_embeddings"] /
                               (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) /
                       (high - low), 0, 1)
    pos_freqs = base ** _exponents(dim, device)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_is_long(p: dict, max_pos: int) -> bool:
    """Whether longrope rotates by ``long_factor``: once per model, when it is extended past
    its pretraining length (``max_position_embeddings > original_max_position_embeddings``),
    as vLLM decides at its default ``max_model_len``. transformers decides per forward from
    the sequence length (short up to ``original_max_position_embeddings``, then long, the
    cache recomputed), so it agrees on every sequence longer than that, or, for a model not
    extended, on every sequence; one rotation per position keeps the paged cache valid."""
    return max_pos > p["original_max_position_embeddings"]


def _longrope_attention_factor(p: dict, max_pos: int) -> float:
    """``attention_factor``, else ``sqrt(1 + ln(factor) / ln(original))`` with ``factor``
    (default ``max_position_embeddings / original``; 1 for factor <= 1), both factor sets."""
    if p.get("attention_factor") is not None:
        return p["attention_factor"]
    original = p["original_max_position_embeddings"]
    factor = p.get("factor", max_pos / original)
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


def _longrope(p: dict, dim: int, max_pos, device) -> torch.Tensor:
    factors = p["long_factor"] if _longrope_is_long(p, max_pos) else p["short_factor"]
    # the factors as float32, written by device fills (a host tensor's copy would sync)
    ext = torch.stack([torch.full((), f, dtype=torch.float32, device=device) for f in factors])
    return 1.0 / (ext * p["rope_theta"] ** _exponents(dim, device))


_INV_FREQ = {"default": _default, "linear": _linear, "llama3": _llama3, "yarn": _yarn,
             "longrope": _longrope}


class Rope(NamedTuple):
    """Rotary cos/sin for one forward's positions, shared by all its layers.

    cos, sin: [..., T, 1, R] (R = rotary_dim <= head_dim, broadcast over heads) in the model
    dtype; ``sin`` carries the sign of the rotation, so ``apply(x)`` is
    ``x[:R] * cos + partner(x[:R]) * sin`` with channels R.. passed through. Pairs: (j, j + R/2)
    (neox / rotate_half layout, cos = [c, c], sin = [-s, s]) or, when ``interleaved``, (2j, 2j+1)
    (GPT-J layout, cos = [c0, c0, c1, c1, ..], sin = [-s0, s0, -s1, s1, ..]).

    Example (R = 2, angle a): x = [1, 0, 5] -> [cos a, sin a, 5].
    """

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool = False

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., T, H, D] (may be a strided view, e.g. the q and k heads of one qkv output)
        -> rotated copy, same shape and dtype (one kernel where Triton runs)."""
        partial = self.cos.shape[-1] != x.shape[-1]
        if (partial or self.interleaved) and not platform.unverified_gpu_paths():
            # the Triton kernel's partial / interleaved variants are not yet run on a GPU
            return kernels.TORCH_IMPLS["apply_rope"](x, self.cos, self.sin, self.interleaved)
        return kernels.apply_rope(x, self.cos, self.sin, interleaved=self.interleaved)


class RotaryEmbedding:
    """The rotary embedding of one model: ``tables(positions, dtype)`` once per forward.

    head_dim: channels per head; params: a ``rope_parameters`` dict (normalised again here);
    max_position_embeddings: the config's (llama3/yarn take it as
    original_max_position_embeddings when params lack one; longrope needs it to pick its
    factor set, ``_longrope_is_long``); interleaved: GPT-J pairs.
    ``rotary_dim = int(head_dim * partial_rotary_factor)`` (transformers' rounding), even.
    ``attention_factor``: yarn's and longrope's scale of cos and sin (1 for the other types).
    ``inv_freq(device)`` [rotary_dim/2] float32 is computed on that device with device ops
    the first time it is asked for (no copy, no host sync), then kept; on the CPU it equals
    transformers' bit for bit (an accelerator's pow may differ in the last ulp).

    Example: ``RotaryEmbedding(4, {"rope_type": "linear", "rope_theta": 100.0, "factor":
    2.0}).inv_freq("cpu")`` -> [0.5, 0.05].
    """

    def __init__(self, head_dim: int, params: dict, max_position_embeddings: int | None = None,
                 interleaved: bool = False):
        self.params = rope_parameters({"rope_parameters": dict(params),
                                       "max_position_embeddings": max_position_embeddings})
        self.rope_type = self.params["rope_type"]
        self.rotary_dim = int(head_dim * self.params.get("partial_rotary_factor", 1.0))
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} (head_dim={head_dim}, params="
                             f"{self.params}): must be even and >= 2")
        self.max_position_embeddings = max_position_embeddings
        self.interleaved = interleaved
        self.attention_factor = 1.0
        if self.rope_type == "yarn":
            self.attention_factor = _yarn_attention_factor(self.params)
        elif self.rope_type == "longrope":
            if max_position_embeddings is None:
                raise ValueError("rope_type='longrope' needs max_position_embeddings (it picks "
                                 "the factor set and the attention factor)")
            for key in _FACTOR_LISTS:
                if len(self.params[key]) != self.rotary_dim // 2:
                    raise ValueError(f"config rope_scaling.{key} has {len(self.params[key])} "
                                     f"factors: need rotary_dim/2 = {self.rotary_dim // 2}")
            self.attention_factor = _longrope_attention_factor(self.params,
                                                               max_position_embeddings)
        self._inv_freq = {}

    @classmethod
    @functools.cache
    def default(cls, head_dim: int, theta: float) -> "RotaryEmbedding":
        """The plain RoPE of ``rope_theta`` alone (one shared instance per arguments)."""
        return cls(head_dim, {"rope_type": "default", "rope_theta": theta})

    def inv_freq(self, device: torch.device | str) -> torch.Tensor:
        """[rotary_dim/2] float32 on ``device``.
        Kept for the next call unless built inside a CUDA graph capture or torch.compile
        (whose tensors hold no values until replayed)."""
        device = torch.device(device)
        inv_freq = self._inv_freq.get(device)
        if inv_freq is None:
            inv_freq = _INV_FREQ[self.rope_type](self.params, self.rotary_dim,
                                                 self.max_position_embeddings, device)
            if not (torch.compiler.is_compiling() or device.type == "cuda"
                    and torch.cuda.is_current_stream_capturing()):
                self._inv_freq[device] = inv_freq
        return inv_freq

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """positions [..., T] (any int/float dtype) -> Rope with [..., T, 1, rotary_dim] tables
        in ``dtype``, computed in float32 then cast (as transformers does)."""
        inv_freq = self.inv_freq(positions.device)
        angles = positions[..., None].float() * inv_freq  # [..., T, R/2]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if self.interleaved:
            cos, sin = (torch.stack(pair, -1).flatten(-2) for pair in ((cos, cos), (-sin, sin)))
        else:
            cos, sin = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        return Rope(cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype), self.interleaved)
