import logging

import pytest
from hypothesis import given, settings, strategies as st

from specdec.padding import BatchDescriptor, BatchPadder, default_capture_sizes


def test_docstring_example_sp_pads_six_to_eight_with_tp4():
    padder = BatchPadder([1, 2, 4, 8, 16], tp_size=4, sequence_parallel=True)
    assert padder.pad_for_sequence_parallel(6) == 8
    assert padder.capture_sizes == [4, 8, 16]
    assert padder.dispatch(6) == BatchDescriptor(8, graph=True)
    assert padder.dispatch(17) == BatchDescriptor(20, graph=False)


def test_dropping_unaligned_capture_sizes_warns(caplog):
    with caplog.at_level(logging.WARNING):
        BatchPadder([1, 2, 4, 8], tp_size=4, sequence_parallel=True)
    assert "dropping capture sizes [1, 2]" in caplog.text


def test_default_capture_sizes_match_vllm_shape():
    sizes = default_capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and 248 in sizes and 256 in sizes and 272 in sizes
    assert sizes[-1] == 512 and sizes == sorted(sizes)


@settings(deadline=None, max_examples=200)
@given(n=st.integers(0, 700), tp=st.integers(1, 8), sp=st.booleans(),
       sizes=st.lists(st.integers(1, 300), min_size=1, max_size=10))
def test_dispatch_is_smallest_aligned_size_at_least_n(n, tp, sp, sizes):
    padder = BatchPadder(sizes, tp_size=tp, sequence_parallel=sp)
    desc = padder.dispatch(n)
    assert desc.num_tokens >= n and padder.is_aligned(desc.num_tokens)
    if desc.graph:
        assert desc.num_tokens in padder.capture_sizes
        assert all(s < n for s in padder.capture_sizes if s < desc.num_tokens)
    else:
        assert all(s < n for s in padder.capture_sizes)
        assert desc.num_tokens - n < (tp if sp else 1)
    assert padder.dispatch(desc.num_tokens) == desc  # re-dispatch of a synced size is stable


@pytest.mark.parametrize("kwargs,field", [({"tp_size": 0}, "tensor_parallel_size"),
                                          ({"capture_sizes": [0, 4]}, "capture_sizes")])
def test_bad_padder_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        BatchPadder(**kwargs)
