"""Mixture-of-experts MLP whose experts are split across the DP ranks (expert parallel = DP).

Config keys (kept in ``ModelConfig.extra``): ``num_experts`` (Qwen3-MoE) or
``num_local_experts`` (MiniMax-M2, transformers 5) E (0 or absent: dense MLP),
``num_experts_per_tok`` k, ``moe_intermediate_size`` I (default ``intermediate_size``),
``norm_topk_prob`` (default False, as HF), ``scoring_func`` (``softmax``, default, or
``sigmoid``), ``use_routing_bias``; which layers: ``decoder_sparse_step``, ``mlp_only_layers``
(``is_moe_layer``). Parameters: ``mlp.gate.weight [E, H]`` (the router, on every rank),
``mlp.e_score_correction_bias [E]`` (float32, with ``use_routing_bias``) and
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (SwiGLU experts; DP rank r of D keeps experts
``r*E/D .. (r+1)*E/D - 1``, or with expert parallelism rank r of the D x T grid keeps
``r*E/(D*T) ..`` whole: ``place_experts`` in ``layers.parallel``).

Routing per token t, softmax (Qwen3-MoE): ``p = softmax(gate(x_t))``; keep the k largest;
with ``norm_topk_prob`` rescale them to sum to 1. Sigmoid (MiniMax-M2): ``p = sigmoid(gate(x_t))``;
choose the k largest of ``p + e_score_correction_bias``, weigh them by their unbiased ``p``
rescaled to sum to 1. DeepSeek-V3 (``topk_method: noaux_tc``, sigmoid): the E experts form
``n_group`` groups of E/n_group; a group's rank is the sum of its two largest ``p + bias``;
only the ``topk_group`` best groups compete, and the k largest ``p + bias`` among their experts
are kept; weights are their unbiased ``p`` (divided by their sum + 1e-20 when
``norm_topk_prob``), times ``routed_scaling_factor`` (default 1). E.g. E=4, 2 groups,
topk_group=1, k=2, p + bias = [.9, .1, .6, .6]: group sums [1.0, 1.2] -> experts 2, 3 win
although expert 0 scores highest. Then ``out_t = sum_e p_e * expert_e(x_t)`` over the kept e,
plus ``shared_experts(x_t)`` (an MLP of width ``n_shared_experts * I``) when
``n_shared_experts`` > 0, or (Qwen3-Next) ``sigmoid(shared_expert_gate(x_t)) *
shared_expert(x_t)`` (an MLP of width ``shared_expert_intermediate_size``, a gate [1, H]) when
that is > 0 (either always run, on each rank's own tokens).

gpt-oss options (constructor arguments, no config key): ``router_bias`` (``mlp.gate.bias
[E]``), ``softmax_after_topk`` (keep the k largest logits, weights ``softmax`` over those k
only), ``expert_bias`` and ``clamped_swiglu`` (each expert's, ``layers.mlp.MLP``).

Dispatch, vLLM's naive DP+EP path: every rank all-gathers the ``[N, H]`` hidden of every rank
(same N on every rank: the DP token-count sync is what makes this legal), computes its local
experts' weighted outputs for all ``D*N`` tokens, and a reduce-scatter sums the ranks' partial
outputs and hands each rank back its own N rows. Unrouted (token, expert) pairs get weight 0,
so no data-dependent shape (and no host sync) appears.

Tensor parallelism (``shard_model`` in ``layers.parallel``): every expert is split like an
MLP across the TP ranks and the router is replicated; the layer all-gathers its input tokens
first under sequence parallelism, and sums the experts' partial outputs with ONE TP reduction
at the end (all-reduce, or reduce-scatter of tokens under SP).

Worked example (E=4, k=2, D=2, N=8, H=32): rank 0 holds experts 0, 1 and rank 1 experts
2, 3; each rank issues ``all_gather [8, 32]`` (into ``[16, 32]``) then ``reduce_scatter
[16, 32]`` (into ``[8, 32]``).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specdec.distributed import TPContext
from specdec.dp import DPContext
from specdec.models.layers.mlp import MLP

# torch >= 2.13 names; older torch has the *_tensor spellings
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


MOE_CONFIG_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                             "moe_intermediate_size", "norm_topk_prob", "scoring_func",
                             "use_routing_bias", "decoder_sparse_step", "mlp_only_layers"})
# DeepSeek-V2/V3's names (read by MoEMLP when present)
DEEPSEEK_MOE_KEYS = frozenset({"n_routed_experts", "n_shared_experts", "n_group", "topk_group",
                               "topk_method", "routed_scaling_factor"})
# Qwen3-Next's gated shared expert (read by MoEMLP when present)
SHARED_EXPERT_KEY = "shared_expert_intermediate_size"
SCORING = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "noaux_tc")


def num_experts(config) -> int:
    """E from ``config.extra`` (0 = dense MLP)."""
    extra = config.extra
    return (extra.get("num_experts") or extra.get("num_local_experts")
            or extra.get("n_routed_experts") or 0)


def is_moe_layer(config, layer: int) -> bool:
    """Whether layer ``layer`` has a MoE MLP (HF's rule: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``)."""
    step = config.extra.get("decoder_sparse_step", 1) or 1
    return (num_experts(config) > 0 and layer not in config.extra.get("mlp_only_layers", [])
            and (layer + 1) % step == 0)


class MoEMLP(nn.Module):
    def __init__(self, config, dp: DPContext | None = None, *, router_bias: bool = False,
                 softmax_after_topk: bool = False, expert_bias: bool = False,
                 clamped_swiglu: tuple[float, float] | None = None):
        super().__init__()
        extra = config.extra
        e, k = num_experts(config), extra.get("num_experts_per_tok")
        inter = extra.get("moe_intermediate_size", config.intermediate_size)
        if not isinstance(e, int) or e < 1:
            raise ValueError(f"num_experts={e!r}: must be an int >= 1 for a MoE layer")
        if not isinstance(k, int) or not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok={k!r}: must be an int in [1, num_experts={e}]")
        if not isinstance(inter, int) or inter < 1:
            raise ValueError(f"moe_intermediate_size={inter!r}: must be an int >= 1")
        self.scoring = extra.get("scoring_func", "softmax")
        if self.scoring not in SCORING:
            raise ValueError(f"scoring_func={self.scoring!r}: allowed {SCORING}")
        self.num_experts, self.top_k = e, k
        self.norm_topk_prob = bool(extra.get("norm_topk_prob", False))
        self.softmax_after_topk = softmax_after_topk
        if softmax_after_topk and self.scoring != "softmax":
            raise ValueError(f"scoring_func={self.scoring!r}: softmax_after_topk needs "
                             "'softmax'")
        self.topk_method = extra.get("topk_method", "greedy")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"topk_method={self.topk_method!r}: allowed {TOPK_METHODS}")
        if self.topk_method == "noaux_tc":
            self._check_groups(extra)
        h = config.hidden_size
        self.gate = nn.Linear(h, e, bias=router_bias)
        if extra.get("use_routing_bias", False) or self.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts = nn.ModuleDict({str(i): MLP(h, inter, bias=expert_bias,
                                                  clamped_swiglu=clamped_swiglu)
                                      for i in range(e)})
        shared = extra.get("n_shared_experts") or 0
        if not isinstance(shared, int) or shared < 0:
            raise ValueError(f"n_shared_experts={shared!r}: must be an int >= 0")
        if shared:
            self.shared_experts = MLP(h, shared * inter)
        gated = extra.get(SHARED_EXPERT_KEY) or 0
        if not isinstance(gated, int) or gated < 0:
            raise ValueError(f"{SHARED_EXPERT_KEY}={gated!r}: must be an int >= 0")
        if gated:
            self.shared_expert = MLP(h, gated)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.dp = DPContext()
        self.tp = TPContext()  # set by layers.parallel.shard_model
        if dp is not None:
            self.set_parallel(dp)

    def _check_groups(self, extra: dict) -> None:
        """DeepSeek's group-limited routing: sigmoid scores, n_group | E, topk_group <= n_group,
        k <= the experts of topk_group groups."""
        e, k = self.num_experts, self.top_k
        groups, keep = extra.get("n_group") or 1, extra.get("topk_group") or 1
        scale = extra.get("routed_scaling_factor", 1.0)
        if self.scoring != "sigmoid":
            raise ValueError(f"scoring_func={self.scoring!r} with topk_method='noaux_tc': "
                             "only 'sigmoid' is implemented")
        if not isinstance(groups, int) or groups < 1 or e % groups or e // groups < 2:
            raise ValueError(f"n_group={groups!r}: must divide num_experts={e} into groups "
                             "of at least 2 experts")
        if not isinstance(keep, int) or not 1 <= keep <= groups or k > keep * (e // groups):
            raise ValueError(f"topk_group={keep!r}: must be in [1, n_group={groups}] and keep "
                             f"at least num_experts_per_tok={k} experts")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"routed_scaling_factor={scale!r}: must be a positive number")
        self.n_group, self.topk_group, self.routed_scaling_factor = groups, keep, float(scale)

    def local_experts(self, rank: int, size: int, what: str = "data_parallel_size") -> range:
        """The global ids of the experts rank ``rank`` of ``size`` holds (whole experts)."""
        if self.num_experts % size:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of {what}="
                             f"{size} (the routed experts are split across those ranks)")
        per = self.num_experts // size
        return range(rank * per, (rank + 1) * per)

    def keep_experts(self, local: range) -> None:
        """Drop every routed expert but ``local`` (ValueError if one of those is gone)."""
        missing = [i for i in local if str(i) not in self.experts]
        if missing:
            raise ValueError(f"this rank needs experts {list(local)}, but the layer holds only "
                             f"{sorted(map(int, self.experts))}")
        for name in list(self.experts):
            if int(name) not in local:
                del self.experts[name]

    def set_parallel(self, dp: DPContext) -> None:
        """Attach the DP group the tokens are exchanged over. A layer that still holds every
        expert (a draft head or a model given in memory) keeps DP rank r's share, whole; one
        placed at load (``layers.parallel.place_experts``, a target's or the MTP layer loaded
        over it) keeps what it holds."""
        if len(self.experts) == self.num_experts:
            self.keep_experts(self.local_experts(dp.rank, dp.size))
        self.dp = dp

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, H] -> combine weights [M, E] (zero outside each token's top-k)."""
        # scores in at least float32 (HF), float64 models keep float64
        logits = self.gate(x).to(torch.promote_types(x.dtype, torch.float32))
        if self.topk_method == "noaux_tc":
            return self._route_grouped(logits).to(x.dtype)
        if self.softmax_after_topk:
            top, ids = logits.topk(self.top_k, dim=-1)
            return torch.zeros_like(logits).scatter_(1, ids, F.softmax(top, dim=-1)).to(x.dtype)
        if self.scoring == "softmax":
            probs = F.softmax(logits, dim=-1)
            w, ids = probs.topk(self.top_k, dim=-1)
        else:
            probs = torch.sigmoid(logits)
            choice = probs + self.e_score_correction_bias if hasattr(
                self, "e_score_correction_bias") else probs
            ids = choice.topk(self.top_k, dim=-1).indices
            w = probs.gather(1, ids)
        if self.norm_topk_prob or self.scoring == "sigmoid":
            w = w / w.sum(dim=-1, keepdim=True)
        return torch.zeros_like(probs).scatter_(1, ids, w).to(x.dtype)

    def _route_grouped(self, logits: torch.Tensor) -> torch.Tensor:
        """DeepSeek's ``noaux_tc`` routing (module docstring): logits [M, E] -> weights [M, E]."""
        m, e, g = logits.shape[0], self.num_experts, self.n_group
        probs = torch.sigmoid(logits)
        choice = probs + self.e_score_correction_bias
        group_rank = choice.view(m, g, e // g).topk(2, dim=-1).values.sum(dim=-1)  # [M, G]
        groups = group_rank.topk(self.topk_group, dim=-1).indices
        allowed = torch.zeros_like(group_rank, dtype=torch.bool).scatter_(1, groups, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(e // g, dim=1), float("-inf"))
        ids = choice.topk(self.top_k, dim=-1).indices
        w = probs.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return torch.zeros_like(probs).scatter_(1, ids, w * self.routed_scaling_factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] (under SP x and the result are this rank's [N/T, H]); the
        flattened token count N must be the same on every DP rank."""
        x = self.tp.gather(x)
        shape, h = x.shape, x.shape[-1]
        mine = x.reshape(-1, h)
        ctx = self.dp
        if ctx.size > 1:
            tokens = mine.new_empty((ctx.size * mine.shape[0], h))  # rank-major
            ctx.record("moe_all_gather", mine.shape)
            _all_gather(tokens, mine.contiguous(), group=ctx.group)
        else:
            tokens = mine  # [D*N, H]
        weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        for name, expert in self.experts.items():
            e = int(name)
            out += weights[:, e:e + 1] * expert(tokens)
        if ctx.size > 1:
            part = mine.new_empty(mine.shape)
            ctx.record("moe_reduce_scatter", out.shape)
            _reduce_scatter(part, out, group=ctx.group)
            out = part
        out = out.reshape(shape)
        if hasattr(self, "shared_experts"):
            out = out + self.shared_experts(x)
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.reduce(out)


def attach_parallel(model: nn.Module, dp: DPContext) -> bool:
    """Give every MoE layer of ``model`` the DP context; True if any."""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    for m in layers:
        m.set_parallel(dp)
    return bool(layers)


def has_cross_rank_layers(model: nn.Module) -> bool:
    """Whether ``model`` has a layer that exchanges data across DP ranks (a MoE layer)."""
    return any(isinstance(m, MoEMLP) for m in model.modules())
