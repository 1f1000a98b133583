"""Host reference for `disable_padded_drafter_batch=True` (the ragged drafter batch).

The host reads the accepted tokens (a device-to-host sync, by design), drops the
rejected drafts from the batch and rebuilds its layout. Inputs are Python lists and
CPU tensors. Worked example (K=2, B=4; r3 a discarded 5-token prefill chunk):

    query_start_loc     = [0, 3, 6, 9, 14]
    num_draft_tokens    = [2, 2, 2, 0];  valid_count = [3, 1, 2, 0]
    num_rejected        = [0, 2, 1, 0]
    new_query_start_loc = [0, 3, 4, 6, 11]
    token_indices       = [0,1,2, 3, 6,7, 9,10,11,12,13]
    sample_indices      = [2, 3, 5, 10]   (token_indices[...] = [2, 3, 7, 13])
"""

from dataclasses import dataclass

import torch


@dataclass
class RaggedInputs:
    new_query_start_loc: torch.Tensor  # [B+1] int32, exclusive cumsum of kept tokens
    new_seq_lens: torch.Tensor  # [B] int32, seq_lens - num_rejected
    token_indices: torch.Tensor  # [M] int32, kept tokens' indices in the target layout
    sample_indices: torch.Tensor  # [B] int32, new_query_start_loc[1:] - 1 (into token_indices)
    num_rejected: torch.Tensor  # [B] int32


def valid_prefix(row: list[int], vocab_size: int) -> list[int]:
    """The leading valid ids of one sampled row: [21, -1, -1] -> [21]."""
    out = []
    for t in row:
        if not 0 <= t < vocab_size:
            break
        out.append(t)
    return out


def valid_counts_ragged(sampled: list[list[int]], discard: list[bool],
                        vocab_size: int) -> list[int]:
    """Valid entries per request, 0 when discarded: the worked example gives [3, 1, 2, 0]."""
    return [0 if d else len(valid_prefix(row, vocab_size)) for row, d in zip(sampled, discard)]


def next_token_ids_ragged(
    sampled: list[list[int]],
    discard: list[bool],
    backup: list[int],
    vocab_size: int,
) -> list[int]:
    """Last valid sampled id per request, else its backup token.

    Example: sampled = [[11,12,13], [21,-1,-1], [31,32,-1], [41,-1,-1]],
    discard = [F,F,F,T], backup = [0,0,0,99] -> [13, 21, 32, 99].
    """
    out = []
    for row, d, b in zip(sampled, discard, backup):
        valid = [] if d else valid_prefix(row, vocab_size)
        out.append(valid[-1] if valid else b)
    return out


def prepare_inputs_ragged(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_draft_tokens: list[int],
    valid_count: list[int],
) -> RaggedInputs:
    """Drop each request's rejected drafts from the target layout.

    query_start_loc: [B+1] int32 CPU; seq_lens: [B] int32 CPU.
    num_rejected[r] = num_draft[r] + 1 - valid_count[r] if num_draft[r] > 0 else 0.
    See the module docstring for the worked example.
    """
    num_rejected = torch.tensor([n + 1 - v if n > 0 else 0
                                 for n, v in zip(num_draft_tokens, valid_count)], dtype=torch.int32)
    qsl = query_start_loc.to(torch.int32)
    new_query_lens = qsl[1:] - qsl[:-1] - num_rejected
    new_qsl = torch.zeros_like(qsl)
    torch.cumsum(new_query_lens, dim=0, out=new_qsl[1:])
    # Token j of the new layout sits at j + (old start - new start) of its request.
    shift = torch.repeat_interleave(qsl[:-1] - new_qsl[:-1], new_query_lens)
    token_indices = torch.arange(shift.shape[0], dtype=torch.int32) + shift
    return RaggedInputs(
        new_query_start_loc=new_qsl,
        new_seq_lens=seq_lens.to(torch.int32) - num_rejected,
        token_indices=token_indices,
        sample_indices=new_qsl[1:] - 1,
        num_rejected=num_rejected,
    )


def draft_step_ragged(
    sample_positions: list[int],
    new_seq_lens: list[int],
    step: int,
    block_table: list[list[int]],
    block_size: int,
    max_model_len: int,
) -> tuple[list[int], list[int], list[int]]:
    """Input positions, slots and seq_lens of draft-loop step `step` (1 = the second
    draft token), one request at a time. sample_positions[r] is the position of the
    token request r was sampled at in the first pass.

    Example: sample_positions = [4, 7], new_seq_lens = [5, 8], step = 1,
    block_table = [[2, 5], [1, 3]], block_size = 4, max_model_len = 8
    -> ([5, 0], [21, -1], [6, 1]).
    """
    positions, slots, lens = [], [], []
    for p0, s0, blocks in zip(sample_positions, new_seq_lens, block_table):
        pos = p0 + step
        if pos >= max_model_len:  # past the end: a dummy row that writes no KV
            pos, slot, seq_len = 0, -1, 1
        else:
            slot = blocks[pos // block_size] * block_size + pos % block_size
            seq_len = s0 + step
        positions.append(pos)
        slots.append(slot)
        lens.append(seq_len)
    return positions, slots, lens
