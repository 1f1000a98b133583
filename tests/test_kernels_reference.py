"""The padded formulas (specdec.kernels) against the ragged host reference."""

import torch
from hypothesis import given, strategies as st

from specdec.kernels import (
    advance_draft_step,
    gather_backup_tokens,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
    shift_first_pass_input_ids,
    slot_mapping_for_positions,
)
from specdec.kernels.ragged import (
    draft_step_ragged,
    next_token_ids_ragged,
    prepare_inputs_ragged,
    valid_counts_ragged,
)


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


# DESIGN.md worked example: K=2, B=4, r3 a discarded 5-token prefill chunk.
QSL = i32([0, 3, 6, 9, 14])
SAMPLED = [[11, 12, 13], [21, -1, -1], [31, 32, -1], [41, -1, -1]]
DISCARD = [False, False, False, True]
BACKUP = [0, 0, 0, 99]
CU_DRAFT = i32([2, 4, 6, 6])


def test_worked_example_next_tokens():
    next_ids, valid = prepare_next_token_ids_padded(
        i32(SAMPLED), torch.tensor(DISCARD), i32(BACKUP), vocab_size=100)
    assert next_ids.dtype == valid.dtype == torch.int32
    assert next_ids.tolist() == [13, 21, 32, 99]
    assert valid.tolist() == [3, 1, 2, 0]
    assert next_token_ids_ragged(SAMPLED, DISCARD, BACKUP, 100) == [13, 21, 32, 99]
    assert valid_counts_ragged(SAMPLED, DISCARD, 100) == [3, 1, 2, 0]


def test_worked_example_sample_indices():
    sample_idx, rejected = prepare_inputs_padded(CU_DRAFT, i32([3, 1, 2, 0]), QSL)
    assert sample_idx.dtype == rejected.dtype == torch.int32
    assert sample_idx.tolist() == [2, 3, 7, 13]
    assert rejected.tolist() == [0, 2, 1, 0]

    ragged = prepare_inputs_ragged(QSL, i32([10, 20, 30, 40]), [2, 2, 2, 0], [3, 1, 2, 0])
    assert ragged.new_query_start_loc.tolist() == [0, 3, 4, 6, 11]
    assert ragged.sample_indices.tolist() == [2, 3, 5, 10]
    assert ragged.token_indices.tolist() == [0, 1, 2, 3, 6, 7, 9, 10, 11, 12, 13]
    assert ragged.new_seq_lens.tolist() == [10, 18, 29, 40]
    assert ragged.token_indices[ragged.sample_indices].tolist() == [2, 3, 7, 13]


def test_ids_at_vocab_edge():
    sampled = i32([[99, 100, -1], [100, 5, -1], [0, 99, 99]])
    next_ids, valid = prepare_next_token_ids_padded(
        sampled, torch.tensor([False] * 3), i32([7, 8, 9]), vocab_size=100)
    assert valid.tolist() == [1, 0, 3]
    assert next_ids.tolist() == [99, 8, 99]


def test_docstring_examples():
    table = i32([[5, 6, 7, -1], [8, 9, -1, -1]])
    assert gather_backup_tokens(table, torch.tensor([1, 0]), i32([1, 4])).tolist() == [9, -1]
    ids = torch.arange(1, 7)
    out = shift_first_pass_input_ids(ids, i32([2, 5]), i32([30, 60]))
    assert out.dtype == torch.int64 and out.tolist() == [2, 3, 30, 5, 6, 60]
    slots = slot_mapping_for_positions(torch.tensor([0, 5]), torch.tensor([0, 0]), i32([[7, 3]]), 4)
    assert slots.tolist() == [28, 13]
    step = advance_draft_step(torch.tensor([4, 7, 9]), i32([5, 8, 10]), i32([[2, 5, -1]] * 3),
                              num_reqs=2, block_size=4, max_model_len=8)
    assert step.positions.tolist() == [5, 8, 10]
    assert step.input_positions.tolist() == [5, 0, 0]
    assert step.slot_mapping.tolist() == [21, -1, -1]
    assert step.seq_lens.tolist() == [6, 1, 1] and step.seq_lens.dtype == torch.int32
    want = ([5, 0], [21, -1], [6, 1])
    assert draft_step_ragged([4, 7], [5, 8], 1, [[2, 5], [1, 3]], 4, 8) == want


def test_past_max_model_len_stays_inactive():
    """A row past max_model_len on one step stays a dummy row on every later step."""
    positions, seq_lens = torch.tensor([6]), i32([7])
    seen = []
    for _ in range(3):
        step = advance_draft_step(positions, seq_lens, i32([[1, 2]]), 1, 4, max_model_len=8)
        positions, seq_lens = step.positions, step.seq_lens
        seen.append((step.input_positions.item(), step.slot_mapping.item(), step.seq_lens.item()))
    assert seen == [(7, 11, 8), (0, -1, 1), (0, -1, 1)]


def test_num_reqs_as_device_scalar():
    args = (torch.tensor([1, 2, 3]), i32([2, 3, 4]), i32([[4, 5]] * 3))
    a = advance_draft_step(*args, num_reqs=2, block_size=2, max_model_len=4)
    b = advance_draft_step(*args, num_reqs=torch.tensor(2), block_size=2, max_model_len=4)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    assert a.slot_mapping.tolist() == [10, 11, -1]


@given(b=st.integers(1, 256), k=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_gather_backup_matches_loop(step_batch, b, k, seed):
    batch = step_batch(b, k, seed)
    got = gather_backup_tokens(batch.token_table, batch.rows, batch.seq_lens)
    assert got.tolist() == batch.backup
    # Past the table's end the backup is unknown.
    beyond = torch.full((b,), batch.token_table.shape[1], dtype=torch.int32)
    assert gather_backup_tokens(batch.token_table, batch.rows, beyond).tolist() == [-1] * b


@given(b=st.integers(1, 256), k=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_padded_agrees_with_ragged(step_batch, b, k, seed):
    batch = step_batch(b, k, seed)
    vocab, seq_lens, positions = batch.vocab_size, batch.seq_lens, batch.positions
    backup = batch.backup

    # Padded: everything on the device from tensors.
    next_ids, valid = prepare_next_token_ids_padded(
        i32(batch.sampled), torch.tensor(batch.discard), i32(backup), vocab)
    sample_idx, rejected = prepare_inputs_padded(batch.cu_num_draft_tokens, valid,
                                                 batch.query_start_loc)
    # Ragged: the host reference from lists.
    r_next = next_token_ids_ragged(batch.sampled, batch.discard, backup, vocab)
    r_valid = valid_counts_ragged(batch.sampled, batch.discard, vocab)
    ragged = prepare_inputs_ragged(batch.query_start_loc, seq_lens, batch.num_draft, r_valid)

    assert next_ids.tolist() == r_next
    assert valid.tolist() == r_valid
    assert rejected.tolist() == ragged.num_rejected.tolist()
    # Both sample each request at the same target token.
    assert sample_idx.tolist() == ragged.token_indices[ragged.sample_indices].tolist()

    # First pass: the padded input restricted to the kept tokens is the ragged input.
    padded_ids = shift_first_pass_input_ids(batch.target_ids, sample_idx, next_ids)
    ragged_ids = shift_first_pass_input_ids(batch.target_ids[ragged.token_indices],
                                            ragged.sample_indices, i32(r_next))
    assert padded_ids[ragged.token_indices].tolist() == ragged_ids.tolist()

    # Draft loop, steps 2..K, over B real rows plus graph-padding rows.
    bp = batch.block_table.shape[0]
    pad = bp - b
    pos = torch.cat([positions[sample_idx], torch.zeros(pad, dtype=torch.int64)])
    lens = torch.cat([seq_lens - rejected, torch.ones(pad, dtype=torch.int32)])
    r_pos0 = positions[ragged.token_indices[ragged.sample_indices]].tolist()
    for step in range(1, k):
        out = advance_draft_step(pos, lens, batch.block_table, b, batch.block_size,
                                 batch.max_model_len)
        pos, lens = out.positions, out.seq_lens
        want_pos, want_slot, want_len = draft_step_ragged(
            r_pos0, ragged.new_seq_lens.tolist(), step, batch.block_table[:b].tolist(),
            batch.block_size, batch.max_model_len)
        assert out.input_positions.tolist() == want_pos + [0] * pad
        assert out.slot_mapping.tolist() == want_slot + [-1] * pad
        assert out.seq_lens.tolist() == want_len + [1] * pad
