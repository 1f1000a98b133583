"""Tensor-parallel layers (the Megatron scheme, as nano-vllm writes it) and the one function
that shards a built decoder model onto them.

Layers (T = tensor_parallel_size, r = this rank):
- ``ColumnParallelLinear``: a MergedLinear holding rows ``r`` of each part (q/k/v, gate/up);
  its input is all-gathered first under sequence parallelism. No collective otherwise.
- ``RowParallelLinear``: columns ``r`` of o_proj / down_proj; the partial outputs are summed
  (all-reduce, or reduce-scatter of tokens under SP). No bias.
- ``VocabParallelEmbedding``: rows ``[r*V/T, (r+1)*V/T)`` of the table; ids outside give 0;
  one all-reduce gives every rank the full [N, H] (the draft heads share it).
- ``ParallelLMHead``: the same rows of lm_head; local logits [M, V/T] are all-gathered to
  [M, V] for sampling.
- ``ShardedRMSNorm``: MiniMax-M2's q/k norm over the whole projection: the sum of squares is
  all-reduced (divided by the replication of KV heads).

Attention: Hq/T query heads per rank; KV heads split when Hkv >= T, else each rank keeps KV
head ``r // (T / Hkv)`` (replicated). MLA (``layers.mla``): H/T heads per rank (``q_proj`` or
``q_b_proj`` and ``kv_b_proj`` rows, ``o_proj`` columns), the latent projection and cache
replicated. MoE: every expert (and shared expert) split like an MLP, its partial outputs
summed by ONE reduction after the experts; the router is replicated.

Routed experts over the D x T grid (``ExpertPlacement``, also without TP): DP rank d keeps
experts ``d*E/D ..`` and splits each like an MLP over its TP ranks; with expert parallelism
(vLLM's ``enable_expert_parallel``) rank ``d*T + t`` keeps ``E/(D*T)`` whole experts. Either
way a rank reads only its experts' tensors, and the MoE layer's two DP collectives (tokens
gathered, partial outputs reduce-scattered) and its TP reduction stay what they were.

``shard_model(model, tp)`` swaps those modules in place (the new ones are empty, on the old
ones' device and dtype) and returns ``{state-dict name: (dim, start, stop)}``: the slice of
each full tensor this rank holds. The loader reads exactly that slice from the safetensors
files (``checkpoint.load_into(shard=...)``); an in-memory model is sliced from its old state.
Its pieces, ``shard_layer`` (one decoder layer) and ``vocab_parallel`` (one vocabulary table),
also place a draft head's MTP layer like the target's layers (``heads.deepseek_mtp``: the same
slices, the same experts, its own embedding / lm_head copies vocab-parallel).

A fused tensor (Phi-3's ``qkv_proj``, ``gate_up_proj``) gets a list of such slices: this
rank's rows of each part, read and concatenated in the parts' order.

Example (T=2, rank 1, Hq=4, Hkv=2, D=8, H=32): ``q_proj.weight`` -> (0, 16, 32),
``k_proj.weight`` -> (0, 8, 16), ``o_proj.weight`` -> (1, 16, 32); with Hkv=1, ``k_proj``
-> (0, 0, 8) on both ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdec.distributed import TPContext
from specdec.models import checkpoint
from specdec.models.layers.attention import Attention
from specdec.models.layers.linear import MergedLinear
from specdec.models.layers.mla import MLAttention
from specdec.models.layers.mlp import MLP
from specdec.models.layers.moe import MoEMLP

Slices = dict[str, tuple[int, int, int]]


class ColumnParallelLinear(MergedLinear):
    """``x [N(/T under SP), in] -> [N, sum(local parts)]``."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, tp: TPContext):
        super().__init__(in_features, parts, bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.tp.gather(x))


class RowParallelLinear(nn.Linear):
    """``x [N, in/T] -> [N, out]`` summed over ranks (SP: this rank's [N/T, out]); a bias
    (every rank's whole copy) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, bias: bool = False):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """ids [...] -> [..., H], every rank the full rows (one all-reduce)."""

    def __init__(self, num_local: int, dim: int, start: int, tp: TPContext):
        super().__init__(num_local, dim)
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[..., None], 0.0))


class ParallelLMHead(nn.Linear):
    """hidden [..., H] -> logits [..., V] (each rank computes V/T columns, all-gathered)."""

    def __init__(self, dim: int, num_local: int, tp: TPContext):
        super().__init__(dim, num_local, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        local = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        return self.tp.gather_last(local).view(*lead, -1)


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a width split across ranks: x [..., C/T] with the statistics of all C.
    ``replicas``: how many ranks hold each channel (KV heads replicated when Hkv < T)."""

    def __init__(self, local_dim: int, full_dim: int, replicas: int, eps: float,
                 tp: TPContext):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_dim))
        self.full_dim, self.replicas, self.eps, self.tp = full_dim, replicas, eps, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        sumsq = self.tp.all_reduce(xf.square().sum(-1, keepdim=True))
        var = sumsq / (self.replicas * self.full_dim)
        return (self.weight * (xf * torch.rsqrt(var + self.eps)).to(x.dtype))


def _split(total: int, tp: TPContext, field: str) -> tuple[int, int]:
    """(start, count) of this rank's equal share of ``total``; ValueError naming ``field``."""
    if total % tp.size:
        raise ValueError(f"{field}={total} must be a multiple of tensor_parallel_size={tp.size}")
    per = total // tp.size
    return tp.rank * per, per


def _like(new: nn.Module, old: nn.Module) -> nn.Module:
    p = next(old.parameters())
    return new.to(device=p.device, dtype=p.dtype)


def _shard_attention(attn: Attention, tp: TPContext, prefix: str, out: Slices) -> None:
    hq, hkv, d = attn.n_heads, attn.n_kv, attn.head_dim
    q0, nq = _split(hq, tp, "num_attention_heads")
    if hkv >= tp.size:
        k0, nk = _split(hkv, tp, "num_key_value_heads")
        replicas = 1
    elif tp.size % hkv:
        raise ValueError(f"num_key_value_heads={hkv}: tensor_parallel_size={tp.size} must be "
                         "a multiple of it (KV heads are replicated) or divide it")
    else:
        replicas = tp.size // hkv
        k0, nk = tp.rank // replicas, 1
    old = attn.qkv_proj
    bias = old.bias is not None
    attn.qkv_proj = _like(ColumnParallelLinear(
        old.in_features, {"q_proj": nq * d, "k_proj": nk * d, "v_proj": nk * d}, bias, tp), old)
    attn.o_proj = _like(RowParallelLinear(nq * d, attn.o_proj.out_features, tp,
                                          bias=attn.o_proj.bias is not None), attn.o_proj)
    rows = {"q_proj": (q0 * d, (q0 + nq) * d), "k_proj": (k0 * d, (k0 + nk) * d),
            "v_proj": (k0 * d, (k0 + nk) * d)}
    kinds = ("weight",) + (("bias",) if bias else ())
    if attn.fused_checkpoint:  # Phi-3's qkv_proj: this rank's q, k and v rows, one tensor
        starts = {"q_proj": 0, "k_proj": hq * d, "v_proj": (hq + hkv) * d}
        for kind in kinds:
            out[f"{prefix}qkv_proj.{kind}"] = [(0, starts[n] + a, starts[n] + b)
                                               for n, (a, b) in rows.items()]
    else:
        for name, (a, b) in rows.items():
            for kind in kinds:
                out[f"{prefix}{name}.{kind}"] = (0, a, b)
    out[f"{prefix}o_proj.weight"] = (1, q0 * d, (q0 + nq) * d)
    if attn.sinks is not None:  # one logit per query head (gpt-oss)
        attn.sinks = nn.Parameter(attn.sinks.new_zeros(nq))
        out[f"{prefix}sinks"] = (0, q0, q0 + nq)
    if attn.qk_norm == "full":
        for norm, name, heads, reps in (("q_norm", "q_proj", hq, 1), ("k_norm", "k_proj", hkv,
                                                                        replicas)):
            old_norm = getattr(attn, norm)
            a, b = rows[name]
            setattr(attn, norm, _like(ShardedRMSNorm(b - a, heads * d, reps, old_norm.eps, tp),
                                      old_norm))
            out[f"{prefix}{norm}.weight"] = (0, a, b)
    attn.n_heads, attn.n_kv = nq, nk


def _shard_mla(attn: MLAttention, tp: TPContext, prefix: str, out: Slices) -> None:
    h0, nh = _split(attn.n_heads, tp, "num_attention_heads")
    qk, kv = attn.nope + attn.rope_dim, attn.nope + attn.v_dim
    q_name = "q_proj" if hasattr(attn, "q_proj") else "q_b_proj"
    for name, width in ((q_name, qk), ("kv_b_proj", kv)):
        old = getattr(attn, name)
        setattr(attn, name, _like(nn.Linear(old.in_features, nh * width, bias=False), old))
        out[f"{prefix}{name}.weight"] = (0, h0 * width, (h0 + nh) * width)
    attn.o_proj = _like(RowParallelLinear(nh * attn.v_dim, attn.o_proj.out_features, tp),
                        attn.o_proj)
    out[f"{prefix}o_proj.weight"] = (1, h0 * attn.v_dim, (h0 + nh) * attn.v_dim)
    attn.n_heads, attn.tp = nh, tp


def _shard_mlp(mlp: MLP, tp: TPContext, prefix: str, out: Slices, *, reduce: bool) -> None:
    """gate/up rows (and biases) and down columns of this rank; ``reduce=False`` (MoE
    experts): plain layers whose partial outputs the MoE sums once, so a down bias (gpt-oss's
    experts) stays on TP rank 0 alone (the sum then adds it once)."""
    inter = mlp.down_proj.in_features
    i0, n = _split(inter, tp, "intermediate_size (or moe_intermediate_size)")
    old_gu, old_down = mlp.gate_up_proj, mlp.down_proj
    parts = {"gate_proj": n, "up_proj": n}
    bias = old_gu.bias is not None
    if reduce:
        mlp.gate_up_proj = _like(ColumnParallelLinear(old_gu.in_features, parts, bias, tp),
                                 old_gu)
        mlp.down_proj = _like(RowParallelLinear(n, old_down.out_features, tp, bias), old_down)
    else:
        mlp.gate_up_proj = _like(MergedLinear(old_gu.in_features, parts, bias), old_gu)
        mlp.down_proj = _like(nn.Linear(n, old_down.out_features, bias=bias and tp.rank == 0),
                              old_down)
    kinds = ("weight",) + (("bias",) if bias else ())
    if mlp.fused_checkpoint:  # Phi-3's gate_up_proj: this rank's gate, then up rows
        for kind in kinds:
            out[f"{prefix}gate_up_proj.{kind}"] = [(0, i0, i0 + n),
                                                   (0, inter + i0, inter + i0 + n)]
    else:
        for name in ("gate_proj", "up_proj"):
            for kind in kinds:
                out[f"{prefix}{name}.{kind}"] = (0, i0, i0 + n)
    out[f"{prefix}down_proj.weight"] = (1, i0, i0 + n)


def _shard_moe(moe: MoEMLP, tp: TPContext, prefix: str, out: Slices,
               experts: "ExpertPlacement") -> None:
    """The routed experts of this rank (``experts``), split over the TP ranks unless whole;
    the shared experts split over the TP ranks."""
    moe.keep_experts(moe.local_experts(experts.rank, experts.size, experts.what))
    if tp.size > 1:
        if not experts.whole:
            for name, expert in moe.experts.items():
                _shard_mlp(expert, tp, f"{prefix}experts.{name}.", out, reduce=False)
        if hasattr(moe, "shared_experts"):
            _shard_mlp(moe.shared_experts, tp, f"{prefix}shared_experts.", out, reduce=False)
    moe.tp = tp


@dataclass(frozen=True)
class ExpertPlacement:
    """Which routed experts a rank holds: ``rank`` of ``size`` ranks share them by expert
    (``what``: the size's name in errors), ``whole`` experts or each split over the TP ranks.
    Example (E=8, D=2, T=2, rank dp 1 / tp 0): DP -> experts 4..7, each half width; EP ->
    rank 2 of 4 -> experts 4, 5 whole."""

    rank: int = 0
    size: int = 1
    whole: bool = False
    what: str = "data_parallel_size"

    @classmethod
    def of(cls, tp: TPContext, dp_rank: int = 0, dp_size: int = 1,
           expert_parallel: bool = False) -> "ExpertPlacement":
        if expert_parallel:
            return cls(dp_rank * tp.size + tp.rank, dp_size * tp.size, True,
                       "data_parallel_size x tensor_parallel_size")
        return cls(dp_rank, dp_size)


def shard_layer(layer: nn.Module, tp: TPContext, prefix: str, out: Slices,
                experts: ExpertPlacement, owner: str, index: int) -> None:
    """Decoder layer ``layer`` (checkpoint names under ``prefix``) onto this rank's TP layers:
    its attention (GQA or MLA, by heads) and its MLP (split by width) or MoE (``experts``'
    routed experts, the shared ones by width); ValueError naming ``owner`` (e.g. "the
    DeepseekV3ForCausalLM family") for a layer of another kind. The target's layers and a
    draft head's MTP layer (``heads.deepseek_mtp``) go through here."""
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if not (isinstance(attn, (Attention, MLAttention)) and isinstance(mlp, (MLP, MoEMLP))):
        raise ValueError(
            f"tensor_parallel_size={tp.size}: {owner} is not sharded yet (layer {index}: "
            f"{type(attn).__name__}, {type(mlp).__name__}); allowed: tensor_parallel_size=1")
    shard_attn = _shard_mla if isinstance(attn, MLAttention) else _shard_attention
    shard_attn(attn, tp, prefix + "self_attn.", out)
    if isinstance(mlp, MoEMLP):
        _shard_moe(mlp, tp, prefix + "mlp.", out, experts)
    else:
        _shard_mlp(mlp, tp, prefix + "mlp.", out, reduce=True)


def vocab_parallel(old: nn.Module, vocab: int, tp: TPContext, name: str,
                   out: Slices) -> nn.Module:
    """An embedding table (-> ``VocabParallelEmbedding``) or an lm_head (-> ``ParallelLMHead``)
    of ``vocab`` rows, holding this rank's V/T of them; ``out[name]``: those rows of the
    checkpoint's ``name``. The target's embedding and lm_head, and an MTP layer's own copies
    of them."""
    v0, nv = _split(vocab, tp, "vocab_size")
    if isinstance(old, nn.Embedding):
        new = VocabParallelEmbedding(nv, old.embedding_dim, v0, tp)
    else:
        new = ParallelLMHead(old.in_features, nv, tp)
    out[name] = (0, v0, v0 + nv)
    return _like(new, old)


def shard_model(model: nn.Module, tp: TPContext,
                experts: ExpertPlacement = ExpertPlacement()) -> Slices:
    """Swap the target's layers for this rank's TP layers and keep its routed experts
    (``experts``; see the module docstring); -> the slice of every sharded tensor.
    ``model``: a DecoderForCausalLM target; it keeps ``tp`` and ``expert_placement``
    (``experts``), which its MTP layer is placed by (``heads.deepseek_mtp``)."""
    out: Slices = {}
    if tp.size == 1:
        place_experts(model, tp, experts)
        model.expert_placement = experts
        return out
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise ValueError(f"tensor_parallel_size={tp.size}: {type(model).__name__} is not a "
                         "decoder family that can be sharded; allowed: tensor_parallel_size=1")
    vocab = model.config.vocab_size
    model.model.embed_tokens = vocab_parallel(model.model.embed_tokens, vocab, tp,
                                              "model.embed_tokens.weight", out)
    head = vocab_parallel(model.lm_head, vocab, tp, "lm_head.weight", out)
    if model.config.tie_word_embeddings:
        head.weight = model.model.embed_tokens.weight
    model.lm_head = head
    for i, layer in enumerate(model.model.layers):
        shard_layer(layer, tp, f"model.layers.{i}.", out, experts,
                    f"the {type(model).__name__} family", i)
    model.tp, model.expert_placement = tp, experts
    return out


def place_experts(model: nn.Module, tp: TPContext, experts: ExpertPlacement) -> None:
    """Without TP: keep this rank's routed experts in every MoE layer of ``model``."""
    for name, moe in model.named_modules():
        if isinstance(moe, MoEMLP):
            _shard_moe(moe, tp, f"{name}.", {}, experts)


def shard_from(model: nn.Module, tp: TPContext,
               experts: ExpertPlacement = ExpertPlacement()) -> nn.Module:
    """Shard an in-memory (full) model: each new tensor is its slice of the old one."""
    full = dict(model.state_dict())
    slices = shard_model(model, tp, experts)
    with torch.no_grad():
        for name, dest in model.state_dict().items():
            src = full[name]
            if name in slices:
                src = checkpoint.take(src, slices[name], "an in-memory model", name)
            dest.copy_(src)
    return model


def check_shardable(model: nn.Module, tp_size: int, dp_size: int = 1,
                    expert_parallel: bool = False) -> None:
    """Raise what ``shard_model`` would for ``tp_size`` x ``dp_size`` ranks, on a meta-device
    copy of ``model``'s family (nothing allocated, ``model`` untouched)."""
    if tp_size * dp_size == 1:
        return
    with torch.device("meta"):
        try:
            copy = type(model)(model.config)
        except (TypeError, AttributeError):  # not built from a ModelConfig alone
            raise ValueError(f"tensor_parallel_size={tp_size}: {type(model).__name__} is not a "
                             "decoder family that can be sharded; allowed: "
                             "tensor_parallel_size=1") from None
        shard_model(copy, TPContext(0, tp_size),
                    ExpertPlacement.of(TPContext(0, tp_size), 0, dp_size, expert_parallel))
