"""Proposer: the base every drafter builds on.

It owns the persistent device buffers the draft step reads (fixed addresses, so a
captured graph can replay them) and the acceptance-dependent bookkeeping of both
modes. The formulas live in `specdec.kernels`; this class only calls them.

Padded flow of one step (no host-device sync):
    prep  = prepare_padded(...)             # next tokens, sample indices, num_rejected
    ids   = first_pass_input_ids(target_ids, prep.token_indices_to_sample, prep.next_token_ids)
    ...first pass: draft token 1 from the logits at prep.token_indices_to_sample...
    start_draft_loop(positions_at_sample, seq_lens, prep.num_rejected, batch_size_padded)
    for steps 2..K: step = advance_step(num_reqs, block_table); ...one draft token each...
"""

from dataclasses import dataclass

import torch

from specdec.config import SpeculativeConfig
from specdec.kernels import (
    DraftStep,
    advance_draft_step,
    gather_backup_tokens,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
    shift_first_pass_input_ids,
)
from specdec.kernels.ragged import (
    RaggedInputs,
    next_token_ids_ragged,
    prepare_inputs_ragged,
    valid_counts_ragged,
)


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
    def __init__(self, config: SpeculativeConfig, *, max_num_reqs: int, max_num_tokens: int,
                 block_size: int, max_model_len: int, vocab_size: int,
                 device: torch.device | str = "cpu"):
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

    def prepare_padded(self, sampled_token_ids: torch.Tensor, discard_mask: torch.Tensor,
                       cu_num_draft_tokens: torch.Tensor, query_start_loc: torch.Tensor,
                       token_table: torch.Tensor, rows: torch.Tensor,
                       seq_lens: torch.Tensor) -> PaddedPrep:
        """Padded mode, all on the device. sampled_token_ids [B, K+1] int32,
        discard_mask [B] bool, cu_num_draft_tokens [B] int32, query_start_loc [B+1]
        int32, token_table [R, L] int32, rows [B] int, seq_lens [B] int32 (target step)."""
        b = sampled_token_ids.shape[0]
        self.backup_token_ids[:b] = gather_backup_tokens(token_table, rows, seq_lens)
        next_ids, valid = prepare_next_token_ids_padded(
            sampled_token_ids, discard_mask, self.backup_token_ids[:b], self.vocab_size)
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

    def propose(self, *args, **kwargs) -> torch.Tensor:
        """Draft tokens [B, K] int32 for one step; each proposer implements it."""
        raise NotImplementedError(f"{type(self).__name__}.propose")

    def dummy_run(self, num_tokens: int) -> None:
        """The same collectives as propose() on an idle rank; each proposer implements it."""
        raise NotImplementedError(f"{type(self).__name__}.dummy_run")
