"""The Triton kernels (kernels/triton_padded.py) against their torch reference, on CPU
under the Triton interpreter, and one compiled kernel for every batch size."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

pytest.importorskip("triton")

import specdec.kernels as kernels
from specdec import platform
from specdec.kernels import reference
from triton_interpret import compile_cache_keys, launch_args, load_interpreted


TP = load_interpreted("triton_padded")
KERNELS = [TP._prepare_inputs_kernel, TP._shift_left_kernel,
           TP._scatter_kernel, TP._advance_draft_step_kernel, TP._padded_step_kernel]
FEW = settings(max_examples=25)


def i32(x):
    return torch.tensor(x, dtype=torch.int32)


def randint(gen, low, high, shape, dtype=torch.int32):
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


def assert_same(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert torch.equal(a, b), (a, b)


def test_kernels_are_interpreted():
    from triton.runtime.interpreter import InterpretedFunction
    assert all(isinstance(k, InterpretedFunction) for k in KERNELS)


def test_dispatch_rule():
    assert not platform.triton_available(torch.device("cpu"))
    assert platform.triton_available(torch.device("cuda"))  # triton is installed here
    with pytest.raises(ValueError, match="device='npu:0' needs torch_npu"):
        platform.torch_device("npu:0")  # no torch_npu here
    # CPU runs the reference, which takes any int dtype; the Triton wrapper takes int32.
    cu, valid, qsl = torch.tensor([2, 4]), torch.tensor([3, 1]), torch.tensor([0, 3, 6])
    sample_idx, _ = kernels.prepare_inputs_padded(cu, valid, qsl)
    assert sample_idx.tolist() == [2, 3]
    with pytest.raises(TypeError, match="cu_num_draft_tokens.dtype=torch.int64"):
        TP.prepare_inputs_padded(cu, valid, qsl)


@FEW
@given(b=st.integers(0, 140), k=st.integers(0, 5), vocab=st.sampled_from([1, 5, 1000]),
       rows_int64=st.booleans(), seed=st.integers(0, 2**16))
def test_padded_step_equals_reference_on_arbitrary_rows(b, k, vocab, rows_int64, seed):
    """Arbitrary sampled rows (valid entries not only as a prefix, ids at and past the
    vocab edge), a row-strided token table, seq_lens at and past its end."""
    gen = torch.Generator().manual_seed(seed)
    sampled = randint(gen, -2, vocab + 2, (b, k + 1))
    discard = randint(gen, 0, 2, (b,)).bool()
    num_rows, length = b + 2, 7
    table = randint(gen, -1, vocab, (num_rows, length + 3))[:, :length]
    rows = randint(gen, 0, num_rows, (b,), torch.int64 if rows_int64 else torch.int32)
    seq_lens = randint(gen, 0, length + 3, (b,))
    cu = randint(gen, 0, k + 1, (b,)).cumsum(0).to(torch.int32)
    qsl = torch.cat([i32([0]), randint(gen, 1, k + 3, (b,)).cumsum(0).to(torch.int32)])
    args = (sampled, discard, table, rows, seq_lens, cu, qsl, vocab)
    expected = reference.prepare_padded_step(*args, out=reference.PaddedPrep.empty(b, "cpu"))
    got = TP.prepare_padded_step(*args, out=reference.PaddedPrep.empty(b, "cpu"))
    for a, e in zip(got, expected):
        assert_same(a, e)


@FEW
@given(b=st.integers(1, 40), k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_prepare_inputs_equals_reference_on_step_batches(step_batch, b, k, seed):
    """Realistic steps (conftest.make_step_batch): sample indices from the valid counts."""
    s = step_batch(b, k, seed)
    backup = reference.gather_backup_tokens(s.token_table, s.rows, s.seq_lens)
    _, valid = reference.prepare_next_token_ids_padded(
        torch.tensor(s.sampled, dtype=torch.int32), torch.tensor(s.discard), backup,
        s.vocab_size)
    expected = reference.prepare_inputs_padded(s.cu_num_draft_tokens, valid, s.query_start_loc)
    got = TP.prepare_inputs_padded(s.cu_num_draft_tokens, valid, s.query_start_loc)
    for a, e in zip(got, expected):
        assert_same(a, e)


def test_worked_example_padded_step():
    args = (i32([[11, 12, 13], [21, -1, -1], [31, 32, -1], [41, -1, -1]]),
            torch.tensor([False, False, False, True]), i32([[99] * 6]),
            torch.zeros(4, dtype=torch.int64), i32([2, 5, 8, 5]), i32([2, 4, 6, 6]),
            i32([0, 3, 6, 9, 14]), 100)
    for impl in (kernels.prepare_padded_step, TP.prepare_padded_step):
        out = kernels.PaddedPrep.empty(4, "cpu")
        assert impl(*args, out=out) is out
        assert [t.tolist() for t in out] == [[13, 21, 32, 99], [3, 1, 2, 0], [99, 99, -1, 99],
                                             [2, 3, 7, 13], [0, 2, 1, 0]]


@FEW
@given(b=st.integers(1, 300), k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_padded_step_equals_reference_on_step_batches(step_batch, b, k, seed):
    """Realistic steps (conftest.make_step_batch) across several 128-row programs; the
    outputs are written into the given buffers (pre-filled with junk)."""
    s = step_batch(b, k, seed)
    args = (torch.tensor(s.sampled, dtype=torch.int32), torch.tensor(s.discard),
            s.token_table, s.rows, s.seq_lens, s.cu_num_draft_tokens, s.query_start_loc,
            s.vocab_size)
    expected = reference.prepare_padded_step(*args, out=reference.PaddedPrep.empty(b, "cpu"))
    out = reference.PaddedPrep(*(torch.full((b,), -7, dtype=torch.int32) for _ in range(5)))
    got = TP.prepare_padded_step(*args, out=out)
    for a, e, o in zip(got, expected, out):
        assert a is o
        assert_same(a, e)


@FEW
@given(b=st.integers(0, 300), k=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_prepare_inputs_equals_reference(b, k, seed):
    gen = torch.Generator().manual_seed(seed)
    # cu is a view one past a junk entry: the kernel must not read cu[-1] for row 0
    cu = torch.cat([i32([10**6]), randint(gen, 0, k + 1, (b,)).cumsum(0, dtype=torch.int32)])[1:]
    valid = randint(gen, 0, k + 2, (b,))
    qsl = torch.cat([i32([0]), randint(gen, 1, 8, (b,)).cumsum(0, dtype=torch.int32)])
    expected = reference.prepare_inputs_padded(cu, valid, qsl)
    for a, e in zip(TP.prepare_inputs_padded(cu, valid, qsl), expected):
        assert_same(a, e)


@FEW
@given(n=st.integers(0, 2100), b_frac=st.floats(0, 1), ids_int64=st.booleans(),
       index_int64=st.booleans(), seed=st.integers(0, 2**16))
def test_shift_equals_reference(n, b_frac, ids_int64, index_int64, seed):
    """N across several 1024-token programs, B across several 128-row programs."""
    gen = torch.Generator().manual_seed(seed)
    ids = randint(gen, 0, 2**31 - 1, (n,), torch.int64 if ids_int64 else torch.int32)
    b = min(n, int(b_frac * 300))
    index = torch.randperm(n, generator=gen)[:b]
    index = index if index_int64 else index.to(torch.int32)
    next_ids = randint(gen, 0, 2**31 - 1, (b,))
    assert_same(TP.shift_first_pass_input_ids(ids, index, next_ids),
                reference.shift_first_pass_input_ids(ids, index, next_ids))


@FEW
@given(rows=st.integers(0, 300), block_size=st.sampled_from([1, 2, 4, 16]),
       max_model_len=st.integers(1, 80), short_table=st.booleans(),
       num_reqs_kind=st.sampled_from(["int", "int32", "int64"]), seed=st.integers(0, 2**16))
def test_advance_draft_step_equals_reference(rows, block_size, max_model_len, short_table,
                                             num_reqs_kind, seed):
    """Three chained steps from positions around max_model_len; padding rows; a block
    table with too few blocks for max_model_len (the reference clamps the lookup)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-max_model_len // block_size) - (1 if short_table else 0)
    table = randint(gen, -1, 10_000, (rows + 1, max(blocks, 1) + 2))[:, :max(blocks, 1)]
    positions = randint(gen, 0, max_model_len + 3, (rows,), torch.int64)
    seq_lens = randint(gen, 1, 100, (rows,))
    num_reqs = int(randint(gen, 0, rows + 1, ()))
    if num_reqs_kind != "int":
        num_reqs = torch.tensor(num_reqs, dtype=getattr(torch, num_reqs_kind))
    for _ in range(3):
        expected = reference.advance_draft_step(positions, seq_lens, table, num_reqs,
                                                block_size, max_model_len)
        got = TP.advance_draft_step(positions, seq_lens, table, num_reqs, block_size,
                                    max_model_len)
        for a, e in zip(got, expected):
            assert_same(a, e)
        positions, seq_lens = got.positions, got.seq_lens


def test_wrappers_check_their_inputs():
    with pytest.raises(ValueError, match="block_table.stride"):
        TP.advance_draft_step(torch.zeros(2, dtype=torch.int64), i32([1, 1]),
                              torch.zeros(4, 2, dtype=torch.int32).t(), 2, 4, 8)
    with pytest.raises(ValueError, match="next_token_ids.device=meta"):
        TP.shift_first_pass_input_ids(torch.zeros(4, dtype=torch.int64), i32([1]),
                                      torch.zeros(1, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="out has 2 rows and query_start_loc 2; need 2 and 3"):
        TP.prepare_padded_step(torch.zeros(2, 3, dtype=torch.int32),
                               torch.zeros(2, dtype=torch.bool), i32([[1]]), i32([0, 0]),
                               i32([0, 0]), i32([0, 0]), i32([0, 0]), 10,
                               out=reference.PaddedPrep.empty(2, "cpu"))
    with pytest.raises(ValueError, match="query_start_loc.shape"):
        TP.prepare_inputs_padded(i32([1, 2]), i32([1, 1]), i32([0, 2]))


# ---- no recompilation per batch size ----

def _launchers():
    gen = torch.Generator().manual_seed(0)
    table = randint(gen, -1, 50, (300, 9))
    return [
        (TP._prepare_inputs_kernel, lambda b: TP.prepare_inputs_padded(
            torch.arange(b, dtype=torch.int32), torch.ones(b, dtype=torch.int32),
            torch.arange(b + 1, dtype=torch.int32))),
        (TP._shift_left_kernel, lambda b: TP.shift_first_pass_input_ids(
            torch.arange(b, dtype=torch.int64), torch.arange(b, dtype=torch.int32),
            torch.arange(b, dtype=torch.int32))),
        (TP._scatter_kernel, lambda b: TP.shift_first_pass_input_ids(
            torch.arange(b, dtype=torch.int64), torch.arange(b, dtype=torch.int32),
            torch.arange(b, dtype=torch.int32))),
        (TP._advance_draft_step_kernel, lambda b: TP.advance_draft_step(
            torch.arange(b), torch.ones(b, dtype=torch.int32), table, b, 4, 30)),
        (TP._advance_draft_step_kernel, lambda b: TP.advance_draft_step(
            torch.arange(b), torch.ones(b, dtype=torch.int32), table, torch.tensor(b), 4, 30)),
        (TP._padded_step_kernel, lambda b: TP.prepare_padded_step(
            randint(gen, -1, 50, (b, 4)), torch.zeros(b, dtype=torch.bool), table,
            torch.arange(b), randint(gen, 0, 10, (b,)), torch.arange(b, dtype=torch.int32),
            torch.arange(b + 1, dtype=torch.int32), 50, out=reference.PaddedPrep.empty(b, "cpu"))),
    ]


@pytest.mark.parametrize("case", range(6))
def test_one_compiled_kernel_for_every_batch_size(case):
    kernel, launch = _launchers()[case]
    calls = launch_args(kernel, launch, [1, 2, 16, 17, 64, 129])
    assert len(set(compile_cache_keys(kernel, calls))) == 1
    # Control: with triton's default specialization (B == 1, B % 16 == 0) the same
    # launches would compile more than once.
    assert len(set(compile_cache_keys(kernel, calls, do_not_specialize=None))) > 1
