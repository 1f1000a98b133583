"""forbid_host_sync / count_host_syncs: each syncing op is caught, the padded path is not."""

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from specdec.kernels import (
    advance_draft_step,
    gather_backup_tokens,
    prepare_inputs_padded,
    prepare_next_token_ids_padded,
    shift_first_pass_input_ids,
)
from specdec.kernels.ragged import next_token_ids_ragged, prepare_inputs_ragged, valid_counts_ragged
from specdec.syncs import HostSyncError, count_host_syncs, forbid_host_sync

x = torch.arange(6)
mask = x > 2
i0 = torch.tensor(2)
idx = torch.tensor([0, 2])

SYNCING = {
    "Tensor.item": lambda: x[0].item(),
    "Tensor.tolist": lambda: x.tolist(),
    "Tensor.cpu": lambda: x.cpu(),
    "Tensor.numpy": lambda: x.numpy(),
    "Tensor.__array__": lambda: np.asarray(x),
    "Tensor.to (CPU)": lambda: x.to("cpu"),
    "Tensor.to (CPU) device=": lambda: x.to(device=torch.device("cpu")),
    "Tensor.__bool__": lambda: bool(mask[0]),
    "Tensor.__bool__ (if any)": lambda: 1 if mask.any() else 0,
    "Tensor.__bool__ (all)": lambda: bool(mask.all()),
    "Tensor.__int__": lambda: int(x[0]),
    "Tensor.__float__": lambda: float(x[0]),
    "Tensor.__index__": lambda: [1, 2, 3][i0],
    "Tensor.__format__": lambda: f"{x[0]:d}",
    "Tensor.__repr__": lambda: repr(x),
    "Tensor.__contains__": lambda: 3 in x,
    "Tensor.nonzero": lambda: x.nonzero(),
    "torch.nonzero": lambda: torch.nonzero(x),
    "torch.argwhere": lambda: torch.argwhere(x),
    "torch.where": lambda: torch.where(mask),
    "torch.masked_select": lambda: torch.masked_select(x, mask),
    "Tensor.masked_select": lambda: x.masked_select(mask),
    "Tensor.__getitem__ (bool mask)": lambda: x[mask],
    "Tensor.__getitem__ (tensor slice)": lambda: x[:i0],
    "Tensor.__setitem__": lambda: x.clone().__setitem__(mask, torch.zeros(3, dtype=x.dtype)),
    "torch.unique": lambda: torch.unique(x),
    "Tensor.unique": lambda: x.unique(),
    "torch.unique_consecutive": lambda: torch.unique_consecutive(x),
    "repeat_interleave": lambda: torch.repeat_interleave(x, x),
    "repeat_interleave (one arg)": lambda: torch.repeat_interleave(x),
    "repeat_interleave (method)": lambda: x.repeat_interleave(x),
    "torch.tensor": lambda: torch.tensor([1, 2]),
    "torch.as_tensor": lambda: torch.as_tensor([1, 2]),
    "torch.equal": lambda: torch.equal(x, x),
    "torch.allclose": lambda: torch.allclose(x.float(), x.float()),
}

NOT_SYNCING = {
    "arithmetic": lambda: (x + 1) * 2,
    "to dtype": lambda: x.to(torch.int32),
    "where with values": lambda: torch.where(mask, x, 0),
    "int tensor indexing": lambda: x[idx],
    "slice": lambda: x[1:3],
    "masked_fill by scalar setitem": lambda: x.clone().__setitem__(mask, 0),
    "repeat_interleave int": lambda: x.repeat_interleave(2),
    "repeat_interleave output_size": lambda: torch.repeat_interleave(x, x, output_size=15),
    "as_tensor of a tensor": lambda: torch.as_tensor(x),
    "any without bool": lambda: mask.any(),
    "len": lambda: len(x),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_each_syncing_op_is_forbidden(name):
    with pytest.raises(HostSyncError, match=name.split(" ")[0]):
        with forbid_host_sync():
            SYNCING[name]()


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_each_syncing_op_is_counted(name):
    with count_host_syncs() as syncs:
        SYNCING[name]()
    assert syncs.count >= 1
    assert any(name.split(" ")[0] in op for op in syncs.ops)


@pytest.mark.parametrize("name", sorted(NOT_SYNCING))
def test_non_syncing_ops_pass(name):
    with forbid_host_sync():
        NOT_SYNCING[name]()
    with count_host_syncs() as syncs:
        NOT_SYNCING[name]()
    assert syncs.count == 0


def test_guard_is_removed_after_the_block():
    with pytest.raises(HostSyncError):
        with forbid_host_sync():
            x[0].item()
    assert x[0].item() == 0
    with count_host_syncs() as syncs:
        x[0].item()
        x.tolist()
    assert syncs.ops == ["Tensor.item", "Tensor.tolist"]
    x[1].item()
    assert syncs.count == 2


@pytest.mark.parametrize("where", ["after the push", "before the pop"])
@pytest.mark.parametrize("guard", [forbid_host_sync, count_host_syncs])
def test_an_interrupt_in_the_modes_push_or_pop_leaves_no_guard(monkeypatch, guard, where):
    """Ctrl-C (a signal handler raising KeyboardInterrupt) may land inside the guard mode's
    own enter or exit: right after it pushed itself, or before it popped itself. Either
    way the guard is gone after the block (test_errors.py's ctrl-c test once left it on,
    and every later engine of that pytest worker failed its first torch.tensor)."""
    from torch.overrides import TorchFunctionMode
    from specdec import syncs

    def enter(self):
        TorchFunctionMode.__enter__(self)
        raise KeyboardInterrupt

    def exit_(self, *exc):
        raise KeyboardInterrupt

    if where == "after the push":
        monkeypatch.setattr(syncs._SyncMode, "__enter__", enter, raising=False)
    else:
        monkeypatch.setattr(syncs._SyncMode, "__exit__", exit_, raising=False)
    with pytest.raises(KeyboardInterrupt):
        with guard():
            pass
    assert torch._C._len_torch_function_stack() == 0
    assert x[0].item() == 0 and torch.tensor([1]).tolist() == [1]


def _line_tracer(code, raise_at=None):
    """(line events seen in ``code``'s frames, a sys.settrace tracer recording them that
    raises KeyboardInterrupt at event number ``raise_at``, as a signal handler may)."""
    seen = []

    def local(frame, event, arg):
        if event == "line":
            seen.append(frame.f_lineno)
            if len(seen) - 1 == raise_at:
                raise KeyboardInterrupt
        return local
    return seen, lambda frame, event, arg: local if frame.f_code is code else None


def _still_guarded() -> bool:
    try:
        with forbid_host_sync():
            x[0].item()
    except HostSyncError:
        return True
    return False


@pytest.mark.parametrize("block", ["host_side", "unguarded"])
def test_an_interrupt_entering_a_host_side_block_leaves_the_guard_on(block):
    """Ctrl-C may land on any line of ``host_side()`` / ``unguarded()`` before its body runs
    (each line in turn here). After it the guard still catches a sync: a nesting depth left
    raised would silently skip every later check of the thread."""
    import sys
    from specdec import syncs
    enter = getattr(syncs, block)
    code = enter.__wrapped__.__code__
    seen, tracer = _line_tracer(code)
    sys.settrace(tracer)
    try:
        with enter():
            before_body = len(seen)
    finally:
        sys.settrace(None)
    assert before_body >= 2
    for i in range(before_body):
        _, tracer = _line_tracer(code, raise_at=i)
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                with enter():
                    pass
        finally:
            sys.settrace(None)
        assert _still_guarded(), f"interrupted at line event {i} of {block}()"


def test_another_threads_host_side_block_leaves_this_threads_guard_on():
    """A thread inside ``host_side()`` (its tensors on the host by design) does not switch
    off the checks of a guard running on another thread."""
    import threading
    from specdec.syncs import host_side
    inside, leave = threading.Event(), threading.Event()

    def other():
        with host_side():
            inside.set()
            leave.wait(30)
    thread = threading.Thread(target=other)
    thread.start()
    try:
        assert inside.wait(30)
        assert _still_guarded()
    finally:
        leave.set()
        thread.join()


@given(b=st.integers(1, 256), k=st.integers(1, 8), seed=st.integers(0, 2**32 - 1))
def test_padded_path_runs_inside_the_guard(step_batch, b, k, seed):
    batch = step_batch(b, k, seed)
    sampled = torch.tensor(batch.sampled, dtype=torch.int32)
    discard = torch.tensor(batch.discard)
    qsl, cu, seq_lens, positions = (batch.query_start_loc, batch.cu_num_draft_tokens,
                                    batch.seq_lens, batch.positions)
    num_reqs = torch.tensor(b)
    with forbid_host_sync():
        backup = gather_backup_tokens(batch.token_table, batch.rows, seq_lens)
        next_ids, valid = prepare_next_token_ids_padded(sampled, discard, backup, batch.vocab_size)
        sample_idx, rejected = prepare_inputs_padded(cu, valid, qsl)
        shift_first_pass_input_ids(batch.target_ids, sample_idx, next_ids)
        pos, lens = positions[sample_idx.long()], seq_lens - rejected
        for _ in range(1, k):
            pos, _, _, lens = advance_draft_step(pos, lens, batch.block_table[:b], num_reqs,
                                                 batch.block_size, batch.max_model_len)


def test_ragged_path_syncs_are_counted(step_batch):
    batch = step_batch(8, 3, seed=0)
    sampled = torch.tensor(batch.sampled, dtype=torch.int32)
    with count_host_syncs() as syncs:
        rows = sampled.tolist()
        valid = valid_counts_ragged(rows, batch.discard, batch.vocab_size)
        next_token_ids_ragged(rows, batch.discard, batch.backup, batch.vocab_size)
        prepare_inputs_ragged(batch.query_start_loc, batch.seq_lens, batch.num_draft, valid)
    assert "Tensor.tolist" in syncs.ops
    assert any(op.startswith("repeat_interleave") for op in syncs.ops)
