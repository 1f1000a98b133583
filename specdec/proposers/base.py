"""Proposer: the base every drafter builds on.

It owns the persistent device buffers the draft step reads (fixed addresses, so a
captured graph can replay them), the acceptance-dependent bookkeeping of both modes, the
draft loop every head-based proposer shares (``propose``/``dummy_run``), and the ONE
batch-padding + DP hook, ``determine_batch_execution_and_padding``, that every proposer
calls in both. The formulas live in `specdec.kernels`; this class only calls them.

Padded flow of one step (``propose``, no host-device sync):
    prep  = prepare_padded(...)             # next tokens, sample indices, num_rejected
    hook(num_tokens)                        # SP pad, dispatch, DP sync, re-dispatch
    ids   = first_pass_input_ids(target_ids, prep.token_indices_to_sample, prep.next_token_ids)
    first pass of the head -> draft token 1 from the logits at the sample indices
    hook(num_reqs); draft_loop_steps(...)   # start_draft_loop (seq_lens -= num_rejected,
                                            # once), then advance_step + one token per step
Torchair-MTP compiles the same pieces (padded prep, first pass, draft_loop_steps) as one graph.
"""

from dataclasses import dataclass

import torch

from specdec.config import SpeculativeConfig
from specdec.dp import sync_batch_across_dp
from specdec.attention import AttentionMetadata, KVCache
from specdec.kernels import (
    DraftStep,
    advance_draft_step,
    gather_backup_tokens,
    prepare_inputs_padded,
    prepare_next_tokens_padded,
    shift_first_pass_input_ids,
)
from specdec.kernels.ragged import (
    RaggedInputs,
    next_token_ids_ragged,
    prepare_inputs_ragged,
    valid_counts_ragged,
)
from specdec.models.moe import has_cross_rank_layers
from specdec.proposers.inputs import DraftInputs


@dataclass
class PaddedPrep:
    next_token_ids: torch.Tensor  # [B] int32, the token each request drafts from
    valid_count: torch.Tensor  # [B] int32, valid sampled entries (0 if discarded)
    token_indices_to_sample: torch.Tensor  # [B] int32, index into the target's N tokens
    num_rejected: torch.Tensor  # [B] int32, rejected drafts left in the layout as padding


@dataclass
class RaggedPrep:
    next_token_ids: torch.Tensor  # [B] int32 on the device
    inputs: RaggedInputs  # CPU layout with the rejected drafts dropped


class Proposer:
    # Whether the draft model has a layer that exchanges data across DP ranks (an
    # expert-parallel MoE): set from the head in attach_head. Without one, the drafter's DP
    # sync is skipped -- on every rank alike, since every rank loads the same head.
    has_cross_rank_layers = False

    def __init__(self, config: SpeculativeConfig, *, max_num_reqs: int, max_num_tokens: int,
                 block_size: int, max_model_len: int, vocab_size: int,
                 device: torch.device | str = "cpu", head=None, num_kv_blocks: int = 0,
                 dtype: torch.dtype = torch.float32):
        sizes = dict(max_num_reqs=max_num_reqs, max_num_tokens=max_num_tokens,
                     block_size=block_size, max_model_len=max_model_len, vocab_size=vocab_size)
        for name, value in sizes.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_num_reqs = max_num_reqs
        self.max_num_tokens = max_num_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.device = torch.device(device)

        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, device=self.device)

        r = max_num_reqs
        self.next_token_ids = buf(r, torch.int32)
        self.valid_count = buf(r, torch.int32)
        self.token_indices_to_sample = buf(r, torch.int32)
        self.num_rejected = buf(r, torch.int32)
        self.backup_token_ids = buf(r, torch.int32)
        self.input_ids = buf(max_num_tokens, torch.int64)
        # Draft-loop state, one row per request (rows >= B are graph padding).
        self.positions = buf(r, torch.int64)
        self.input_positions = buf(r, torch.int64)
        self.seq_lens = buf(r, torch.int32)
        self.slot_mapping = buf(r, torch.int64)
        self.loop_rows = 0  # rows the draft loop runs, set by start_draft_loop
        self.runner = None  # the model runner (padder + DP group), set by bind_runner
        if head is not None:
            self.attach_head(head, num_kv_blocks, dtype)

    def bind_runner(self, runner) -> None:
        """runner: anything with ``padder`` (BatchPadder) and ``dp`` (DPContext)."""
        self.runner = runner

    def determine_batch_execution_and_padding(
            self, num_tokens: int) -> tuple[bool, int, torch.Tensor]:
        """The one batch-padding + DP hook of every proposer, in propose and dummy_run.

        SP pad -> dispatch onto a capture size -> DP sync (one packed shape, shared with the
        target step) -> re-dispatch the synced count -> assert TP alignment.
        Returns (graph, num_tokens_padded, num_tokens_across_dp [dp_size] int32).
        """
        if self.runner is None:
            raise AssertionError(f"{type(self).__name__} has no runner reference: call "
                                 "bind_runner(runner) before propose() or dummy_run()")
        padder, dp = self.runner.padder, self.runner.dp
        desc = padder.dispatch(padder.pad_for_sequence_parallel(num_tokens))
        synced = sync_batch_across_dp(dp, desc.num_tokens, desc.graph, is_draft_model=True,
                                      draft_has_cross_rank_layers=self.has_cross_rank_layers)
        final = padder.dispatch(synced.num_tokens)
        if not padder.is_aligned(final.num_tokens):
            raise AssertionError(f"padded num_tokens={final.num_tokens} is not a multiple of "
                                 f"tensor_parallel_size={padder.tp_size} with sequence parallelism")
        return final.graph and synced.graph, final.num_tokens, synced.num_tokens_across_dp

    def prepare_padded(self, sampled_token_ids: torch.Tensor, discard_mask: torch.Tensor,
                       cu_num_draft_tokens: torch.Tensor, query_start_loc: torch.Tensor,
                       token_table: torch.Tensor, rows: torch.Tensor,
                       seq_lens: torch.Tensor) -> PaddedPrep:
        """Padded mode, all on the device. sampled_token_ids [B, K+1] int32,
        discard_mask [B] bool, cu_num_draft_tokens [B] int32, query_start_loc [B+1]
        int32, token_table [R, L] int32, rows [B] int, seq_lens [B] int32 (target step)."""
        b = sampled_token_ids.shape[0]
        next_ids, valid, backup = prepare_next_tokens_padded(
            sampled_token_ids, discard_mask, token_table, rows, seq_lens, self.vocab_size)
        self.backup_token_ids[:b] = backup
        sample_idx, rejected = prepare_inputs_padded(cu_num_draft_tokens, valid, query_start_loc)
        self.next_token_ids[:b] = next_ids
        self.valid_count[:b] = valid
        self.token_indices_to_sample[:b] = sample_idx
        self.num_rejected[:b] = rejected
        return PaddedPrep(self.next_token_ids[:b], self.valid_count[:b],
                          self.token_indices_to_sample[:b], self.num_rejected[:b])

    def prepare_ragged(self, sampled: list[list[int]], discard: list[bool], backup: list[int],
                       query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                       num_draft_tokens: list[int]) -> RaggedPrep:
        """Ragged mode (disable_padded_drafter_batch=True): host lists and CPU tensors
        in, the kept-token layout out. Syncs by design."""
        b = len(sampled)
        next_ids = next_token_ids_ragged(sampled, discard, backup, self.vocab_size)
        valid = valid_counts_ragged(sampled, discard, self.vocab_size)
        self.next_token_ids[:b].copy_(torch.tensor(next_ids, dtype=torch.int32))
        inputs = prepare_inputs_ragged(query_start_loc, seq_lens, num_draft_tokens, valid)
        return RaggedPrep(self.next_token_ids[:b], inputs)

    def first_pass_input_ids(self, target_input_ids: torch.Tensor,
                             token_indices_to_sample: torch.Tensor,
                             next_token_ids: torch.Tensor) -> torch.Tensor:
        """[N] int64 view of self.input_ids: the target ids shifted left by one, each
        request's next token at its sample index. Ragged mode passes the kept ids
        (target_ids[token_indices]) and inputs.sample_indices."""
        n = target_input_ids.shape[0]
        self.input_ids[:n] = shift_first_pass_input_ids(
            target_input_ids, token_indices_to_sample, next_token_ids)
        return self.input_ids[:n]

    def start_draft_loop(self, positions: torch.Tensor, seq_lens: torch.Tensor,
                         num_rejected: torch.Tensor | None, batch_size_padded: int) -> None:
        """Load the loop state before step 2. positions [B] int64: each request's
        position at its sample index; seq_lens [B] int32: the target step's seq_lens
        (padded mode, with num_rejected [B]) or the ragged new_seq_lens (num_rejected
        None). This is the one place where `seq_lens -= num_rejected` happens.
        Rows B..batch_size_padded-1 become padding."""
        b = positions.shape[0]
        if not b <= batch_size_padded <= self.max_num_reqs:
            raise ValueError(f"batch_size_padded={batch_size_padded} must be in "
                             f"[{b}, max_num_reqs={self.max_num_reqs}]")
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

    def on_prefill_done(self, request) -> None:
        """Host-side hook, after the step in which ``request`` finished its prefill."""

    # ---- the draft loop (MTP, Eagle, Eagle3; a head with the heads.DraftHead interface) ----
    def attach_head(self, head, num_kv_blocks: int, dtype: torch.dtype) -> None:
        """The draft head and its own KV pages (same block table as the target)."""
        cfg = head.config
        self.head = head
        self.has_cross_rank_layers = has_cross_rank_layers(head)
        self.kv = KVCache(1, num_kv_blocks, self.block_size, cfg.num_key_value_heads,
                          cfg.head_dim, dtype, self.device)
        self.hidden_size = cfg.hidden_size

    def first_pass_hidden(self, x: DraftInputs) -> torch.Tensor:
        """[N, H] hidden states fed with the first pass: the target's final ones."""
        return x.hidden_states

    def sample(self, logits_hidden: torch.Tensor) -> torch.Tensor:
        """Greedy draft tokens [rows] int32 in the target vocabulary."""
        ids = self.head.compute_logits(logits_hidden).argmax(dim=-1)
        return self.head.draft_to_target_ids(ids).to(torch.int32)

    @torch.inference_mode()
    def propose(self, x: DraftInputs) -> torch.Tensor:
        """Draft tokens [B, K] int32 for one step (DESIGN.md's draft loop)."""
        b = x.num_reqs
        if self.config.is_padded:
            prep = self.prepare_padded(x.sampled_token_ids, x.discard_mask,
                                       x.cu_num_draft_tokens, x.attn.query_start_loc,
                                       x.token_table, x.rows, x.attn.seq_lens)
            ids, positions, hidden = x.input_ids, x.positions, self.first_pass_hidden(x)
            attn, sample_idx = x.attn, prep.token_indices_to_sample.to(torch.int64)
            next_ids, num_rejected = prep.next_token_ids, prep.num_rejected
        else:
            ids, positions, hidden, attn, sample_idx, next_ids = self._ragged_first_pass(x)
            num_rejected = None
        graph, n, _ = self.determine_batch_execution_and_padding(ids.shape[0])
        ids, positions, hidden, attn = _pad_tokens(ids, positions, hidden, attn, n)
        ids = self.first_pass_input_ids(ids, sample_idx, next_ids)
        logits_h, next_h = self.head(ids, positions, hidden, kv=self.kv.bind(attn))
        draft = self.sample(logits_h[sample_idx])
        drafts = [draft]
        if self.k == 1:
            return draft[:, None]
        _, bp, _ = self.determine_batch_execution_and_padding(b)
        drafts += self.draft_loop_steps(
            _pad_rows(draft, bp), _pad_rows(next_h[sample_idx], bp), positions[sample_idx],
            attn.seq_lens[:b], num_rejected, b, _pad_rows(attn.block_table, bp),
            attn.max_seq_len)
        return torch.stack([d[:b] for d in drafts], dim=1)

    def draft_loop_steps(self, tokens: torch.Tensor, hidden: torch.Tensor,
                         positions: torch.Tensor, seq_lens: torch.Tensor,
                         num_rejected: torch.Tensor | None, num_reqs: int | torch.Tensor,
                         block_table: torch.Tensor, max_seq_len: int) -> list[torch.Tensor]:
        """Draft steps 2..K over Bp rows (B real, the rest graph padding), one token each.

        tokens [Bp] int32 (draft 1), hidden [Bp, H] (the head's output at the sample index),
        positions [B] int64 and seq_lens [B] int32 at the sample index (num_rejected [B] in
        padded mode, None when seq_lens are already the ragged ones), block_table [Bp, M],
        max_seq_len: host bound on seq_lens before step 2. Returns K-1 tensors [Bp] int32.
        Used eagerly by propose() and inside Torchair-MTP's compiled graph.
        """
        bp = tokens.shape[0]
        self.start_draft_loop(positions, seq_lens, num_rejected, bp)
        qsl = torch.arange(bp + 1, dtype=torch.int32, device=tokens.device)
        drafts = []
        for step in range(1, self.k):
            st = self.advance_step(num_reqs, block_table)
            meta = AttentionMetadata(st.slot_mapping, qsl, st.seq_lens, block_table,
                                     min(max_seq_len + step, self.max_model_len))
            logits_h, hidden = self.head(tokens, st.input_positions, hidden,
                                         kv=self.kv.bind(meta))
            tokens = self.sample(logits_h)
            drafts.append(tokens)
        return drafts

    def _ragged_first_pass(self, x: DraftInputs):
        """disable_padded_drafter_batch=True: read the acceptance on the host (a sync by
        design), drop the rejected drafts, rebuild the layout."""
        b, dev = x.num_reqs, self.device
        backup = gather_backup_tokens(x.token_table, x.rows, x.attn.seq_lens)
        cu = x.cu_num_draft_tokens.tolist()
        prep = self.prepare_ragged(x.sampled_token_ids.tolist(), x.discard_mask.tolist(),
                                   backup.tolist(), x.attn.query_start_loc.cpu(),
                                   x.attn.seq_lens.cpu(), [c - p for c, p in zip(cu, [0] + cu)])
        r = prep.inputs
        keep = r.token_indices.to(dev)
        attn = AttentionMetadata(x.attn.slot_mapping[keep], r.new_query_start_loc.to(dev),
                                 r.new_seq_lens.to(dev), x.attn.block_table,
                                 x.attn.max_seq_len)
        return (x.input_ids[keep], x.positions[keep], self.first_pass_hidden(x)[keep], attn,
                r.sample_indices.to(dev, torch.int64), prep.next_token_ids)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int) -> None:
        """An idle DP rank's drafter call: the same hook calls, head forwards and padded sizes
        (so the same collectives) as propose(): the first pass over the synced token count,
        then K-1 loop forwards over the synced request count (this rank contributes none).
        Every KV write goes to slot -1."""
        _, n, _ = self.determine_batch_execution_and_padding(num_tokens)
        self._dummy_forward(n)
        if self.k == 1:
            return
        _, bp, _ = self.determine_batch_execution_and_padding(0)
        for _ in range(1, self.k):
            self._dummy_forward(bp)

    def _dummy_forward(self, n: int) -> None:
        """One head forward over n padding tokens (one dummy request, slots -1)."""
        zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
        hidden = torch.zeros(n, self.hidden_size, dtype=self.kv.k.dtype, device=self.device)
        self.head(zeros, zeros, hidden, kv=self.kv.bind(AttentionMetadata.dummy(n, self.device)))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """Zero-pad dim 0 of t to ``rows`` rows."""
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0], *t.shape[1:]))
    return torch.cat([t, pad])


def _pad_tokens(ids, positions, hidden, attn: AttentionMetadata, n: int):
    """Pad a first-pass token layout to n tokens (padding tokens write to slot -1)."""
    if ids.shape[0] == n:
        return ids, positions, hidden, attn
    slots = torch.cat([attn.slot_mapping, attn.slot_mapping.new_full((n - ids.shape[0],), -1)])
    attn = AttentionMetadata(slots, attn.query_start_loc, attn.seq_lens, attn.block_table,
                             attn.max_seq_len)
    return _pad_rows(ids, n), _pad_rows(positions, n), _pad_rows(hidden, n), attn
