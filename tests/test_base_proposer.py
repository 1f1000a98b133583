"""Proposer base: buffers, the padded and ragged preparation, the draft-loop state."""

import pytest
import torch
from hypothesis import given, strategies as st

from specdec.config import SpeculativeConfig
from specdec.kernels import shift_first_pass_input_ids
from specdec.kernels.ragged import draft_step_ragged
from specdec.proposers.base import PaddedProposer
from specdec.proposers.mtp import MtpProposer
from specdec.syncs import count_host_syncs, forbid_host_sync

from helpers import tiny_head, tiny_target


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def make_proposer(k=2, padded=True, max_num_seqs=300, max_model_len=80, block_size=4,
                  vocab_size=100):
    """An MTP proposer (the draft-loop state lives on HeadProposer) over a tiny head."""
    config = SpeculativeConfig("mtp", k, disable_padded_drafter_batch=not padded)
    target = tiny_target()
    return MtpProposer(config, head=tiny_head("mtp", target), num_kv_blocks=4,
                       dtype=torch.float64, max_num_seqs=max_num_seqs,
                       block_size=block_size, max_model_len=max_model_len,
                       vocab_size=vocab_size, device="cpu")


def test_worked_example_through_the_proposer():
    p = make_proposer()
    sampled = i32([[11, 12, 13], [21, -1, -1], [31, 32, -1], [41, -1, -1]])
    table = torch.full((4, 20), -1, dtype=torch.int32)
    table[3, :16] = 99  # r3's prompt continues past its chunk: backup token 99
    seq_lens = i32([12, 12, 12, 15])
    args = (sampled, torch.tensor([False, False, False, True]), i32([2, 4, 6, 6]),
            i32([0, 3, 6, 9, 14]), table, torch.arange(4), seq_lens)
    with forbid_host_sync():
        next_ids, valid, sample_idx, rejected = p.prepare_padded(*args)
    assert next_ids.tolist() == [13, 21, 32, 99]  # r3's backup token is 99
    assert valid.tolist() == [3, 1, 2, 0]
    assert sample_idx.tolist() == [2, 3, 7, 13]
    assert rejected.tolist() == [0, 2, 1, 0]

    next_ids, ragged = p.prepare_ragged(sampled.tolist(), [False, False, False, True],
                                        [-1, -1, -1, 99], i32([0, 3, 6, 9, 14]), seq_lens,
                                        [2, 2, 2, 0])
    assert next_ids == [13, 21, 32, 99]
    assert ragged.new_query_start_loc.tolist() == [0, 3, 4, 6, 11]
    assert ragged.sample_indices.tolist() == [2, 3, 5, 10]


def test_seq_lens_minus_num_rejected_happens_once():
    p = make_proposer(k=4, max_model_len=100)
    p.start_draft_loop(torch.tensor([10, 20]), i32([14, 24]), i32([3, 0]), batch_size_padded=3)
    block_table = torch.arange(3 * 25, dtype=torch.int32).view(3, 25)
    seen = [p.advance_step(2, block_table).seq_lens.tolist() for _ in range(3)]
    assert seen == [[12, 25, 1], [13, 26, 1], [14, 27, 1]]
    assert p.positions[:2].tolist() == [13, 23]
    # slot = block_table[r, pos // 4] * 4 + pos % 4; the padding row gets -1
    assert p.slot_mapping[:3].tolist() == [3 * 4 + 1, 30 * 4 + 3, -1]


def test_advance_before_start_errors():
    with pytest.raises(RuntimeError, match="start_draft_loop"):
        make_proposer().advance_step(1, torch.zeros(1, 4, dtype=torch.int32))


def test_padded_rows_out_of_range():
    p = make_proposer(max_num_seqs=4)
    with pytest.raises(ValueError, match="batch_size_padded=5"):
        p.start_draft_loop(torch.zeros(2, dtype=torch.int64), i32([1, 1]), None, 5)


@pytest.mark.parametrize("field,value,exc", [
    ("max_num_seqs", 0, ValueError), ("block_size", 2.0, TypeError),
    ("vocab_size", True, TypeError), ("max_model_len", -3, ValueError)])
def test_constructor_validates_sizes(field, value, exc):
    kw = dict(max_num_seqs=4, block_size=4, max_model_len=64, vocab_size=10)
    kw[field] = value
    with pytest.raises(exc, match=f"{field}={value!r}"):
        PaddedProposer(SpeculativeConfig("mtp", 1), **kw)


@given(b=st.integers(1, 256), k=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_padded_and_ragged_proposers_agree(step_batch, b, k, seed):
    """The whole preparation through two proposers, one per mode: the same first-pass
    inputs at the kept tokens and the same draft-loop metadata; padded never syncs."""
    batch = step_batch(b, k, seed)
    kw = dict(k=k, max_model_len=batch.max_model_len, block_size=batch.block_size,
              vocab_size=batch.vocab_size)
    padded, ragged = make_proposer(padded=True, **kw), make_proposer(padded=False, **kw)
    sampled = torch.tensor(batch.sampled, dtype=torch.int32)
    seq_lens, positions, bp = batch.seq_lens, batch.positions, batch.block_table.shape[0]
    args = (sampled, torch.tensor(batch.discard), batch.cu_num_draft_tokens,
            batch.query_start_loc, batch.token_table, batch.rows, seq_lens)

    with forbid_host_sync():
        next_ids, _, sample_idx, num_rejected = padded.prepare_padded(*args)
        ids = shift_first_pass_input_ids(batch.target_ids, sample_idx, next_ids)
        padded.start_draft_loop(positions[sample_idx], seq_lens, num_rejected, bp)
        # advance_step returns views of the buffers: keep a copy of each step.
        steps = [[t.clone() for t in padded.advance_step(b, batch.block_table)]
                 for _ in range(1, k)]

    with count_host_syncs() as syncs:
        rnext, rinputs = ragged.prepare_ragged(sampled.tolist(), batch.discard, batch.backup,
                                               batch.query_start_loc, seq_lens, batch.num_draft)
    assert syncs.count > 0
    kept = rinputs.token_indices
    rids = shift_first_pass_input_ids(batch.target_ids[kept], rinputs.sample_indices,
                                      torch.tensor(rnext, dtype=torch.int32))
    assert next_ids.tolist() == rnext
    assert ids[kept].tolist() == rids.tolist()

    sample_pos = positions[kept[rinputs.sample_indices]].tolist()
    pad = bp - b
    for step, (_, in_pos, slots, lens) in enumerate(steps, start=1):
        want = draft_step_ragged(sample_pos, rinputs.new_seq_lens.tolist(), step,
                                 batch.block_table[:b].tolist(), batch.block_size,
                                 batch.max_model_len)
        assert in_pos.tolist() == want[0] + [0] * pad
        assert slots.tolist() == want[1] + [-1] * pad
        assert lens.tolist() == want[2] + [1] * pad
