"""The proposer bases: the one drafter interface, padded preparation, the draft step of a model.

``Proposer`` is the interface the engine core calls for every method, at the same points:
``propose`` / ``dummy_run`` in the step (device drafters; a host drafter's ``drafts_on_device``
is False and the runner runs the target step alone), then on the host ``on_prefill_done``,
``next_drafts`` (the drafts the next step verifies: the device's, or a host drafter's search
over the request's tokens) and ``on_finish``.

``PaddedProposer`` is what every device proposer shares: its sizes, the device-side padded
preparation (next token, valid count, backup token, sample index, num rejected; the formulas
live in `specdec.kernels`) and the ragged host reference. Every proposer is sized by the step's
``StepPlan`` (``DraftInputs.plan``), planned once by the runner with the step's one DP
all-reduce: that plan is the one batch-padding + DP hook, in ``propose`` and ``dummy_run``.

``HeadProposer`` (MTP, EAGLE, EAGLE-3, and the separate draft model) owns the draft model, its
KV pages and one static-shape *padded step* per step: for Np tokens and Bp requests,

    prep  = next tokens, valid counts, backups, sample indices, num_rejected   (no sync)
    ids   = target_ids shifted left by one, each request's next token at its sample index
    first pass of the head over the target's layout -> draft 1 from the logits at the samples
    draft loop: seq_lens -= num_rejected (once), then K-1 steps of one token per row

K is the step's (``StepPlan.num_spec_tokens``: a K schedule picks it per step; a static value
of the step graph, so each K has its own graphs). K = 0 still runs the first pass: the head's
KV then has every token, so drafting can resume at any later step. A draft tree
(``speculative_token_tree``, or ``tree_topk`` + ``num_draft_tokens``) replaces the loop with
``padded_tree``: one head forward per depth over that depth's nodes, under a tree mask.

Graph mode is a wrapper around that one function (`specdec.graphs.StepGraph`, whose ``run``
picks for each step, as for the runner's target step): a capturable step (``plan.capturable``:
a uniform decode, or a mixed step where the backend captures those) runs it through the
configured backend -- torch.compile / torchair, or a CUDA graph per (Np, Bp, attention bound)
key -- every other padded step runs the same function eagerly (with ``compile_dynamic``, every
padded step runs it compiled, with its own bounds, in two graphs: ``padded_first`` and
``padded_loop``). The ragged path reuses the first pass and the draft loop.
"""

import functools
from pathlib import Path

import torch

from specdec.attention import AttentionMetadata, KVCache
from specdec.checks import check_int
from specdec.config import SpeculativeConfig
from specdec.draft_tree import DynamicTree, StaticTree, check_score_temperature
from specdec.graphs import EAGER, Backend, StepGraph, compile_dynamic
from specdec.kernels import (
    DraftStep,
    PaddedPrep,
    advance_draft_step,
    gather_backup_tokens,
    prepare_padded_step,
    request_slots,
    shift_first_pass_input_ids,
)
from specdec.kernels.paged_attention_torch import QuerySplit, TreeMask
from specdec.kernels.ragged import (
    RaggedInputs,
    next_token_ids_ragged,
    prepare_inputs_ragged,
    valid_counts_ragged,
)
from specdec.models.heads import load_head
from specdec.padding import StepPlan, StepSizes
from specdec.proposers.head_folder import find_head_dir
from specdec.proposers.inputs import DraftInputs, PaddedStepInputs


class Proposer:
    """The drafter interface of every method (above). Host-side hooks default to nothing."""

    drafts_on_device = True  # False: drafts from the request's tokens, on the host
    # its padded drafts can feed the next step on the device (async scheduling)
    feeds_next_step = False
    tensor_parallel = True  # runs under tensor parallelism (its model replicated or sharded)
    # prefix caching: tokens past a cached KV block that the drafter's KV in it depends on
    cache_lookahead = 0
    reads_prompt_states = False  # it needs the target's states at every prompt position

    @classmethod
    def head_folder(cls, spec: SpeculativeConfig, model_dir: Path | None) -> Path | None:
        """The folder of the draft model this method runs (``model_dir``: the target's);
        None: it runs none."""
        return None

    @classmethod
    def load_head(cls, spec: SpeculativeConfig, target, path: Path | None, *,
                  dtype: torch.dtype, device: torch.device, tokenizer=None):
        """The draft model in ``path`` (``head_folder``'s); None: this method runs none."""
        return None

    @classmethod
    def build(cls, spec: SpeculativeConfig, target, head, sizes: StepSizes, *,
              block_size: int, num_kv_blocks: int, dtype: torch.dtype, device: torch.device,
              backend: Backend) -> "Proposer":
        """The proposer of ``spec`` over ``head`` (``load_head``'s, or the caller's), sized by
        ``sizes`` (its rows: the largest padded request count)."""
        raise NotImplementedError

    def propose(self, x: DraftInputs) -> torch.Tensor:
        """Draft tokens [>= B, K] int32 for the step (rows past B are padding)."""
        raise NotImplementedError

    def dummy_run(self, plan: StepPlan) -> None:
        """An idle DP rank's drafter call: the same forwards (so collectives) as propose()."""
        raise NotImplementedError

    def on_prefill_done(self, request) -> None:
        """After the step in which ``request`` finished its prefill."""

    def next_drafts(self, request, drafted: list[int], k: int) -> list[int]:
        """The drafts the next step verifies for a running ``request``, at most ``k``:
        ``drafted``, the ones this step's ``propose`` made for it (read back with the step)."""
        return list(drafted)

    def on_finish(self, request, keep: bool = True) -> None:
        """``request`` ended (any reason); ``keep`` False: a warm-up request, keep nothing."""


class HostProposer(Proposer):
    """A drafter without a device step (ngram, suffix): ``drafts(request_id, token_ids, k)``
    searches the request's tokens on the host after each step's read."""

    drafts_on_device = False

    def __init__(self, config: SpeculativeConfig, *, max_model_len: int):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_model_len = max_model_len

    @classmethod
    def build(cls, spec: SpeculativeConfig, target, head, sizes: StepSizes,
              **device_parts) -> "HostProposer":
        """Only the sizes matter: no draft model, no device state."""
        return cls(spec, max_model_len=sizes.max_model_len)

    def next_drafts(self, request, drafted: list[int], k: int) -> list[int]:
        return self.drafts(request.request_id, request.token_ids, k)

    def drafts(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """At most ``k`` drafts for the request with these tokens (0: none, no search); a
        ``HostTree``'s drafts, then their parents."""
        raise NotImplementedError


class PaddedProposer(Proposer):
    """Sizes and the acceptance-dependent preparation shared by every device proposer."""

    def __init__(self, config: SpeculativeConfig, *, max_num_seqs: int, block_size: int,
                 max_model_len: int, vocab_size: int, device: torch.device | str = "cpu"):
        sizes = dict(max_num_seqs=max_num_seqs, block_size=block_size,
                     max_model_len=max_model_len, vocab_size=vocab_size)
        for name, value in sizes.items():  # a proposer is usable without the engine
            check_int(name, value, lo=1)
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_num_seqs = max_num_seqs  # the largest padded request count of a step
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        # the padded prep's outputs: fixed addresses, sliced to [Bp] (a captured step reuses them)
        self.prep = PaddedPrep.empty(max_num_seqs, self.device)

    def prepare_padded(self, sampled_token_ids: torch.Tensor, discard_mask: torch.Tensor,
                       cu_num_draft_tokens: torch.Tensor, query_start_loc: torch.Tensor,
                       token_table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded mode, all on the device, one launch. sampled_token_ids [B, K+1] int32,
        discard_mask [B] bool, cu_num_draft_tokens [B] int32, query_start_loc [B+1] int32,
        token_table [R, L] int32, rows [B] int, seq_lens [B] int32 (the target step's).
        -> (next_token_ids, valid_count, token_indices_to_sample, num_rejected), [B] int32
        views of the proposer's prep buffers."""
        b = sampled_token_ids.shape[0]
        out = prepare_padded_step(sampled_token_ids, discard_mask, token_table, rows, seq_lens,
                                  cu_num_draft_tokens, query_start_loc, self.vocab_size,
                                  out=PaddedPrep(*(t[:b] for t in self.prep)))
        return out.next_token_ids, out.valid_count, out.token_indices_to_sample, out.num_rejected

    def prepare_ragged(self, sampled: list[list[int]], discard: list[bool], backup: list[int],
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       num_draft_tokens: list[int]) -> tuple[list[int], RaggedInputs]:
        """Ragged mode (disable_padded_drafter_batch=True): host lists and CPU tensors in,
        (next token ids, the kept-token layout) out. Syncs by design."""
        next_ids = next_token_ids_ragged(sampled, discard, backup, self.vocab_size)
        valid = valid_counts_ragged(sampled, discard, self.vocab_size)
        return next_ids, prepare_inputs_ragged(query_start_loc, seq_lens, num_draft_tokens, valid)

class HeadProposer(PaddedProposer):
    """MTP / EAGLE / EAGLE-3 (and the draft model): a draft model run once over the target's
    layout, then K-1 times."""

    feeds_next_step = True
    # the head's KV at position p is computed from the target's state at p and token p + 1
    cache_lookahead = 1

    @classmethod
    def head_folder(cls, spec: SpeculativeConfig, model_dir: Path | None) -> Path:
        return find_head_dir(spec, model_dir)

    @classmethod
    def load_head(cls, spec: SpeculativeConfig, target, path: Path, *, dtype: torch.dtype,
                  device: torch.device, tokenizer=None):
        return load_head(path, target, dtype=dtype, device=device,
                         aux_layer_ids=spec.aux_layer_ids_configured)

    @classmethod
    def build(cls, spec: SpeculativeConfig, target, head, sizes: StepSizes, *,
              block_size: int, num_kv_blocks: int, dtype: torch.dtype, device: torch.device,
              backend: Backend) -> "HeadProposer":
        return cls(spec, head=head, num_kv_blocks=num_kv_blocks, dtype=dtype, backend=backend,
                   max_num_seqs=sizes.max_num_reqs, block_size=block_size,
                   max_model_len=sizes.max_model_len, vocab_size=target.config.vocab_size,
                   device=device)

    def __init__(self, config: SpeculativeConfig, *, head, num_kv_blocks: int,
                 dtype: torch.dtype, backend: Backend = EAGER, **sizes):
        super().__init__(config, **sizes)
        self.head = head
        # a synthetic head's set acceptance (models/synthetic.DraftProfile); None: its drafts
        self.draft_profile = getattr(head, "draft_profile", None)
        # a StaticTree or DynamicTree: ``padded_tree`` drafts it; None: chains
        self.tree = config.tree
        if self.tree is not None and self.draft_profile is not None:
            raise ValueError("speculative_token_tree with a synthetic head's draft "
                             "acceptance profile (it sets a chain's rates); allowed: one")
        if isinstance(self.tree, DynamicTree):
            # the temperature the tree's candidates are scored at (DynamicTree's docstring)
            t = self.tree.score_temperature
            self.score_temperature = (
                t if t is not None else check_score_temperature(
                    head.config.extra.get("tree_score_temperature", 1.0),
                    "the head's config.json tree_score_temperature"))
            # each candidate's depth (c_1: the root's k, then k x k per depth), the tie-break
            # of the drafts' choice
            k, depth = self.tree.top_k, self.tree.max_depth
            self.candidate_depth = torch.cat([torch.zeros(k, device=self.device)] + [
                torch.full((k * k,), float(d), device=self.device) for d in range(1, depth)])
        if isinstance(self.tree, StaticTree):
            self.head_ancestors = torch.tensor(self.tree.head_ancestors, device=self.device)
            self.tree_levels = self.tree.levels()
        self.kv = KVCache(head.kv_cache_spec(), num_kv_blocks, self.block_size, dtype,
                          self.device)
        self.hidden_size = head.config.hidden_size

        def buf(dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(self.max_num_seqs, dtype=dtype, device=self.device)

        # draft-loop state, one row per request (rows >= B are padding)
        self.positions = buf(torch.int64)
        self.input_positions = buf(torch.int64)
        self.seq_lens = buf(torch.int32)
        self.slot_mapping = buf(torch.int64)
        self.loop_rows = 0  # rows the draft loop runs, set by start_draft_loop
        in_parts = None
        if backend.dynamic:
            # the first pass is traced once per row layout of the target's tokens, the loop
            # once per row count and K (its shapes are the requests'), not both per both
            first = compile_dynamic(self.padded_first, backend.compile_backend)
            loop = compile_dynamic(self.padded_loop, backend.compile_backend)

            def in_parts(x: PaddedStepInputs, *, max_seq_len: int, max_query_len: int | None,
                         loop_seq_len: int, num_drafts: int) -> torch.Tensor:
                return loop(x, *first(x, max_seq_len=max_seq_len, max_query_len=max_query_len,
                                      num_drafts=num_drafts),
                            loop_seq_len=loop_seq_len, num_drafts=num_drafts)
        self.step_graph = StepGraph(self.padded_step, backend, inputs_type=PaddedStepInputs,
                                    compiled_in_parts=in_parts)

    # ---- the per-method hooks ---------------------------------------------------------------
    def draft_features(self, x: DraftInputs) -> torch.Tensor:
        """[Np, ...] the target states the first pass reads: its final hidden states."""
        return x.hidden_states

    def first_pass_hidden(self, features: torch.Tensor) -> torch.Tensor:
        """[Np, H] hidden states fed with the first pass, from draft_features' output."""
        return features

    def sample(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [rows] int32 in the target vocabulary."""
        ids = self.head.compute_logits(logits_hidden).argmax(dim=-1)
        return self.head.draft_to_target_ids(ids).to(torch.int32)

    # ---- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, x: DraftInputs) -> torch.Tensor:
        """Draft tokens [Bp, K] (padded) or [B, K] (ragged) int32 for one step."""
        drafts = self._propose(x)
        return drafts if self.draft_profile is None else self.draft_profile.apply(drafts)

    def _propose(self, x: DraftInputs) -> torch.Tensor:
        if not self.config.is_padded:
            if x.plan.num_reqs == 0:  # an all-padding step (a captured target's warm-up)
                return x.sampled_token_ids.new_zeros((0, x.plan.num_spec_tokens))
            return self._propose_ragged(x)
        plan, a = x.plan, x.attn
        inputs = PaddedStepInputs(
            x.input_ids, x.positions, self.draft_features(x), a.slot_mapping, a.query_start_loc,
            a.seq_lens, a.block_table, x.sampled_token_ids, x.discard_mask,
            x.cu_num_draft_tokens, x.token_table, x.rows,
            torch.full((), plan.num_reqs, dtype=torch.int32, device=self.device),
            x.temperature)
        return self.step_graph.run(
            inputs, capturable=plan.capturable,
            bucket=(plan.num_tokens_padded, plan.num_reqs_padded),
            captured=self.step_bounds(x.graph_seq_len, x.graph_query_len),
            own=self.step_bounds(a.max_seq_len, a.max_query_len)
            | ({} if a.query_split is None else {"query_split": a.query_split}),
            num_drafts=plan.num_spec_tokens)

    def step_bounds(self, max_seq_len: int, max_query_len: int | None) -> dict:
        """The padded step's host bounds (its static values) from the first pass's."""
        return {"max_seq_len": max_seq_len, "max_query_len": max_query_len,
                "loop_seq_len": self.loop_seq_len(max_seq_len)}

    def loop_seq_len(self, max_seq_len: int) -> int:
        """The host bound on seq_lens over draft steps 2..K, given the first pass's bound
        (one bound for the whole loop: inside a dynamic-shape step a per-step min against
        max_model_len would be a guard, and a recompile when sequences near the end): the
        K - 1 rows a chain writes after the root's, a tree's ``head_rows``."""
        rows = self.num_speculative_tokens - 1 if self.tree is None else self.tree.head_rows
        return min(max_seq_len + rows, self.max_model_len)

    def padded_step(self, x: PaddedStepInputs, *, max_seq_len: int, max_query_len: int | None,
                    loop_seq_len: int, num_drafts: int,
                    query_split: QuerySplit | None = None) -> torch.Tensor:
        """The whole padded draft step, a static-shape step function -> drafts [Bp,
        num_drafts] int32.

        Every shape depends on (Np, Bp) and the host values only (max_seq_len, max_query_len,
        query_split: the first pass's, as the target's; loop_seq_len: steps 2..K's; num_drafts:
        the step's K); nothing here reads a value on the host.
        Padding rows (>= B) sample at the last token, a padding token whenever Bp > B.
        ``padded_first`` over the target's Np tokens, then ``padded_loop`` over the Bp rows.
        """
        return self.padded_loop(x, *self.padded_first(
            x, max_seq_len=max_seq_len, max_query_len=max_query_len, num_drafts=num_drafts,
            query_split=query_split), loop_seq_len=loop_seq_len, num_drafts=num_drafts)

    def padded_first(self, x: PaddedStepInputs, *, max_seq_len: int, max_query_len: int | None,
                     num_drafts: int, query_split: QuerySplit | None = None
                     ) -> tuple[torch.Tensor, ...]:
        """The padded step's layout and first pass -> (draft 1 [Bp] int32, the head's output
        at the sample index [Bp, H], positions there [Bp] int64, num_rejected [Bp]); () for
        ``num_drafts`` 0 (the head's KV still gets the step's tokens)."""
        next_ids, sample_idx, num_rejected, attn = self.padded_layout(x, max_seq_len,
                                                                      max_query_len, query_split)
        if num_drafts == 0:
            self.head_pass(x.target_ids, x.positions, x.features, attn, sample_idx, next_ids)
            return ()
        if self.tree is not None:  # the tree ranks the head's logits at the sample index
            logits_h, next_h = self.head_pass(x.target_ids, x.positions, x.features, attn,
                                              sample_idx, next_ids)
            return (logits_h[sample_idx], next_h[sample_idx], x.positions[sample_idx],
                    num_rejected)
        token, hidden = self.first_pass(x.target_ids, x.positions, x.features, attn, sample_idx,
                                        next_ids)
        return token, hidden, x.positions[sample_idx], num_rejected

    def padded_loop(self, x: PaddedStepInputs, token: torch.Tensor | None = None,
                    hidden: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                    num_rejected: torch.Tensor | None = None, *, loop_seq_len: int,
                    num_drafts: int) -> torch.Tensor:
        """Drafts 2..``num_drafts`` from ``padded_first``'s outputs -> every draft [Bp,
        num_drafts] int32 (a tree: ``padded_tree``, ``token`` the logits' hidden states)."""
        if num_drafts == 0:
            return x.sampled.new_zeros((x.sampled.shape[0], 0))
        if self.tree is not None:
            return self.padded_tree(token, hidden, positions, x.num_reqs, x.block_table,
                                    loop_seq_len, x.temperature)
        drafts = [token] + self.draft_loop_steps(
            token, hidden, positions, x.seq_lens, num_rejected, x.num_reqs, x.block_table,
            loop_seq_len, num_drafts - 1)
        return torch.stack(drafts, dim=1)

    def padded_layout(self, x: PaddedStepInputs, max_seq_len: int, max_query_len: int | None,
                      query_split: QuerySplit | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The padded step's preparation over the target's layout (no host read) -> (next
        token ids [Bp] int32, sample indices [Bp] int64 (padding rows: the last token),
        num_rejected [Bp], the attention metadata of the target's Np tokens)."""
        n, bp = x.target_ids.shape[0], x.sampled.shape[0]
        next_ids, _, sample_idx, num_rejected = self.prepare_padded(
            x.sampled, x.discard, x.cu_num_draft_tokens, x.query_start_loc, x.token_table,
            x.rows, x.seq_lens)
        real = torch.arange(bp, device=x.sampled.device) < x.num_reqs
        sample_idx = torch.where(real, sample_idx, n - 1).to(torch.int64)
        attn = AttentionMetadata(x.slot_mapping, x.query_start_loc, x.seq_lens, x.block_table,
                                 max_seq_len, max_query_len=max_query_len,
                                 query_split=query_split)
        return next_ids, sample_idx, num_rejected, attn

    def first_pass(self, target_ids: torch.Tensor, positions: torch.Tensor,
                   features: torch.Tensor, attn: AttentionMetadata, sample_idx: torch.Tensor,
                   next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's first pass over N tokens (padded: the target's layout; ragged: the kept
        tokens, padded to Np) and draft 1. target_ids, positions [N] int64; features [N, ...]
        (draft_features); attn over the N tokens; sample_idx [S] int64, each request's sample
        index (its last kept token); next_ids [S] int32, the next token placed there.
        -> (draft 1 [S] int32, the head's output at sample_idx [S, H])."""
        logits_h, next_h = self.head_pass(target_ids, positions, features, attn, sample_idx,
                                          next_ids)
        return self.sample(logits_h[sample_idx]), next_h[sample_idx]

    def head_pass(self, target_ids: torch.Tensor, positions: torch.Tensor,
                  features: torch.Tensor, attn: AttentionMetadata, sample_idx: torch.Tensor,
                  next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first pass's head forward (its KV writes included; first_pass's arguments)
        -> the head's (logits hidden, next hidden), [N, H] each."""
        ids = shift_first_pass_input_ids(target_ids, sample_idx, next_ids)
        return self.head(ids, positions, self.first_pass_hidden(features),
                         kv=self.kv.bind(attn))

    def _propose_ragged(self, x: DraftInputs) -> torch.Tensor:
        """disable_padded_drafter_batch=True: read the acceptance on the host (a sync by
        design), drop the rejected drafts, rebuild the layout; the first pass is padded back
        to the plan's Np tokens and the loop runs the plan's Bp rows (same DP shapes)."""
        b, bp, n = x.plan.num_reqs, x.plan.num_reqs_padded, x.plan.num_tokens_padded
        next_ids, keep, sample_idx, attn = self.ragged_layout(x)
        kept_positions = x.positions[keep]
        args = (_pad_rows(x.input_ids[keep], n), _pad_rows(kept_positions, n),
                _pad_rows(self.draft_features(x)[keep], n), attn, sample_idx, next_ids)
        if x.plan.num_spec_tokens == 0:  # the head's KV still gets the kept tokens
            self.head_pass(*args)
            return next_ids.new_zeros((b, 0))
        token, hidden = self.first_pass(*args)
        drafts = [token] + self.draft_loop_steps(
            _pad_rows(token, bp), _pad_rows(hidden, bp), kept_positions[sample_idx],
            attn.seq_lens, None, b, x.attn.block_table, self.loop_seq_len(x.attn.max_seq_len),
            x.plan.num_spec_tokens - 1)
        return torch.stack([d[:b] for d in drafts], dim=1)

    def ragged_layout(self, x: DraftInputs
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The ragged path's preparation: read the acceptance on the host (a sync by design)
        and keep the accepted tokens -> (next token ids [B] int32, kept token indices [kept],
        sample indices [B] int64 into the kept tokens, the attention metadata of the kept
        tokens padded to the plan's Np with slot -1)."""
        b, n, dev, a = x.plan.num_reqs, x.plan.num_tokens_padded, self.device, x.attn
        backup = gather_backup_tokens(x.token_table, x.rows[:b], a.seq_lens[:b])
        cu = x.cu_num_draft_tokens[:b].tolist()
        next_ids, r = self.prepare_ragged(
            x.sampled_token_ids[:b].tolist(), x.discard_mask[:b].tolist(), backup.tolist(),
            a.query_start_loc[:b + 1].cpu(), a.seq_lens[:b].cpu(),
            [c - p for c, p in zip(cu, [0] + cu)])
        keep = r.token_indices.to(dev)
        slots = torch.cat([a.slot_mapping[keep],
                           a.slot_mapping.new_full((n - keep.shape[0],), -1)])
        # (a request keeps at most its tokens: the target's bound holds)
        attn = AttentionMetadata(slots, r.new_query_start_loc.to(dev), r.new_seq_lens.to(dev),
                                 a.block_table[:b], a.max_seq_len,
                                 max_query_len=a.max_query_len)
        return (torch.tensor(next_ids, dtype=torch.int32).to(dev), keep,
                r.sample_indices.to(dev, torch.int64), attn)

    # ---- the draft loop -----------------------------------------------------------------------
    def start_draft_loop(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                         num_rejected: torch.Tensor | None, batch_size_padded: int) -> None:
        """Load the loop state before step 2. positions [b] int64: each request's position
        at its sample index; seq_lens [b] int32: the target step's seq_lens (padded mode,
        with num_rejected [b]) or the ragged new_seq_lens (num_rejected None). This is the
        one place where `seq_lens -= num_rejected` happens. Rows b..batch_size_padded-1
        become padding."""
        b = positions.shape[0]
        if not b <= batch_size_padded <= self.max_num_seqs:
            raise ValueError(f"batch_size_padded={batch_size_padded} must be in "
                             f"[{b}, max_num_seqs={self.max_num_seqs}]")
        self.positions[:b] = positions
        self.positions[b:batch_size_padded] = 0
        self.seq_lens[:b] = seq_lens if num_rejected is None else seq_lens - num_rejected
        self.seq_lens[b:batch_size_padded] = 1
        self.loop_rows = batch_size_padded

    def advance_step(self, num_reqs: int | torch.Tensor, block_table: torch.Tensor) -> DraftStep:
        """One draft-loop step over the rows set by start_draft_loop; updates the
        buffers in place and returns views of them. block_table [>= rows, M] int32."""
        rows = self.loop_rows
        if rows == 0:
            raise RuntimeError("advance_step() before start_draft_loop()")
        step = advance_draft_step(self.positions[:rows], self.seq_lens[:rows], block_table[:rows],
                                  num_reqs, self.block_size, self.max_model_len)
        self.positions[:rows] = step.positions
        self.input_positions[:rows] = step.input_positions
        self.slot_mapping[:rows] = step.slot_mapping
        self.seq_lens[:rows] = step.seq_lens
        return DraftStep(self.positions[:rows], self.input_positions[:rows],
                         self.slot_mapping[:rows], self.seq_lens[:rows])

    def draft_loop_steps(self, tokens: torch.Tensor, hidden: torch.Tensor | None,
                         positions: torch.Tensor, seq_lens: torch.Tensor,
                         num_rejected: torch.Tensor | None, num_reqs: int | torch.Tensor,
                         block_table: torch.Tensor, loop_seq_len: int,
                         num_steps: int) -> list[torch.Tensor]:
        """``num_steps`` draft steps (a head's 2..K) over Bp rows (B real, the rest padding),
        one token each.

        tokens [Bp] int32 (draft 1), hidden [Bp, H] (the head's output at the sample index;
        None for a head that reads none), positions [b] int64 and seq_lens [b] int32 at the
        sample index, b <= Bp (num_rejected [b] in padded mode, None when seq_lens are already
        the ragged ones), block_table [b, M], loop_seq_len: bound on seq_lens in every step
        (``loop_seq_len``). Returns ``num_steps`` tensors [Bp] int32.
        """
        bp = tokens.shape[0]
        self.start_draft_loop(positions, seq_lens, num_rejected, bp)
        block_table = _pad_rows(block_table, bp)
        qsl = torch.arange(bp + 1, dtype=torch.int32, device=tokens.device)
        drafts = []
        for _ in range(num_steps):
            st = self.advance_step(num_reqs, block_table)
            meta = AttentionMetadata(st.slot_mapping, qsl, st.seq_lens, block_table,
                                     loop_seq_len)
            logits_h, hidden = self.head(tokens, st.input_positions, hidden,
                                         kv=self.kv.bind(meta))
            tokens = self.sample(logits_h)
            drafts.append(tokens)
        return drafts

    # ---- a draft tree -------------------------------------------------------------------------
    def padded_tree(self, logits_hidden: torch.Tensor, hidden: torch.Tensor,
                    positions: torch.Tensor, num_reqs: int | torch.Tensor,
                    block_table: torch.Tensor, loop_seq_len: int,
                    temperature: torch.Tensor) -> torch.Tensor:
        """A tree's drafts from the first pass's outputs at each request's sample index
        (logits_hidden, hidden [Bp, H]; positions [Bp] int64 there: the root's head row p;
        temperature [Bp] float32, each request's sampling temperature) -> [Bp, nodes - 1]
        int32 in node order (a dynamic tree: then each one's parent node, [Bp, 2 * (nodes -
        1)]). What ``tree_root`` takes: a draft model passes its next token ids [Bp] and None,
        and its root's forward runs there.

        A node's children are the top ranks of the head's logits at it: the root's from the
        first pass, a depth-d node's from one head forward over depth d's nodes of every
        request (``_tree_level``). A request past max_model_len there, or a padding row,
        writes nothing and drafts junk the scheduler never verifies."""
        p = positions.to(torch.int64)[:, None]
        rows = torch.arange(p.shape[0], device=p.device)
        level = functools.partial(self._tree_level, p=p, rows=rows, num_reqs=num_reqs,
                                  block_table=block_table, loop_seq_len=loop_seq_len)
        logits_hidden, hidden = self.tree_root(logits_hidden, hidden, level)
        if isinstance(self.tree, DynamicTree):
            return self._dynamic_tree(logits_hidden, hidden, level, temperature)
        return self._static_tree(logits_hidden, hidden, level)

    def tree_root(self, logits_hidden: torch.Tensor, hidden: torch.Tensor, level
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The root's outputs [Bp, H] each, the tree's first ranks: a head's are its first
        pass's at the sample index (head row 0, written there)."""
        return logits_hidden, hidden

    def _static_tree(self, logits_hidden, hidden, level) -> torch.Tensor:
        """``padded_tree`` of a ``StaticTree``: node k is rank ``t.rank[k]`` of its parent's
        logits (one ``top_ranks`` per depth over its parents); the head runs at the nodes
        with children only (``t.heads``; head i's K/V at key p + i)."""
        bp = logits_hidden.shape[0]
        tokens = []  # per node after the root, its token [Bp] int32
        outputs = {0: (logits_hidden, hidden)}  # head node -> its head outputs [Bp, H] each
        for depth, lv in enumerate(self.tree_levels, start=1):
            top = self.top_ranks(torch.stack([outputs[u][0] for u in lv.ups], dim=1),
                                 lv.width)  # [Bp, ups, width]
            tokens += [top[:, up, rank] for up, rank in lv.picks]
            if not lv.heads:  # the deepest depth
                break
            index = torch.arange(lv.first_row, lv.first_row + len(lv.heads),
                                 device=hidden.device)
            logits_h, out = level(
                torch.stack([tokens[k - 1] for k in lv.heads], dim=1),
                torch.stack([outputs[u][1] for u in lv.head_parents], dim=1),
                depth, index, self.head_ancestors[index][None].expand(bp, -1))
            outputs.update({k: (logits_h[:, i], out[:, i]) for i, k in enumerate(lv.heads)})
        return torch.stack(tokens, dim=1)

    def _dynamic_tree(self, logits_hidden, hidden, level, temperature) -> torch.Tensor:
        """``padded_tree`` of a ``DynamicTree`` (its docstring): candidates in depth order
        (c_1 = the root's top k, then each depth's k x k), each with its token, cumulative
        log-probability and parent candidate (-1: the root). Frontier node j of depth d is
        head row 1 + (d - 1) k + j. A request's log-probabilities are at its own sampling
        temperature, at least the score temperature (a greedy request's: that one): the
        head's estimate of the distribution its drafts are accepted by."""
        t, bp = self.tree, logits_hidden.shape[0]
        k, device = t.top_k, hidden.device
        scale = temperature.clamp(min=self.score_temperature)[:, None]  # [Bp, 1]
        score, token = self.top_tokens(logits_hidden, k, scale)  # [Bp, k]
        child_scale = scale.expand(bp, k).reshape(-1, 1)  # [Bp * k, 1]: per frontier node
        tokens, scores, parents = [token], [score], [torch.full((bp, k), -1, device=device)]
        frontier = torch.arange(k, device=device).expand(bp, k)  # candidate of each node
        parent_out = hidden[:, None].expand(bp, k, -1)  # the hidden state each one reads
        row = 1 + torch.arange(k, device=device)
        ancestors = (1 | (1 << row))[None].expand(bp, k)
        for depth in range(1, t.max_depth):
            logits_h, out = level(token, parent_out, depth, row, ancestors)
            child_score, child = self.top_tokens(logits_h.flatten(0, 1), k, child_scale)
            child_score = (score[..., None] + child_score.view(bp, k, k)).flatten(1)
            tokens.append(child.view(bp, k * k))
            scores.append(child_score)
            parents.append(frontier[..., None].expand(bp, k, k).flatten(1))
            if depth == t.max_depth - 1:  # the leaves: no frontier after them
                break
            best = child_score.topk(k, dim=1).indices  # the next frontier, [Bp, k]
            up = best // k  # its parents' places in this frontier
            first = k + (depth - 1) * k * k  # this depth's first candidate
            frontier, score = first + best, child_score.gather(1, best)
            token = tokens[-1].gather(1, best)
            parent_out = out.gather(1, up[..., None].expand(-1, -1, out.shape[-1]))
            row = 1 + depth * k + torch.arange(k, device=device)
            ancestors = ancestors.gather(1, up) | (1 << row)[None]
        tokens, scores, parents = (torch.cat(c, dim=1) for c in (tokens, scores, parents))
        # a child scores at most its parent; a tie goes to the shallower (the parent)
        chosen = (scores - 1e-6 * self.candidate_depth).topk(
            t.num_nodes - 1, dim=1).indices.sort(dim=1).values
        node_of = torch.zeros_like(parents).scatter(
            1, chosen, 1 + torch.arange(t.num_nodes - 1, device=device).expand_as(chosen)
            .to(parents.dtype))
        up = parents.gather(1, chosen)
        node_parents = torch.where(up < 0, 0, node_of.gather(1, up.clamp(min=0)))
        return torch.cat([tokens.gather(1, chosen), node_parents.to(torch.int32)], dim=1)

    def top_tokens(self, logits_hidden: torch.Tensor, k: int, temperature: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's ``k`` most likely tokens at each row, temperature [rows, 1] float32 ->
        (their log-probabilities under softmax(logits / temperature) [rows, k] float32, the
        tokens [rows, k] int32 in the target vocabulary), most likely first (k = 1: the token
        is ``sample``'s argmax)."""
        logp = torch.log_softmax(self.head.compute_logits(logits_hidden).float() / temperature,
                                 dim=-1)
        if k == 1:
            token = self.sample(logits_hidden)[:, None]
            return logp.amax(dim=-1, keepdim=True), token
        top = logp.topk(k, dim=-1)
        return top.values, self.head.draft_to_target_ids(top.indices).to(torch.int32)

    def top_ranks(self, logits_hidden: torch.Tensor, k: int) -> torch.Tensor:
        """The head's ``k`` highest-logit tokens at each of logits_hidden's [Bp, m, H] rows ->
        [Bp, m, k] int32 in the target vocabulary, the highest first (k = 1: ``sample``'s
        argmax)."""
        rows = logits_hidden.flatten(0, 1)
        if k == 1:
            top = self.sample(rows)[:, None]
        else:
            top = self.head.draft_to_target_ids(
                self.head.compute_logits(rows).topk(k, dim=-1).indices).to(torch.int32)
        return top.view(*logits_hidden.shape[:2], k)

    def _tree_level(self, tokens: torch.Tensor, hidden: torch.Tensor, depth: int,
                    head_rows: torch.Tensor, ancestors: torch.Tensor, *, p: torch.Tensor,
                    rows: torch.Tensor, num_reqs: int | torch.Tensor,
                    block_table: torch.Tensor, loop_seq_len: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over m tree nodes of one depth of every request: tokens [Bp, m]
        int32, hidden [Bp, m, H] (their parents' outputs; None: a model that reads none),
        head_rows [m] int64 (ascending; node j's K/V at key p + head_rows[j], p [Bp, 1] the
        root's), ancestors [Bp, m] int64 (``TreeMask``'s over head rows) -> (logits hidden,
        hidden) [Bp, m, H] each."""
        bp, m = tokens.shape
        last = p + head_rows[-1]
        inactive = (rows >= num_reqs)[:, None] | (last >= self.max_model_len)
        pos = torch.where(inactive, depth, p + depth).expand(bp, m)
        slots = request_slots(block_table, (p + head_rows[None]).clamp(
            max=self.max_model_len - 1), self.block_size)
        seq_lens = torch.where(inactive, head_rows[-1] + 1, last + 1)[:, 0]
        tree = TreeMask(head_rows.repeat(bp), head_rows.new_full((bp * m,), depth),
                        ancestors.flatten())
        meta = AttentionMetadata(torch.where(inactive, -1, slots).flatten(),
                                 torch.arange(0, bp * m + 1, m, dtype=torch.int32,
                                              device=p.device),
                                 seq_lens.to(torch.int32), block_table, loop_seq_len,
                                 max_query_len=m, tree=tree)
        logits_h, out = self.head(tokens.flatten(), pos.flatten(),
                                  None if hidden is None else hidden.flatten(0, 1),
                                  kv=self.kv.bind(meta))
        return logits_h.view(bp, m, -1), out.view(bp, m, -1)

    # ---- an idle DP rank ----------------------------------------------------------------------
    @torch.inference_mode()
    def dummy_run(self, plan: StepPlan) -> None:
        """The same head forwards and padded sizes as propose(): the first pass over Np
        tokens, then the step's K-1 loop forwards over Bp rows. Every KV write goes to slot
        -1."""
        self._dummy_forward(plan.num_tokens_padded)
        if self.tree is not None:
            self._dummy_tree(plan.num_reqs_padded)
            return
        for _ in range(1, plan.num_spec_tokens):
            self._dummy_forward(plan.num_reqs_padded)

    def _dummy_tree(self, num_reqs_padded: int) -> None:
        """A tree's forwards past its root: one per depth over its nodes with children (a
        dynamic tree: its frontier's, every depth below the leaves)."""
        if isinstance(self.tree, DynamicTree):
            for _ in range(1, self.tree.max_depth):
                self._dummy_forward(num_reqs_padded * self.tree.top_k)
            return
        for lv in self.tree_levels[:-1]:
            self._dummy_forward(num_reqs_padded * len(lv.heads))

    def _dummy_forward(self, n: int) -> None:
        """One head forward over n padding tokens (one dummy request, slots -1)."""
        zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
        hidden = torch.zeros(n, self.hidden_size, dtype=self.kv.dtype, device=self.device)
        self.head(zeros, zeros, hidden, kv=self.kv.bind(AttentionMetadata.dummy(n, self.device)))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of t to ``rows`` rows (the ragged path; the padded one never copies)."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])

