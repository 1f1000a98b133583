"""Pure-torch reference for the padded-drafting formulas (any device).

The CPU path, and the oracle of the Triton kernels in ``triton_padded.py`` (the device
dispatch is in ``__init__.py``; tests/test_kernels_triton.py compares the two).

Every function runs on the device with no host-device synchronization: no
`.item()`, no boolean-mask indexing, no data-dependent shapes. Worked example used
throughout (K=2, B=4; r3 is a discarded 5-token prefill chunk):

    query_start_loc = [0, 3, 6, 9, 14]
    sampled         = [[11,12,13], [21,-1,-1], [31,32,-1], [41,-1,-1]]
    valid_count     = [3, 1, 2, 0]
    next_token      = [13, 21, 32, backup_r3]
    cu_num_draft    = [2, 4, 6, 6]  -> num_draft = [2, 2, 2, 0]
    num_rejected    = [0, 2, 1, 0]
    sample_index    = [2, 3, 7, 13]
"""

from typing import NamedTuple

import torch


def prepare_next_token_ids_padded(
    sampled_token_ids: torch.Tensor,
    discard_mask: torch.Tensor,
    backup_token_ids: torch.Tensor,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token per request and how many sampled entries are valid.

    sampled_token_ids: [B, K+1] int32; -1 = placeholder, ids >= vocab_size are invalid too.
    discard_mask:      [B] bool; True = partial prefill, its sampled tokens are junk.
    backup_token_ids:  [B] int32; next token when a request has no valid entry.
    Returns next_token_ids [B] int32 and valid_count [B] int32 (length of the valid
    prefix; 0 for discarded rows).

    Example: sampled = [[11,12,13], [21,-1,-1], [31,32,-1], [41,-1,-1]],
    discard = [F,F,F,T], backup = [0,0,0,99], vocab_size = 100
    -> next = [13, 21, 32, 99], valid_count = [3, 1, 2, 0].
    """
    valid = (sampled_token_ids >= 0) & (sampled_token_ids < vocab_size)
    # Length of the leading run of valid entries (valid entries form a prefix).
    valid_count = valid.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)
    valid_count = torch.where(discard_mask, 0, valid_count)
    last = (valid_count.long() - 1).clamp(min=0).unsqueeze(1)
    last_token = sampled_token_ids.gather(1, last).squeeze(1)
    next_token_ids = torch.where(valid_count > 0, last_token, backup_token_ids)
    return next_token_ids.to(torch.int32), valid_count


def prepare_inputs_padded(
    cu_num_draft_tokens: torch.Tensor,
    valid_count: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where to sample each request's draft in the unchanged (padded) token layout.

    cu_num_draft_tokens: [B] int32, inclusive cumsum of drafts per request.
    valid_count:         [B] int32, from prepare_next_token_ids_padded.
    query_start_loc:     [B+1] int32, exclusive cumsum of scheduled tokens.
    Returns token_indices_to_sample [B] int32 and num_rejected [B] int32:
        num_draft[r]    = cu[r] - cu[r-1]
        num_rejected[r] = num_draft[r] + 1 - valid_count[r] if num_draft[r] > 0 else 0
        sample_index[r] = query_start_loc[r+1] - 1 - num_rejected[r]
    A request with drafts always has valid_count >= 1 (the recovered/bonus token).

    Example: cu = [2,4,6,6], valid_count = [3,1,2,0], qsl = [0,3,6,9,14]
    -> sample_index = [2, 3, 7, 13], num_rejected = [0, 2, 1, 0].
    """
    num_draft = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))
    num_rejected = torch.where(num_draft > 0, num_draft + 1 - valid_count, 0)
    token_indices_to_sample = query_start_loc[1:] - 1 - num_rejected
    return token_indices_to_sample.to(torch.int32), num_rejected.to(torch.int32)


def gather_backup_tokens(
    token_table: torch.Tensor,
    row_indices: torch.Tensor,
    seq_lens: torch.Tensor,
) -> torch.Tensor:
    """Each request's own known token right after its scheduled chunk.

    token_table: [R, L] int32, known tokens per request row, -1 = unknown.
    row_indices: [B] int, each request's row in token_table.
    seq_lens:    [B] int, num_computed + num_scheduled.
    Returns [B] int32: token_table[row, seq_len], or -1 when seq_len >= L.

    Example: table = [[5,6,7,-1], [8,9,-1,-1]], rows = [1,0], seq_lens = [1,4] -> [9, -1].
    """
    length = token_table.shape[1]
    cols = seq_lens.long().clamp(max=length - 1)
    tokens = token_table[row_indices.long(), cols]
    return torch.where(seq_lens < length, tokens, -1).to(torch.int32)


def shift_first_pass_input_ids(
    target_input_ids: torch.Tensor,
    token_indices_to_sample: torch.Tensor,
    next_token_ids: torch.Tensor,
) -> torch.Tensor:
    """The drafter's first-pass input: target tokens shifted left by one, with each
    request's next token written at its sample index.

    target_input_ids:        [N] int (any int dtype; the output keeps it).
    token_indices_to_sample: [B] int32, distinct indices in [0, N).
    next_token_ids:          [B] int32.
    Returns [N]: out[:N-1] = ids[1:]; out[N-1] keeps ids[N-1] (never read: the last
    token is either a sample index, overwritten here, or padding); then
    out[sample_index] = next_token.

    Example: ids = [1,2,3,4,5,6], sample_index = [2,5], next = [30,60]
    -> [2,3,30,5,6,60].
    """
    # (a cat, not out[:-1] = ids[1:]: that copy's broadcast check would make N = 2 a
    # graph of its own under dynamic shapes)
    out = torch.cat((target_input_ids[1:], target_input_ids[-1:]))
    return out.index_copy_(0, token_indices_to_sample.long(),
                           next_token_ids.to(target_input_ids.dtype))


def request_slots(block_table: torch.Tensor, positions: torch.Tensor,
                  block_size: int) -> torch.Tensor:
    """``slot_mapping_for_positions`` of J positions per request: block_table [B, M] int32,
    positions [B, J] int64 (row b: request b's) -> slots [B, J] int64.

    Example: block_table = [[7, 3]], block_size = 4, positions = [[0, 5]] -> [[28, 13]]."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    return slot_mapping_for_positions(positions.flatten(), rows.expand_as(positions).flatten(),
                                      block_table, block_size).view(positions.shape)


def slot_mapping_for_positions(
    positions: torch.Tensor,
    req_indices: torch.Tensor,
    block_table: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """KV-cache slot of each token: block_table[r, pos // bs] * bs + pos % bs.

    positions:   [N] int64, must be < block_table.shape[1] * block_size.
    req_indices: [N] int, each token's row in block_table.
    block_table: [R, M] int32.
    Returns [N] int64.

    Example: block_table = [[7, 3]], block_size = 4, positions = [0, 5], req = [0, 0]
    -> [28, 13].
    """
    blocks = block_table[req_indices.long(), positions.long() // block_size].long()
    return blocks * block_size + positions.long() % block_size


class PaddedPrep(NamedTuple):
    """Every per-request output of the padded prep, each [B] int32 (preallocate with
    :meth:`empty` and pass as ``out=`` so a captured step reuses the same buffers)."""

    next_token_ids: torch.Tensor
    valid_count: torch.Tensor
    backup_token_ids: torch.Tensor
    token_indices_to_sample: torch.Tensor
    num_rejected: torch.Tensor

    @classmethod
    def empty(cls, num_reqs: int, device: torch.device | str) -> "PaddedPrep":
        return cls(*(torch.empty(num_reqs, dtype=torch.int32, device=device) for _ in range(5)))


def prepare_padded_step(
    sampled_token_ids: torch.Tensor,
    discard_mask: torch.Tensor,
    token_table: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    query_start_loc: torch.Tensor,
    vocab_size: int,
    out: PaddedPrep,
) -> PaddedPrep:
    """gather_backup_tokens + prepare_next_token_ids_padded + prepare_inputs_padded in one
    call, written into ``out`` (returned). Arguments as in those three functions.

    Example (the module's): sampled = [[11,12,13], [21,-1,-1], [31,32,-1], [41,-1,-1]],
    discard = [F,F,F,T], table = [[99]*6], rows = [0,0,0,0], seq_lens = [2,5,8,5],
    cu = [2,4,6,6], qsl = [0,3,6,9,14], vocab_size = 100 -> next = [13,21,32,99],
    valid_count = [3,1,2,0], backup = [99,99,-1,99], sample_index = [2,3,7,13],
    num_rejected = [0,2,1,0].
    """
    backup = gather_backup_tokens(token_table, rows, seq_lens)
    next_ids, valid = prepare_next_token_ids_padded(sampled_token_ids, discard_mask, backup,
                                                    vocab_size)
    sample_idx, rejected = prepare_inputs_padded(cu_num_draft_tokens, valid, query_start_loc)
    for dst, src in zip(out, (next_ids, valid, backup, sample_idx, rejected)):
        dst.copy_(src)
    return out


class DraftStep(NamedTuple):
    positions: torch.Tensor  # [Bp] int64, carried to the next step (never clamped)
    input_positions: torch.Tensor  # [Bp] int64, fed to the model: 0 where inactive
    slot_mapping: torch.Tensor  # [Bp] int64, -1 where inactive
    seq_lens: torch.Tensor  # [Bp] int32, 1 where inactive


def advance_draft_step(
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_reqs: int | torch.Tensor,
    block_size: int,
    max_model_len: int,
) -> DraftStep:
    """Metadata for one draft-loop step (steps 2..K): one token per request.

    positions:   [Bp] int64, previous step's positions (Bp = B padded to a graph size).
    seq_lens:    [Bp] int32, previous step's seq_lens (before the first loop step:
                 target seq_lens - num_rejected, in padded mode).
    block_table: [Bp, M] int32; rows >= num_reqs may hold anything.
    num_reqs:    B, a host int or a 0-dim device tensor (no sync either way).
    Every row: positions + 1, seq_lens + 1. A row is *inactive* when it is padding
    (row >= num_reqs) or its new position >= max_model_len; an inactive row gets input
    position 0, slot -1 and seq_len 1, so every rank still runs the drafter.
    `positions` is returned unclamped so that a row past max_model_len stays inactive
    on later steps; feed `input_positions` to the model.

    Example: positions = [4, 7, 9], seq_lens = [5, 8, 10], block_table = [[2,5,-1]] * 3,
    num_reqs = 2, block_size = 4, max_model_len = 8
    -> positions [5, 8, 10], input_positions [5, 0, 0], slots [21, -1, -1],
       seq_lens [6, 1, 1].
    """
    positions = positions + 1
    rows = torch.arange(positions.shape[0], device=positions.device)
    inactive = (rows >= num_reqs) | (positions >= max_model_len)
    input_positions = torch.where(inactive, 0, positions)
    max_block = block_table.shape[1] * block_size - 1
    slots = slot_mapping_for_positions(input_positions.clamp(max=max_block), rows,
                                       block_table, block_size)
    return DraftStep(
        positions=positions,
        input_positions=input_positions,
        slot_mapping=torch.where(inactive, -1, slots),
        seq_lens=torch.where(inactive, 1, seq_lens + 1).to(torch.int32),
    )
