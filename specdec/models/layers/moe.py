"""Mixture-of-experts MLP whose experts are split across the DP ranks (expert parallel = DP).

Config keys (kept in ``ModelConfig.extra``): ``num_experts`` (Qwen3-MoE) or
``num_local_experts`` (MiniMax-M2, transformers 5) E (0 or absent: dense MLP),
``num_experts_per_tok`` k, ``moe_intermediate_size`` I (default ``intermediate_size``),
``norm_topk_prob`` (default False, as HF), ``scoring_func`` (``softmax``, default, or
``sigmoid``), ``use_routing_bias``; which layers: ``decoder_sparse_step``, ``mlp_only_layers``
(``is_moe_layer``). Parameters: ``mlp.gate.weight [E, H]`` (the router, on every rank),
``mlp.e_score_correction_bias [E]`` (float32, with ``use_routing_bias``) and
``mlp.experts.{e}.{gate,up,down}_proj.weight`` (SwiGLU experts; DP rank r of D keeps experts
``r*E/D .. (r+1)*E/D - 1`` once the engine attaches its DPContext).

Routing per token t, softmax (Qwen3-MoE): ``p = softmax(gate(x_t))``; keep the k largest;
with ``norm_topk_prob`` rescale them to sum to 1. Sigmoid (MiniMax-M2): ``p = sigmoid(gate(x_t))``;
choose the k largest of ``p + e_score_correction_bias``, weigh them by their unbiased ``p``
rescaled to sum to 1. Then ``out_t = sum_e p_e * expert_e(x_t)`` over the kept e.

Dispatch, vLLM's naive DP+EP path: every rank all-gathers the ``[N, H]`` hidden of every rank
(same N on every rank: the DP token-count sync is what makes this legal), computes its local
experts' weighted outputs for all ``D*N`` tokens, and a reduce-scatter sums the ranks' partial
outputs and hands each rank back its own N rows. Unrouted (token, expert) pairs get weight 0,
so no data-dependent shape (and no host sync) appears.

Sequence parallelism (``sp_size`` T > 1, i.e. tensor_parallel_size with SP on): the N tokens
are split into T equal shards before dispatch -- the shape SP's reduce-scatter hands each TP
rank -- simulated on one process as a ``[T, N/T, H]`` view; ``N % T != 0`` raises ValueError.

Worked example (E=4, k=2, D=2, T=1, N=8, H=32): rank 0 holds experts 0, 1 and rank 1 experts
2, 3; each rank issues ``all_gather [1, 8, 32]`` (into ``[2, 8, 32]``) then ``reduce_scatter
[2, 8, 32]`` (into ``[1, 8, 32]``). With T=4, N=8: ``all_gather [4, 2, 32]``, ``reduce_scatter
[8, 2, 32]``; N=6 raises.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from specdec.dp import DPContext
from specdec.models.layers.mlp import MLP

# torch >= 2.13 names; older torch has the *_tensor spellings
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


MOE_CONFIG_KEYS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                             "moe_intermediate_size", "norm_topk_prob", "scoring_func",
                             "use_routing_bias", "decoder_sparse_step", "mlp_only_layers"})
SCORING = ("softmax", "sigmoid")


def num_experts(config) -> int:
    """E from ``config.extra`` (0 = dense MLP)."""
    return config.extra.get("num_experts") or config.extra.get("num_local_experts") or 0


def is_moe_layer(config, layer: int) -> bool:
    """Whether layer ``layer`` has a MoE MLP (HF's rule: not in ``mlp_only_layers`` and
    ``(layer + 1) % decoder_sparse_step == 0``)."""
    step = config.extra.get("decoder_sparse_step", 1) or 1
    return (num_experts(config) > 0 and layer not in config.extra.get("mlp_only_layers", [])
            and (layer + 1) % step == 0)


class MoEMLP(nn.Module):
    def __init__(self, config, dp: DPContext | None = None):
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
        h = config.hidden_size
        self.gate = nn.Linear(h, e, bias=False)
        if extra.get("use_routing_bias", False):
            self.register_buffer("e_score_correction_bias", torch.zeros(e, dtype=torch.float32))
        self.experts = nn.ModuleDict({str(i): MLP(h, inter) for i in range(e)})
        self.dp = DPContext()
        self.sp_size = 1
        if dp is not None:
            self.set_parallel(dp)

    def local_experts(self, dp: DPContext) -> range:
        """The global ids of the experts DP rank ``dp.rank`` runs."""
        if self.num_experts % dp.size:
            raise ValueError(f"num_experts={self.num_experts} must be a multiple of "
                             f"data_parallel_size={dp.size} (experts are split across DP ranks)")
        per = self.num_experts // dp.size
        return range(dp.rank * per, (dp.rank + 1) * per)

    def set_parallel(self, dp: DPContext, sp_size: int = 1) -> None:
        """Attach the DP group (dropping the other ranks' experts) and the SP shard count."""
        if not isinstance(sp_size, int) or sp_size < 1:
            raise ValueError(f"tensor_parallel_size={sp_size!r}: must be an int >= 1")
        local = self.local_experts(dp)
        missing = [i for i in local if str(i) not in self.experts]
        if missing:
            raise ValueError(f"DP rank {dp.rank} of {dp.size} needs experts {list(local)}, but "
                             f"this layer holds only {sorted(map(int, self.experts))}")
        for name in list(self.experts):
            if int(name) not in local:
                del self.experts[name]
        self.dp, self.sp_size = dp, sp_size

    def route(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, H] -> combine weights [M, E] (zero outside each token's top-k)."""
        # scores in at least float32 (HF), float64 models keep float64
        logits = self.gate(x).to(torch.promote_types(x.dtype, torch.float32))
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H]; the flattened token count N must be the same on every DP
        rank and a multiple of sp_size."""
        shape, h = x.shape, x.shape[-1]
        n, t = x.numel() // h, self.sp_size
        if n % t:
            raise ValueError(f"MoE token count {n} is not a multiple of tensor_parallel_size={t} "
                             "(sequence parallelism splits tokens into equal shards)")
        shards = x.reshape(t, n // t, h)  # the TP shards SP's reduce-scatter would hand out
        ctx = self.dp
        if ctx.size > 1:
            gathered = shards.new_empty((ctx.size * t, n // t, h))  # rank-major
            ctx.record("moe_all_gather", shards.shape)
            _all_gather(gathered, shards.contiguous(), group=ctx.group)
        else:
            gathered = shards
        tokens = gathered.reshape(-1, h)  # [D*N, H]
        weights = self.route(tokens)
        out = torch.zeros_like(tokens)
        for name, expert in self.experts.items():
            e = int(name)
            out += weights[:, e:e + 1] * expert(tokens)
        if ctx.size > 1:
            mine = shards.new_empty(shards.shape)
            ctx.record("moe_reduce_scatter", gathered.shape)
            _reduce_scatter(mine, out.view(gathered.shape), group=ctx.group)
            out = mine
        return out.reshape(shape)


def attach_parallel(model: nn.Module, dp: DPContext, sp_size: int = 1) -> bool:
    """Give every MoE layer of ``model`` the DP context and SP shard count; True if any."""
    layers = [m for m in model.modules() if isinstance(m, MoEMLP)]
    for m in layers:
        m.set_parallel(dp, sp_size)
    return bool(layers)


def has_cross_rank_layers(model: nn.Module) -> bool:
    """Whether ``model`` has a layer that exchanges data across DP ranks (a MoE layer)."""
    return any(isinstance(m, MoEMLP) for m in model.modules())
