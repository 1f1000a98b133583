"""Attention metadata, per-layer paged KV cache tensors (shaped by each layer's spec) and
paged attention.

Slot of a token at position ``pos`` of request ``r``:
``block_table[r, pos // block_size] * block_size + pos % block_size``; slot ``-1`` means
"do not write" (padding rows, positions past ``max_model_len``). Writes to ``-1`` go to one
trash slot at the end of the flat cache, so no boolean masking (and no host sync) is needed.
Linear-attention layers (``LinearStateSpec``) keep no pages: their per-request state slots
live in a ``specdec.linear_state.StateCache`` the same ``KVCache`` holds.
"""

from dataclasses import dataclass

import torch

from specdec import kernels, platform
from specdec.kernels.paged_attention_torch import (PagedPlan, QuerySplit, SplitPlan, TreeMask,
                                                   attention_bias, check_softcap,
                                                   paged_attention)
from specdec.linear_state import LayerState, LinearStateSpec, StateCache, StateLayout


@dataclass
class AttentionMetadata:
    """Where the N query tokens of one forward live and what each may attend to."""

    slot_mapping: torch.Tensor  # [N] int64, -1 = don't write
    query_start_loc: torch.Tensor  # [B+1] int32, exclusive cumsum of query tokens per request
    seq_lens: torch.Tensor  # [B] int32, context length incl. this step's tokens
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_seq_len: int  # host upper bound on seq_lens (shapes the gather; never read from device)
    # linear-attention state (specdec.linear_state); None: every request on the trash row,
    # no drafts, the token count as the bound
    rows: torch.Tensor | None = None  # [B] int32, each request's state row
    num_draft_tokens: torch.Tensor | None = None  # [B] int32, drafts among its tokens (last)
    max_query_len: int | None = None  # host upper bound on tokens per request
    # per token, the draft-tree node it is (``TreeMask``: a node sees its request's prefix and
    # its ancestors); None: every token causal
    tree: TreeMask | None = None
    # host ints: the first requests are decodes the torch formula lays out apart from the
    # prefill chunks after them (``QuerySplit``); None: one layout
    query_split: QuerySplit | None = None

    @classmethod
    def dummy(cls, num_tokens: int, device) -> "AttentionMetadata":
        """An idle rank's layout: one request of num_tokens padding tokens, every write to -1."""
        return cls(slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
                   query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
                   seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
                   block_table=torch.zeros(1, 1, dtype=torch.int32, device=device),
                   max_seq_len=num_tokens)

    def request_of_token(self, num_tokens: int) -> torch.Tensor:
        """[N] int64 request index of each token; tokens past the last request map to it."""
        return kernels.token_requests(self.query_start_loc, num_tokens)


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps per token: ``num_kv_heads`` rows of ``head_dim`` for K
    and for V; ``sliding_window``: keys a query sees at most (None = all earlier keys; every
    layer keeps its whole sequence's keys, the window is a mask over them); ``scale``: of
    its scores (None = ``head_dim ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``);
    ``logit_softcap``: its scores pass through ``c * tanh(s / c)`` (Gemma-2; None = no cap);
    ``sinks``: the layer passes ``attend`` a learned per-head sink logit [Hq] (gpt-oss; the
    tensor lives on the layer, the spec only says it is there). ``PagedKV.attend`` reads the
    window, scale and cap; the window, cap and sinks decide the path.

    ``value_dim`` (a latent cache, MLA): no separate V; V is the first ``value_dim`` columns
    of the K row. E.g. DeepSeek-V3: ``KVCacheSpec(1, 512 + 64, value_dim=512)`` keeps 576
    values per token (1152 bytes in bf16) where GQA with 8 heads of 128 keeps 2048."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    value_dim: int | None = None
    scale: float | None = None
    logit_softcap: float | None = None
    sinks: bool = False

    def __post_init__(self):
        check_softcap(self.logit_softcap)
        if self.value_dim is not None and not 0 < self.value_dim <= self.head_dim:
            raise ValueError(f"KVCacheSpec value_dim={self.value_dim!r}: must be in "
                             f"[1, head_dim={self.head_dim}]")

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        rows = 1 if self.value_dim is not None else 2
        return rows * self.num_kv_heads * self.head_dim * torch.empty(
            (), dtype=dtype).element_size()


class KVCache:
    """K/V tensors of one model, one pair per layer as its ``KVCacheSpec`` says:
    ``k[i], v[i]`` are [num_blocks * block_size + 1 (trash), Hkv_i, D_i]; for a latent spec
    (``value_dim`` set) ``v[i]`` is the view ``k[i][..., :value_dim]`` (nothing allocated).
    A ``LinearStateSpec`` layer gets empty K/V and ``state_slots`` slots for each of
    ``state_rows`` request rows (the last one the trash row), and ``state_snapshots`` states
    for the prefix cache, in ``self.state``."""

    def __init__(self, specs: list[KVCacheSpec | LinearStateSpec], num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device | str,
                 state_rows: int = 1, state_slots: int = 1, state_snapshots: int = 0):
        num_slots = num_blocks * block_size + 1
        self.specs = list(specs)
        paged = [s for s in specs if isinstance(s, KVCacheSpec)]
        self.k = [torch.zeros((num_slots, s.num_kv_heads, s.head_dim) if isinstance(
            s, KVCacheSpec) else (0,), dtype=dtype, device=device) for s in specs]
        self.v = [k[..., :s.value_dim] if getattr(s, "value_dim", None) is not None
                  else torch.zeros_like(k) for s, k in zip(specs, self.k)]
        self.state = (StateCache(specs, state_rows, state_slots, device, state_snapshots,
                                 block_size)
                      if len(paged) < len(specs) else None)
        self.block_size = block_size
        self.trash_slot = num_slots - 1
        # a window, a soft cap, sinks or a latent row need a Triton path not yet run on a GPU: the
        # torch formulas (plan included: every layer shares it) until
        # platform.unverified_gpu_paths() is on
        self.torch_attention = (any(s.sliding_window is not None or s.value_dim is not None
                                    or s.logit_softcap is not None or s.sinks for s in paged)
                                and not platform.unverified_gpu_paths())
        # the rotary + cache write kernel (kernels.triton_rope.rope_write_kv) where Triton runs
        self.fused_rope_write = bool(paged) and platform.triton_available(self.k[0].device)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def bind(self, meta: AttentionMetadata) -> "PagedKV":
        return PagedKV(self, meta)

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every paged layer's K/V rows at slots ``src`` [M] int64 to slots ``dst`` [M]
        (-1: nothing, the trash slot), all sources read before any write: a draft tree's
        accepted path moved to the positions after its root."""
        dst = torch.where(dst < 0, self.trash_slot, dst)
        src = src.clamp(min=0)
        for spec, k, v in zip(self.specs, self.k, self.v):
            if isinstance(spec, KVCacheSpec):
                k.index_copy_(0, dst, k[src])
                if spec.value_dim is None:
                    v.index_copy_(0, dst, v[src])

    def accept(self, rows: torch.Tensor, sampled: torch.Tensor) -> None:
        """After verification: each row's linear-attention state continues from its last
        accepted token (``StateCache.accept``); nothing to do without linear layers."""
        if self.state is not None:
            self.state.accept(rows, sampled)


class PagedKV:
    """The ``kv`` object models call: ``attend(layer_idx, q, k, v)`` writes then attends.

    The per-forward plan (request of each token; on the torch path also the key slots and
    mask up to ``max_seq_len``) is built on the first call and shared by every layer.
    Attention itself is ``specdec.kernels.paged_attention``: a Triton kernel that reads only
    each token's visible keys where Triton runs, else gather + SDPA.
    """

    def __init__(self, cache: KVCache, meta: AttentionMetadata):
        self.cache = cache
        self.meta = meta
        self._write_slots: torch.Tensor | None = None
        self._plan = None
        # the torch formula's masks, (group, window) -> attention_bias [R, 1, T * group, L],
        # kept for the forward: one per key (a model with windowed layers holds two)
        self._biases: dict = {}
        self._state_layout: StateLayout | None = None
        # the torch formulas: the cache's rule, and a draft tree's mask until the Triton
        # kernels' tree path has run on a GPU (``platform.unverified_gpu_paths``)
        self.torch_attention = cache.torch_attention or (
            meta.tree is not None and not platform.unverified_gpu_paths())

    def linear_state(self, layer_idx: int, num_tokens: int) -> tuple[LayerState, StateLayout]:
        """A linear-attention layer's state tensors (``LayerState``) and this forward's layout
        (built by the first layer that asks)."""
        state = self.cache.state
        if state is None or layer_idx not in state.ssm:
            raise ValueError(f"layer {layer_idx} has no linear-attention state (its spec is "
                             "not a LinearStateSpec)")
        if self._state_layout is None:
            self._state_layout = state.layout(self.meta, num_tokens)
        return state.layer(layer_idx), self._state_layout

    def _plan_once(self, num_tokens: int):
        """The per-forward plan (and write slots), built by the first layer that attends."""
        meta = self.meta
        if self._plan is None:
            self._write_slots = torch.where(meta.slot_mapping < 0, self.cache.trash_slot,
                                            meta.slot_mapping)
            args = (meta.query_start_loc, meta.seq_lens, meta.block_table, num_tokens,
                    meta.max_seq_len, self.cache.block_size, meta.max_query_len)
            if self.torch_attention or meta.query_split is not None:  # a split: CPU steps only
                self._plan = kernels.TORCH_IMPLS["plan_paged_attention"](
                    *args, tree=meta.tree, split=meta.query_split)
            else:  # by device (the Triton kernel's plan: one program per token, no split)
                self._plan = kernels.plan_paged_attention(*args, tree=meta.tree)
        return self._plan

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, Hq, D], k/v [N, Hkv, D] (RoPE applied; may be strided views) -> [N, Hq, D];
        windowed, scaled and capped as the layer's ``KVCacheSpec`` says; ``sinks`` [Hq]: the
        layer's sink logits, given exactly when its spec has ``sinks``."""
        spec, k_cache, v_cache = self._layer(layer_idx, sinks, q.shape[0])
        k_cache.index_copy_(0, self._write_slots, k)
        v_cache.index_copy_(0, self._write_slots, v)
        return self._attention(q, k_cache, v_cache, spec, sinks)

    def fuses_rope_write(self, rope, head_dim: int) -> bool:
        """Whether ``attend_qkv`` serves a layer with this rope: the cache takes the fused
        kernel (``KVCache.fused_rope_write``) and the rotary is full and neox-layout."""
        return (self.cache.fused_rope_write and not rope.interleaved
                and rope.cos.shape[-1] == head_dim)

    def attend_qkv(self, layer_idx: int, qkv: torch.Tensor, num_q_heads: int, rope,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``attend`` from one projection's q, k and v heads, qkv [N, Hq + 2 Hkv, D], before
        rotary (``rope``: a ``layers.rotary.Rope``; ``fuses_rope_write`` must hold): rotary
        and the K/V write in one kernel (``kernels.triton_rope.rope_write_kv``)."""
        spec, k_cache, v_cache = self._layer(layer_idx, sinks, qkv.shape[0])
        from specdec.kernels.triton_rope import rope_write_kv  # where Triton runs only
        q = rope_write_kv(qkv, rope.cos, rope.sin, self._write_slots, k_cache, v_cache,
                          num_q_heads)
        return self._attention(q, k_cache, v_cache, spec, sinks)

    def _layer(self, layer_idx: int, sinks: torch.Tensor | None, num_tokens: int):
        """-> (the layer's spec, checked against ``sinks``; its K and V caches), the
        forward's plan built."""
        spec = self.cache.specs[layer_idx]
        if spec.sinks != (sinks is not None):
            raise ValueError(f"layer {layer_idx}: its KVCacheSpec has sinks={spec.sinks} but "
                             f"attend got {'no' if sinks is None else 'a'} sinks tensor")
        self._plan_once(num_tokens)
        return spec, self.cache.k[layer_idx], self.cache.v[layer_idx]

    def _attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spec,
                   sinks: torch.Tensor | None) -> torch.Tensor:
        kw = dict(sliding_window=spec.sliding_window, scale=spec.scale,
                  softcap=spec.logit_softcap, sinks=sinks)
        if not isinstance(self._plan, (PagedPlan, SplitPlan)):  # the Triton kernel's plan
            return kernels.paged_attention(q, k_cache, v_cache, self._plan, **kw)
        # the torch formula: one additive mask per (query group, window), shared by the layers
        key = (q.shape[1] // k_cache.shape[1], spec.sliding_window)
        if key not in self._biases:
            self._biases[key] = attention_bias(self._plan, *key, q.dtype)
        return paged_attention(q, k_cache, v_cache, self._plan, bias=self._biases[key], **kw)

    def attend_latent(self, layer_idx: int, q: torch.Tensor, latent: torch.Tensor,
                      scale: float) -> torch.Tensor:
        """MLA over a latent layer (``value_dim`` V): q [N, H, D] (absorbed queries), latent
        [N, D] (this step's rows, written first) -> [N, H, V], the softmax (scaled by
        ``scale``) of ``q . row`` over each token's visible rows, times their first V columns
        (``specdec.kernels.mla_attention``)."""
        spec = self.cache.specs[layer_idx]
        if spec.value_dim is None:
            raise ValueError(f"layer {layer_idx} has no latent cache (its KVCacheSpec has no "
                             "value_dim)")
        plan = self._plan_once(q.shape[0])
        cache = self.cache.k[layer_idx]
        cache.index_copy_(0, self._write_slots, latent.unsqueeze(1))
        mla = (kernels.TORCH_IMPLS["mla_attention"] if self.torch_attention
               else kernels.mla_attention)
        return mla(q, cache, plan, value_dim=spec.value_dim, scale=scale)
