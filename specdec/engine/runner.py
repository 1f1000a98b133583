"""The model runner: plans a step, fills the static step buffers, runs target, sampler, drafter.

One engine step (``LLM.step``):
    plan    = runner.plan(scheduled)        # the one DP all-reduce of the step (StepPlan)
    batch   = runner.prepare(scheduled, plan)   # host work: fill the buffers, 3 copies
    sampled, drafts = runner.execute(batch)     # device work only, no host-device sync
A capturable step runs the target step through its graph wrapper (`specdec.graphs`) and the
proposer's padded step through its own: on CUDA with ``graph_mode="full_cuda_graph"`` that is
two graph replays per step. Capturable are uniform decodes in a request bucket (key (Np, Bp),
attention bounded by max_model_len; captured at start-up) and, on the capturing backends
(``replay``, ``cuda_graph``), mixed steps with prefill
chunks whose Np and Bp are capture sizes (key (Np, Bp) and the attention bound, a power of two
>= the longest sequence; captured at first use). Each key has a graph per sampling variant
(greedy, sampled, sampled with top-p, processed: ``VARIANTS``; the processed one captured at
first use). With ``compile_dynamic`` no step is captured: every
step runs the dynamically compiled target step with its own bounds, compiled in two parts
(the forward, once per row layout; the verification, once per sampling variant too).
Sampling draws counter-based random numbers (``counter_rng``), so a replay needs no generator
state. A draft tree's step (``tree``) feeds each decode's nodes and verifies them with
``verify_tree``; the drafter then reads the accepted path as a chain (``chain_view``).
"""

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from specdec.attention import AttentionMetadata, KVCache
from specdec.distributed import TPContext
from specdec.dp import DPContext
from specdec.draft_tree import DynamicTree, StaticTree, node_shapes
from specdec.engine.counter_rng import request_key
from specdec.engine.logprobs import token_logprobs
from specdec.engine.penalties import process_logits
from specdec.engine.rejection_sampler import (GREEDY_TEMPERATURE, greedy_verify,
                                              rejection_sample, target_probs, valid_tokens)
from specdec.engine.scheduler import ScheduledRequest, is_uniform_decode
from specdec.engine.step_buffers import StepBuffers, StepInputs
from specdec.engine.tree_sampler import tree_greedy_verify, tree_rejection_sample
from specdec.engine.tp_step import DUMMY, STEP, STOP, StepBroadcast, header_words
from specdec.graphs import EAGER, Backend, StepGraph, compile_dynamic
from specdec.kernels import request_slots
from specdec.kernels.paged_attention_torch import QuerySplit, TreeMask
from specdec.models.layers.moe import attach_parallel
from specdec.padding import BatchPadder, StepPlan, StepPlanner, StepSizes
from specdec.proposers.inputs import DraftInputs


# the target step's sampling variants: every request greedy; temperature; and top-p; and
# processed (penalties, top-k, min-p, min_tokens: ``penalties``, the sampler's filters) with no
# sort (no sampled request has a top_k or top_p), the vocabulary sorted (one has a top_p), or
# a topk of W (top_k only, each <= W, a power of 2): ``processed_variant``
TOP_K_WIDTHS = tuple(1 << i for i in range(21))
VARIANTS = ("greedy", "sampled", "top_p", "processed", "processed_sorted",
            *(f"processed_top{w}" for w in TOP_K_WIDTHS))
# captured at start-up (``warm_up_graphs``; compile_dynamic: ``core.WARMUP_SAMPLING``); the
# processed variants' graphs are captured / compiled at their first use in each bucket instead
# (start-up captures per bucket more for variants a run may never use)
STARTUP_VARIANTS = VARIANTS[:3]
MIN_GRAPH_SEQ_LEN = 64  # the smallest attention bound of a captured mixed step


def graph_seq_len(max_seq_len: int, max_model_len: int) -> int:
    """A captured mixed step's attention bound: the power of two >= max_seq_len (at least
    MIN_GRAPH_SEQ_LEN), at most max_model_len; e.g. 70 -> 128 (max_model_len 2048)."""
    return min(max(MIN_GRAPH_SEQ_LEN, 1 << (max_seq_len - 1).bit_length()), max_model_len)


def sampling_variant(requests, vocab_size: int) -> str:
    """A processed variant when a request's logits are (``SamplingParams.processes_logits``: a
    penalty, top_k, min_p, or min_tokens not reached yet: ``processed_variant``); else greedy
    when every request is; top_p when one filters (the sort runs); else sampled."""
    if any(r.params.processes_logits(len(r.output_token_ids)) for r in requests):
        return processed_variant([r.params for r in requests], vocab_size)
    params = [r.params for r in requests]
    if all(p.temperature < GREEDY_TEMPERATURE for p in params):
        return "greedy"
    return "top_p" if any(p.top_p < 1.0 for p in params) else "sampled"


def processed_variant(params, vocab_size: int) -> str:
    """What a processed step sorts, from its sampled requests (vLLM's policy): nothing when
    none ranks (top_k 0, top_p 1: "processed"); the vocabulary when one has a top_p
    ("processed_sorted"); else a topk of the power of two W >= the largest top_k
    ("processed_top64" for top_k 40 and 50), exact for every top_k <= W."""
    ranking = [p for p in params if p.temperature >= GREEDY_TEMPERATURE
               and (p.top_k > 0 or p.top_p < 1.0)]
    if not ranking:
        return "processed"
    if any(p.top_p < 1.0 for p in ranking):
        return "processed_sorted"
    width = 1 << (max(p.top_k for p in ranking) - 1).bit_length()
    return (f"processed_top{width}" if width < vocab_size and width in TOP_K_WIDTHS
            else "processed_sorted")


def top_k_width(variant: str) -> int | None:
    """W of a "processed_top<W>" variant (top-k from a topk of W); None for any other."""
    return int(variant[len("processed_top"):]) if variant.startswith("processed_top") else None


def forward_then_verify(forward: Callable, verify: Callable, x: StepInputs, *, max_seq_len: int,
                        max_query_len: int, variant: str, num_rows: int,
                        query_split: QuerySplit | None = None) -> tuple[torch.Tensor, ...]:
    """The target step from its two parts (``ModelRunner.target_forward`` / ``verify``, or
    their compiled copies) -> (sampled, logits, hidden[, aux]): verification reads the logits
    only, the hidden states pass around it."""
    first, logits, *states = forward(x, max_seq_len=max_seq_len, max_query_len=max_query_len,
                                     num_rows=num_rows, query_split=query_split)
    return verify(x, first, logits, variant=variant, num_rows=num_rows), logits, *states


def first_sampled_positions(x: StepInputs) -> torch.Tensor:
    """[Bp] int64: the position of each request's first sampled token (its last known token's
    position + 1; the drafts, then any filler, follow the known token)."""
    return x.positions[x.logits_indices[:, 0]] + 1


@dataclass
class StepBatch:
    """One planned step's inputs, on the device (views of the runner's StepBuffers)."""

    plan: StepPlan
    inputs: StepInputs  # [Np] tokens, [Bp] requests
    max_seq_len: int  # host bound on seq_lens (eager attention)
    graph_seq_len: int  # the captured step's bound: max_model_len (uniform) or graph_seq_len()
    max_query_len: int  # host bound on tokens per request (eager attention)
    graph_query_len: int  # the captured step's bound: 1 + K (uniform) or Np (mixed)
    variant: str  # the target step's sampling: "greedy", "sampled" or "top_p" (host-known)
    # logits rows verified per request: 1 + the step's K, or on an eager single-rank step
    # with host drafts (ngram, suffix), 1 + the step's most drafts (none: one row)
    num_rows: int
    graph_num_rows: int  # the captured step's: 1 + the step's K (uniform) or 1 + K (mixed)
    # an uncaptured CPU step's decodes (first) and prefill chunks laid out apart in the torch
    # attention (``QuerySplit``); None: one layout
    query_split: QuerySplit | None = None


class ModelRunner:
    def __init__(self, target, proposer, sizes: StepSizes, *,
                 block_size: int, num_kv_blocks: int, aux_layer_ids: tuple[int, ...],
                 padder: BatchPadder, dp: DPContext, device: torch.device, dtype: torch.dtype,
                 backend: Backend = EAGER, seed: int = 0,
                 tp: TPContext | None = None, step_ks: tuple[int, ...] | None = None,
                 tree: StaticTree | DynamicTree | None = None, state_snapshots: int = 0):
        self.target = target
        self.proposer = proposer
        # the drafter's step follows the target's (a host drafter, ngram / suffix, has none)
        self.drafts_on_device = proposer is not None and proposer.drafts_on_device
        self.num_speculative_tokens = k = sizes.num_speculative_tokens
        # a draft tree's decodes verify its K + 1 nodes (``verify_tree``); None: chains
        self.tree = tree
        if tree is not None:
            self.tree_path = torch.full((sizes.max_num_reqs, tree.max_depth), -1,
                                        dtype=torch.int64, device=device)
            if isinstance(tree, StaticTree):  # its nodes' parents, for async scheduling
                self.static_parents = torch.tensor(tree.parent, device=device)
        self.step_ks = step_ks or (k,)  # every K a step can run (a K schedule's), ascending
        self.max_num_seqs = max_num_seqs = sizes.max_num_seqs
        self.max_model_len = max_model_len = sizes.max_model_len
        self.block_size = block_size
        self.aux_layer_ids = aux_layer_ids
        self.dp = dp
        self.tp = tp or TPContext()
        self.device = device
        # linear-attention layers: 1 + K state slots per request row, plus the trash row, and
        # the prefix cache's snapshots
        self.kv = KVCache(target.kv_cache_spec(), num_kv_blocks, block_size, dtype, device,
                          state_rows=max_num_seqs + 1, state_slots=1 + k,
                          state_snapshots=state_snapshots)
        # one row per request slot, plus a trash row of zeros for padding rows (their backup
        # token is 0, a valid id)
        self.token_table = torch.full((max_num_seqs + 1, max_model_len + 1), -1,
                                      dtype=torch.int32, device=device)
        self.token_table[max_num_seqs] = 0
        self.seed = seed  # keys the random numbers of requests without a seed of their own
        self.eos_token_ids = tuple(target.config.eos_token_ids)  # min_tokens holds them back
        self.vocab_size = target.config.vocab_size
        self.last_draft_seconds = 0.0  # drafter share of the last execute()
        # MoE layers (target and draft head) exchange tokens over the DP group (the backend
        # was checked for it: ``graphs.resolve_backend``)
        for model in (target, getattr(proposer, "head", None)):
            if model is not None:
                attach_parallel(model, dp)
        self.backend = backend
        # mixed steps: one graph per (Np, Bp, bound) key, captured at first use by the
        # capturing backends; the compiling ones would stall serving on an inductor compile
        # per key, so run them eager
        self.planner = StepPlanner(padder, dp, k, allow_capture=backend.fixed_shapes,
                                   capture_mixed=backend.captures,
                                   pad_tokens=backend.fixed_shapes)
        self.buffers = StepBuffers(sizes.max_num_tokens, sizes.max_num_reqs, k,
                                   -(-max_model_len // block_size), device,
                                   header=header_words(dp.size))
        # TP: the driver's step inputs reach its peers through one broadcast per step
        self.broadcast = StepBroadcast(self.tp, self.buffers, self.token_table, VARIANTS)
        in_parts = None
        if backend.dynamic:
            # the forward is traced once per row layout and the verification once per
            # sampling variant too, instead of the whole step once per both
            in_parts = functools.partial(
                forward_then_verify,
                compile_dynamic(self.target_forward, backend.compile_backend),
                compile_dynamic(self.verify, backend.compile_backend, realize_reused=True))
        self.target_graph = StepGraph(self.target_step, backend, inputs_type=StepInputs,
                                      compiled_in_parts=in_parts)
        self.last_step_captured = False  # whether the last execute() replayed a graph
        self.last_logits = self.last_hidden = None  # the last execute()'s (see there)

    def warm_up_graphs(self) -> float:
        """Capture the step wrappers of every capture bucket up to the largest step, largest
        first (its memory pool then serves the smaller ones), in each of STARTUP_VARIANTS, on
        all-padding steps, before the first real step (cuda_graph / replay): uniform decodes
        then capture nothing at serving time but a bucket's processed variant; mixed steps
        capture their (Np, Bp, bound) key at its first use. Compiling backends compile each bucket at its first use instead (an
        inductor compile per bucket would make start-up minutes long); either way outside the
        sync guards. -> seconds spent."""
        if not self.backend.captures:
            return 0.0
        start, padder = time.perf_counter(), self.planner.padder
        buckets = [b for b in padder.capture_sizes if b <= self.buffers.max_reqs]
        for k in reversed(self.step_ks):
            for bp in reversed(buckets):
                plan = StepPlan(0, 0, bp, bp * (1 + k), True, (bp * (1 + k),), True, k)
                for variant in STARTUP_VARIANTS:
                    self.execute(replace(self.prepare([], plan), variant=variant))
        return time.perf_counter() - start

    # ---- host side -------------------------------------------------------------------------
    def write_prompt(self, row: int, token_ids: list[int]) -> None:
        self.token_table[row].fill_(-1)
        self.token_table[row, :len(token_ids)] = torch.tensor(token_ids, dtype=torch.int32)
        self.broadcast.note_prompt(row, token_ids)

    def copy_states(self, saves: list[tuple[int, int]], restores: list[tuple[int, int]]
                    ) -> None:
        """The prefix cache's linear-attention state copies before a step
        (``Scheduler.take_state_copies``): (row, snapshot) saves, then (snapshot, row)
        restores. This rank's only: no hybrid family is tensor-parallel yet, so no peer
        needs them."""
        for row, snapshot in saves:
            self.kv.state.save(row, snapshot)
        for snapshot, row in restores:
            self.kv.state.restore(snapshot, row)

    def plan(self, scheduled: list[ScheduledRequest], k: int | None = None) -> StepPlan:
        """The step's one planning call (one DP all-reduce); all ranks get the same sizes.
        ``k``: the step's K (None: K). A uniform decode step (every request 1 + k tokens) is
        capturable, greedy or not."""
        k = self.num_speculative_tokens if k is None else k
        return self.planner.plan(sum(s.num_tokens for s in scheduled), len(scheduled),
                                 is_uniform_decode(scheduled, k), k)

    def prepare(self, scheduled: list[ScheduledRequest], plan: StepPlan) -> StepBatch:
        """Fill the step buffers for the plan's [Np] tokens and [Bp] requests.

        Padding tokens get id 0, position 0, slot -1. Padding request i >= B owns the next
        1 + K padding tokens (the last one owns the rest), is discarded, greedy, and reads
        the token table's trash row. ``cu_num_draft_tokens`` counts the tokens fed after
        each known token (drafts, then filler): the drafter's rejected counts cover both.
        """
        h, k, bs = self.buffers.host, self.num_speculative_tokens, self.block_size
        fed = np.zeros(plan.num_reqs_padded, dtype=np.int64)
        b, bp, np_ = len(scheduled), plan.num_reqs_padded, plan.num_tokens_padded
        qsl = h["query_start_loc"]
        qsl[0] = 0
        h["block_table"][:bp] = 0
        for i, s in enumerate(scheduled):
            r, start, n = s.request, s.request.num_computed_tokens, s.num_tokens
            lo, hi = qsl[i], qsl[i] + n
            d, f = len(s.spec_token_ids), s.num_filler
            if d or f:  # decode: the last known token, the drafts to verify, filler (token 0)
                h["input_ids"][lo:hi] = [r.token_ids[start]] + s.spec_token_ids + [0] * f
            else:
                h["input_ids"][lo:hi] = r.token_ids[start:start + n]
            pos = np.arange(start, start + n)  # key positions (a tree's node k: start + k)
            blocks = np.asarray(r.block_ids, dtype=np.int64)
            h["positions"][lo:hi] = pos
            h["slot_mapping"][lo:hi] = blocks[pos // bs] * bs + pos % bs
            if self.tree is not None:
                self._fill_tree(h, i, lo, hi, start, [-1, *r.spec_parents[:d]] + [0] * f
                                if d or f else None)
            qsl[i + 1] = hi
            h["seq_lens"][i] = start + n
            h["logits_indices"][i] = hi - 1 - d - f + np.minimum(np.arange(k + 1), d)
            h["draft_token_ids"][i, :d] = s.spec_token_ids
            h["draft_token_ids"][i, d:] = 0
            h["num_draft_tokens"][i] = d
            fed[i] = d + f
            h["block_table"][i, :len(blocks)] = blocks
            h["discard_mask"][i] = s.is_discarded
            h["rows"][i] = r.row
            h["temperature"][i] = r.params.temperature
            h["top_p"][i] = r.params.top_p
            h["rng_key"][i] = request_key(r.params.seed, self.seed, r.request_id)
            self._fill_processing(h, i, r)
        n = qsl[b]
        h["input_ids"][n:np_] = 0
        h["positions"][n:np_] = 0
        h["slot_mapping"][n:np_] = -1
        if self.tree is not None:
            self._fill_tree(h, slice(b, bp), n, np_, 0, None)
        if bp > b:  # padding tokens past the last request's end stay unowned otherwise
            qsl[b + 1:bp + 1] = np.minimum(n + (np.arange(b, bp) + 1 - b) * (1 + k), np_)
            qsl[bp] = np_
        h["seq_lens"][b:bp] = np.maximum(np.diff(qsl[b:bp + 1]), 1)
        h["logits_indices"][b:bp] = np_ - 1
        h["draft_token_ids"][b:bp] = 0
        h["num_draft_tokens"][b:bp] = 0
        h["discard_mask"][b:bp] = True
        h["rows"][b:bp] = self.max_num_seqs
        h["temperature"][b:bp] = 0.0
        h["top_p"][b:bp] = 1.0
        h["rng_key"][b:bp] = 0
        self._fill_processing(h, slice(b, bp), None)
        h["cu_num_draft_tokens"][:bp] = np.cumsum(fed)
        self.buffers.copy_to_device()
        max_seq_len = int(h["seq_lens"][:bp].max())
        if self.backend.dynamic:
            # an attention bound, not a length: 2 where it is 1 (dynamo specializes an int of
            # 1 -- a graph of its own for the steps of 1-token prompts)
            max_seq_len = min(max(max_seq_len, 2), self.max_model_len)
        bound = (self.max_model_len if plan.uniform_decode
                 else graph_seq_len(max_seq_len, self.max_model_len))
        rows = 1 + plan.num_spec_tokens
        if not self.drafts_on_device and self.backend.eager and self.tp.size == 1:
            rows = 1 + max(len(s.spec_token_ids) for s in scheduled)
        return StepBatch(plan, self.buffers.view(np_, bp), max_seq_len, bound,
                         int(np.diff(qsl[:bp + 1]).max()), self.graph_query_len(plan),
                         sampling_variant([s.request for s in scheduled], self.vocab_size), rows,
                         self.graph_num_rows(plan), self.query_split(scheduled, qsl, plan))

    def query_split(self, scheduled: list[ScheduledRequest], qsl: np.ndarray, plan: StepPlan
                    ) -> QuerySplit | None:
        """A step's leading decodes apart from the prefill chunks after them, for the torch
        attention of an uncaptured, uncompiled step on a CPU (one rank); None where there are
        not both, or elsewhere."""
        if (plan.capturable or self.backend.dynamic or self.tp.size > 1
                or self.device.type != "cpu"):
            return None
        head = next((i for i, s in enumerate(scheduled) if s.request.is_prefilling),
                    len(scheduled))
        if head == 0 or head == len(scheduled):
            return None
        return QuerySplit(head, int(qsl[head]), int(np.diff(qsl[:head + 1]).max()))

    def _fill_tree(self, h: dict, i: int | slice, lo: int, hi: int, start: int,
                   parents: list[int] | None) -> None:
        """Batch row(s) ``i``, tokens lo..hi-1: a decode's tree nodes, each node's parent
        given (``parents``, the root's -1 first; node k at depth d gets position start + d,
        its slot stays start + k's), or (None) plain causal tokens."""
        h["tree_parents"][i] = -1
        if parents is None:
            h["tree_node"][lo:hi], h["tree_depth"][lo:hi], h["tree_ancestors"][lo:hi] = 0, 0, 1
            return
        depth, ancestors = node_shapes(parents)
        h["tree_parents"][i, :len(parents)] = parents
        h["tree_node"][lo:hi] = np.arange(hi - lo)
        h["tree_depth"][lo:hi] = depth
        h["tree_ancestors"][lo:hi] = ancestors
        h["positions"][lo:hi] = start + np.asarray(depth)

    def _fill_processing(self, h: dict, i: int | slice, r) -> None:
        """The processed variant's inputs of batch row(s) ``i``: request ``r``'s, or None:
        the neutral values (padding rows)."""
        p = r.params if r is not None else None
        h["top_k"][i] = p.top_k if p else 0
        h["min_p"][i] = p.min_p if p else 0.0
        h["repetition_penalty"][i] = p.repetition_penalty if p else 1.0
        h["frequency_penalty"][i] = p.frequency_penalty if p else 0.0
        h["presence_penalty"][i] = p.presence_penalty if p else 0.0
        h["num_prompt"][i] = r.num_prompt_tokens if r is not None else 0
        h["min_len"][i] = r.num_prompt_tokens + p.min_tokens if p else 0
        h["stop_ids"][i] = -1
        if p and p.min_tokens:
            ids = p.min_tokens_stop_ids(self.eos_token_ids)
            h["stop_ids"][i, :len(ids)] = ids

    def extend_block_tables(self, grown: list[tuple[int, int, list[int]]]) -> None:
        """Blocks requests gained after their step was prepared, (batch index, first new
        column, block ids) each, into the device block table: one small copy, no host wait."""
        entries = [(i, col + j, block) for i, col, blocks in grown
                   for j, block in enumerate(blocks)]
        if not entries:
            return
        t = torch.tensor(entries, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        t = t.to(self.device, non_blocking=True)
        self.buffers.device["block_table"][t[:, 0], t[:, 1]] = t[:, 2].to(torch.int32)

    def advance_decode(self, batch: StepBatch, sampled: torch.Tensor,
                       drafts: torch.Tensor | None) -> StepBatch:
        """The next step of a uniform decode whose results the host has not read (async
        scheduling): the same requests, each feeding its last accepted token (``sampled``
        [B, 1 + K] int32, -1 past its accepted ones) and the K ``drafts`` [B, K] the
        drafter made for it, written into the step buffers on the device (no host read).
        Positions move on by each request's 1 + accepted; the host bounds by the most
        (1 + K). A draft tree's K drafts are its nodes (a dynamic tree's ``drafts`` [B, 2K]:
        then their parents), placed as ``_fill_tree`` places them."""
        x, plan = batch.inputs, batch.plan
        b, k, bs = plan.num_reqs, plan.num_spec_tokens, self.block_size
        n = b * (1 + k)
        valid = (sampled >= 0).sum(dim=1)  # 1 + accepted
        known = sampled.gather(1, (valid - 1)[:, None].long())
        start = x.positions[:n].view(b, 1 + k)[:, 0] + valid
        pos = start[:, None] + torch.arange(1 + k, device=start.device)
        if self.tree is not None:
            drafts = self._advance_tree(x, b, k, start, drafts)
        ids = known if drafts is None else torch.cat([known, drafts], dim=1)
        x.input_ids[:n].copy_(ids.flatten())
        blocks = x.block_table[:b].gather(1, (pos // bs).to(torch.int64))
        x.slot_mapping[:n].copy_((blocks * bs + pos % bs).flatten())
        if self.tree is None:
            x.positions[:n].copy_(pos.flatten())
        x.seq_lens[:b].copy_(start + 1 + k)
        if drafts is not None:
            x.draft_token_ids[:b, :k].copy_(drafts)
            x.num_draft_tokens[:b].fill_(k)
        return replace(batch, max_seq_len=min(batch.max_seq_len + 1 + k, self.max_model_len))

    def _advance_tree(self, x: StepInputs, b: int, k: int, start: torch.Tensor,
                      drafts: torch.Tensor) -> torch.Tensor:
        """``advance_decode``'s tree fields on the device: each node's parent (a static
        tree's, or the drafter's), depth, ancestors and position (``start`` [B] the roots')
        -> the drafts' tokens [B, K]."""
        device = drafts.device
        if isinstance(self.tree, DynamicTree):
            drafts, parents = drafts[:, :k], drafts[:, k:].long()
        else:
            parents = self.static_parents[None, 1:].expand(b, k)
        parents = torch.cat([parents.new_full((b, 1), -1), parents], dim=1)  # [B, 1 + K]
        depth = torch.zeros_like(parents)
        ancestors = torch.ones_like(parents)
        for node in range(1, k + 1):  # parents come first
            up = parents[:, node:node + 1]
            depth[:, node:node + 1] = depth.gather(1, up) + 1
            ancestors[:, node:node + 1] = ancestors.gather(1, up) | (1 << node)
        n = b * (1 + k)
        x.tree_parents[:b, :1 + k].copy_(parents)
        x.tree_depth[:n].copy_(depth.flatten())
        x.tree_ancestors[:n].copy_(ancestors.flatten())
        x.positions[:n].copy_((start[:, None] + depth).flatten())
        return drafts

    def graph_query_len(self, plan: StepPlan) -> int:
        """A captured step's bound on tokens per request: 1 + the step's K (uniform decode)
        or Np."""
        return 1 + plan.num_spec_tokens if plan.uniform_decode else plan.num_tokens_padded

    def graph_num_rows(self, plan: StepPlan) -> int:
        """A captured step's logits rows per request: 1 + the step's K (uniform decode) or
        1 + K (a mixed step: one graph per key whatever the step's K)."""
        return 1 + (plan.num_spec_tokens if plan.uniform_decode else self.num_speculative_tokens)

    def step_logprobs(self, scheduled: list[ScheduledRequest], sampled: list[list[int]]
                      ) -> dict[int, list]:
        """The log-probabilities the last step owes the requests that ask: batch index i ->
        TokenLogprobs of request i's valid sampled tokens (``params.logprobs``; ``sampled``:
        the step's rows read back). The prompt tokens its prefill chunk predicts
        (``params.prompt_logprobs``) are filed in ``r.prompt_logprobs`` here. One log-softmax
        over every row asked for, from ``last_logits`` / ``last_hidden``; nothing runs when no
        request asks."""
        # (row, token id, top N, batch index): rows of the step's final hidden states (prompt
        # positions) and of its logits [Bp * rows] (sampled positions)
        prompt, out = [], []
        qsl = self.buffers.host["query_start_loc"]
        width = len(sampled[0]) if sampled else 0
        for i, s in enumerate(scheduled):
            r, p = s.request, s.request.params
            if p.prompt_logprobs is not None and not s.spec_token_ids:
                start, done = r.num_computed_tokens, len(r.prompt_logprobs)
                for pos in range(max(start, done - 1),
                                 min(start + s.num_tokens, r.num_prompt_tokens - 1)):
                    prompt.append((int(qsl[i]) + pos - start, r.token_ids[pos + 1],
                                   p.prompt_logprobs, i))
            if p.logprobs is not None and not s.is_discarded:
                out += [(i * width + j, tok, p.logprobs, i)
                        for j, tok in enumerate(valid_tokens(sampled[i]))]
        if not prompt and not out:
            return {}
        parts = []
        if prompt:  # the prompt positions' logits: only those the requests asked for
            rows = torch.tensor([e[0] for e in prompt], device=self.device)
            parts.append(self.target.compute_logits(self.last_hidden[rows]))
        if out:
            logits = self.last_logits
            rows = torch.tensor([e[0] for e in out], device=self.device)
            if self.tree is not None:  # token j was drawn at the accepted path's node j
                path = torch.cat([torch.zeros_like(self.tree_path[:, :1]), self.tree_path], 1)
                rows = rows - rows % width + path[rows // width, rows % width]
            parts.append(logits.reshape(-1, logits.shape[-1])[rows])
        entries = prompt + out
        lps = token_logprobs(torch.cat(parts),
                             torch.tensor([e[1] for e in entries], device=self.device),
                             [e[2] for e in entries])
        for (_, _, _, i), lp in zip(prompt, lps):
            scheduled[i].request.prompt_logprobs.append(lp)
        result: dict[int, list] = {}
        for (_, _, _, i), lp in zip(out, lps[len(prompt):]):
            result.setdefault(i, []).append(lp)
        return result

    # ---- device side -----------------------------------------------------------------------
    def target_logits(self, x: StepInputs, max_seq_len: int, max_query_len: int,
                      num_rows: int, first: torch.Tensor,
                      query_split: QuerySplit | None = None):
        """Target forward over x's [Np] tokens (``first``: ``first_sampled_positions(x)``)
        -> (logits [Bp, num_rows, V] float32 of each request's first ``num_rows`` verified
        positions, hidden [Np, H], aux [Np, A, H] or None)."""
        fed = x.seq_lens - first  # drafts + filler after the known token
        tree = (None if self.tree is None else
                TreeMask(x.tree_node, x.tree_depth, x.tree_ancestors))
        attn = AttentionMetadata(x.slot_mapping, x.query_start_loc, x.seq_lens, x.block_table,
                                 max_seq_len, x.rows, fed.to(torch.int32), max_query_len, tree,
                                 query_split)
        hidden, aux = self.target(x.input_ids, x.positions, kv=self.kv.bind(attn),
                                  aux_layer_ids=self.aux_layer_ids)
        logits = self.target.compute_logits(hidden[x.logits_indices[:, :num_rows].flatten()])
        return logits.view(x.logits_indices.shape[0], num_rows, -1), hidden, aux

    def target_step(self, x: StepInputs, *, max_seq_len: int, max_query_len: int,
                    variant: str, num_rows: int, query_split: QuerySplit | None = None
                    ) -> tuple[torch.Tensor, ...]:
        """The target step, a static-shape step function of [Np] tokens, [Bp] requests:
        ``target_forward`` then ``verify``. -> (sampled [Bp, num_rows] int32, logits
        [Bp, num_rows, V] float32 (raw), hidden [Np, H][, aux [Np, A, H]])."""
        return forward_then_verify(self.target_forward, self.verify, x,
                                   max_seq_len=max_seq_len, max_query_len=max_query_len,
                                   variant=variant, num_rows=num_rows, query_split=query_split)

    def target_forward(self, x: StepInputs, *, max_seq_len: int, max_query_len: int,
                       num_rows: int, query_split: QuerySplit | None = None
                       ) -> tuple[torch.Tensor, ...]:
        """The target's forward (``target_logits``) -> (first [Bp] int64 (each request's
        first sampled position), logits, hidden[, aux])."""
        first = first_sampled_positions(x)
        logits, hidden, aux = self.target_logits(x, max_seq_len, max_query_len, num_rows, first,
                                                 query_split)
        return (first, logits, hidden) + ((aux,) if aux is not None else ())

    def verify(self, x: StepInputs, first: torch.Tensor, logits: torch.Tensor, *,
               variant: str, num_rows: int) -> torch.Tensor:
        """Verification (greedy, or rejection sampling with counter-based random numbers,
        with or without the top-p sort, or processed: min_tokens and the penalties at each
        row, then the min-p / top-k / top-p filters: ``variant``), token-table update, each row's
        linear-attention state slot moved to its last accepted token -> sampled [Bp,
        num_rows] int32. It reads nothing of [Np] size: compiled alone (compile_dynamic), its
        graphs depend on the requests, not on the tokens."""
        if self.tree is not None:
            return self.verify_tree(x, first, logits, variant=variant, num_rows=num_rows)
        drafts = x.draft_token_ids[:, :num_rows - 1]
        if variant == "greedy":
            sampled = greedy_verify(logits, drafts, x.num_draft_tokens)
        elif variant.startswith("processed"):  # each row counts the drafts before it
            logits = process_logits(logits.float(), drafts, self.token_table, x.rows, first,
                                    x.num_prompt, x.min_len, x.stop_ids,
                                    x.repetition_penalty, x.frequency_penalty,
                                    x.presence_penalty)
            sort = variant == "processed_sorted"  # else processed, processed_top<W>
            width = top_k_width(variant)
            sampled = rejection_sample(logits, drafts, x.num_draft_tokens, x.temperature,
                                       x.rng_key, first, x.top_p if sort else None,
                                       x.top_k if sort or width else None, x.min_p,
                                       width=width)
        else:
            sampled = rejection_sample(logits, drafts, x.num_draft_tokens,
                                       x.temperature, x.rng_key, first,
                                       x.top_p if variant == "top_p" else None)
        sampled = self._finish_sampled(sampled, x.discard_mask, x.rows, first)
        self.kv.accept(x.rows, sampled)
        return sampled

    def verify_tree(self, x: StepInputs, first: torch.Tensor, logits: torch.Tensor, *,
                    variant: str, num_rows: int) -> torch.Tensor:
        """``verify`` of a draft tree: each decode's rows are its tree's nodes (node 0 its
        last known token, nodes 1.. its drafts, ``x.tree_parents``), verified by
        ``tree_rejection_sample`` over the target's distribution at each node (temperature,
        then min-p / top-k / top-p: ``variant``; the penalties are refused with a tree;
        an all-greedy batch: ``tree_greedy_verify``, no random numbers). The
        accepted path's target K/V move to the positions after the root, the path stays in
        ``tree_path`` for the drafter -> sampled [Bp, num_rows] int32: the path's tokens, the
        token after it, then -1 (a chain's layout)."""
        # a host tree's step verifies at most num_rows - 1 drafts: no deeper path
        b, depth = logits.shape[0], min(self.tree.max_depth, num_rows - 1)
        live = (torch.arange(num_rows - 1, device=logits.device)[None]
                < x.num_draft_tokens[:, None])
        tokens = torch.cat([torch.zeros_like(x.draft_token_ids[:, :1]),
                            torch.where(live, x.draft_token_ids[:, :num_rows - 1], -1)], dim=1)
        parents = x.tree_parents[:, :num_rows]
        if variant == "greedy":
            verdict = tree_greedy_verify(logits, tokens, parents, depth)
        else:
            greedy = x.temperature < GREEDY_TEMPERATURE
            probs = logits.float()  # greedy rows: the sampler takes their argmax
            sort = variant in ("top_p", "processed_sorted")
            width = top_k_width(variant)
            processed = variant.startswith("processed")
            sampled_probs = target_probs(
                probs, torch.where(greedy, 1.0, x.temperature),
                x.top_p if sort else None, x.top_k if processed and (sort or width) else None,
                x.min_p if processed else None, width)
            probs = torch.where(greedy[:, None, None], probs, sampled_probs)
            verdict = tree_rejection_sample(probs, tokens, parents, x.temperature, x.rng_key,
                                            first, depth)
        sampled = torch.cat([verdict.tokens, verdict.tokens.new_full(
            (b, num_rows - depth - 1), -1)], dim=1)
        sampled = self._finish_sampled(sampled, x.discard_mask, x.rows, first)
        path = torch.where(x.discard_mask[:, None], -1, verdict.path)
        root = (first - 1)[:, None]  # the accepted node at depth j moves to root + j
        src = request_slots(x.block_table, root + path.clamp(min=0), self.block_size)
        # depths past max_model_len are never on the path: clamped, they read no block past
        # the table (a tree cut near max_model_len)
        dst = request_slots(x.block_table, (root + torch.arange(
            1, depth + 1, device=root.device)[None]).clamp(max=self.max_model_len - 1),
                            self.block_size)
        self.kv.move(src.flatten(), torch.where(path >= 0, dst, -1).flatten())
        # read by the drafter's chain view and by the step's log-probabilities
        self.tree_path[:b, :depth].copy_(path)
        self.tree_path[:b, depth:] = -1  # a host tree's step shallower than max_depth
        return sampled

    def chain_view(self, x: StepInputs) -> torch.Tensor:
        """[Np] int64: the step's tokens seen as a chain (the drafter's first pass): a
        decode's token j <= its accepted depth is its accepted path's node j (node 0 its
        root), every other token itself (past the path: rejected, as a chain's)."""
        num_tokens, depth = x.input_ids.shape[0], self.tree.max_depth
        b = x.query_start_loc.shape[0] - 1
        path = self.tree_path[:b]
        start = x.query_start_loc[:b, None].to(torch.int64)
        dst = start + torch.arange(1, depth + 1, device=path.device)[None]
        dst = torch.where(path >= 0, dst, num_tokens)  # past the end: dropped
        index = torch.arange(num_tokens + 1, device=path.device)
        index = index.scatter(0, dst.flatten(), (start + path).flatten())
        return index[:num_tokens]

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (sampled_token_ids [B, K+1] int32, -1 for discarded rows; drafts [B, K] int32);
        the step's logits [Bp, rows, V] and hidden [Np, H] stay in ``last_logits`` /
        ``last_hidden``."""
        x, plan = batch.inputs, batch.plan
        self.last_step_captured = plan.capturable
        out = self.target_graph.run(
            x, capturable=plan.capturable,
            bucket=(plan.num_tokens_padded, plan.num_reqs_padded),
            captured={"max_seq_len": batch.graph_seq_len, "max_query_len": batch.graph_query_len,
                      "num_rows": batch.graph_num_rows},
            own={"max_seq_len": batch.max_seq_len, "max_query_len": batch.max_query_len,
                 "num_rows": batch.num_rows}
            | ({} if batch.query_split is None else {"query_split": batch.query_split}),
            variant=batch.variant)
        sampled, hidden, aux = out[0], out[2], out[3] if len(out) > 3 else None
        # the step's raw logits and final hidden states, for the requests that ask for
        # log-probabilities (``LLM``, after the step's host read; a captured step's static
        # outputs: read before the next step)
        self.last_logits, self.last_hidden = out[1], hidden
        self.last_draft_seconds = 0.0
        b = plan.num_reqs
        if not self.drafts_on_device:
            return sampled[:b], None
        start = time.perf_counter()
        ids, positions = x.input_ids, x.positions
        if self.tree is not None:  # the drafter reads the accepted path as a chain
            chain = self.chain_view(x)
            ids, positions, hidden = ids[chain], positions[chain], hidden[chain]
            aux = None if aux is None else aux[chain]
        drafts = self.proposer.propose(DraftInputs(
            plan=plan, input_ids=ids, positions=positions, hidden_states=hidden,
            aux_hidden_states=aux,
            attn=AttentionMetadata(x.slot_mapping, x.query_start_loc, x.seq_lens,
                                   x.block_table, batch.max_seq_len,
                                   max_query_len=batch.max_query_len,
                                   query_split=batch.query_split),
            graph_seq_len=batch.graph_seq_len, graph_query_len=batch.graph_query_len,
            sampled_token_ids=sampled, discard_mask=x.discard_mask,
            cu_num_draft_tokens=x.cu_num_draft_tokens, token_table=self.token_table,
            rows=x.rows, temperature=x.temperature))
        # host wall time of the drafter call (on CPU the work itself; on an accelerator the
        # launch time only: timing the device would need a sync)
        self.last_draft_seconds = time.perf_counter() - start
        return sampled[:b], drafts[:b]

    def _finish_sampled(self, sampled, discard_mask, rows, first):
        """-1 for discarded rows; append the valid sampled tokens to the device token table
        (no host round trip). sampled[r, j] is the token at position first[r] + j."""
        sampled = torch.where(discard_mask[:, None], -1, sampled)
        width = self.token_table.shape[1]
        cols = (first[:, None] + torch.arange(sampled.shape[1], device=sampled.device))
        cols = cols.clamp_(max=width - 1)
        rows = rows[:, None].expand_as(cols)
        old = self.token_table[rows, cols]
        self.token_table[rows, cols] = torch.where(sampled >= 0, sampled, old)
        return sampled

    # ---- tensor parallelism: the driver's steps on its TP peers ------------------------------
    def send_step(self, batch: StepBatch) -> None:
        """Driver: the prepared step's host buffers to the TP peers (no-op without TP)."""
        self.broadcast.send(STEP, batch.plan, (batch.max_seq_len, batch.graph_seq_len,
                                               batch.max_query_len), batch.variant)

    def send_dummy(self, plan: StepPlan) -> None:
        self.broadcast.send(DUMMY, plan)

    def send_stop(self) -> None:
        self.broadcast.send(STOP)

    def serve(self, guard=None) -> list[list[tuple[str, tuple[int, ...]]]]:
        """TP peer: run the driver's steps until it sends STOP; -> the collectives of each
        step (the last entry: the STOP's). ``guard()``: a context manager around each
        execute (the engine's host-sync check)."""
        logs = []
        while True:
            start = len(self.dp.collectives)
            kind, plan, lens, variant = self.broadcast.receive()
            if kind == DUMMY:
                self.dummy_run(plan)
            elif kind == STEP:
                batch = StepBatch(plan, self.buffers.view(plan.num_tokens_padded,
                                                          plan.num_reqs_padded),
                                  *lens, self.graph_query_len(plan), variant,
                                  1 + plan.num_spec_tokens,  # TP: every row
                                  self.graph_num_rows(plan))
                if guard is None:
                    self.execute(batch)
                else:
                    with guard():
                        self.execute(batch)
            logs.append(self.dp.collectives[start:])
            if kind == STOP:
                return logs

    @torch.inference_mode()
    def dummy_run(self, plan: StepPlan) -> None:
        """An idle DP rank's step: the same forwards (so the same collectives) as a busy rank."""
        n = plan.num_tokens_padded
        attn = AttentionMetadata.dummy(n, self.device)
        zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
        self.target(zeros, zeros, kv=self.kv.bind(attn), aux_layer_ids=self.aux_layer_ids)
        if self.drafts_on_device:
            self.proposer.dummy_run(plan)

