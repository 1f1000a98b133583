import logging

import pytest
from hypothesis import given, settings, strategies as st

from specdec.dp import DPContext
from specdec.padding import (BatchDescriptor, BatchPadder, StepPlanner, StepSizes,
                             default_capture_sizes)


def test_docstring_example_sp_pads_six_to_eight_with_tp4():
    padder = BatchPadder([1, 2, 4, 8, 16], tp_size=4, sequence_parallel=True)
    assert padder.pad_for_sequence_parallel(6) == 8
    assert padder.capture_sizes == [4, 8, 16]
    assert padder.dispatch(6) == BatchDescriptor(8, graph=True)
    assert padder.dispatch(17) == BatchDescriptor(20, graph=False)


def test_dropping_unaligned_capture_sizes_warns_where_the_user_gave_them(caplog):
    with caplog.at_level(logging.WARNING):
        BatchPadder([1, 2, 4, 8], tp_size=4, sequence_parallel=True)
    assert "dropping capture sizes [1, 2]" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the defaults: no warning (each rank, each job)
        assert 1 not in BatchPadder(None, tp_size=2, sequence_parallel=True).capture_sizes
    assert "dropping" not in caplog.text


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


def planner(k=3, sizes=(1, 2, 4, 8, 16), tp=1, sp=False, mixed=False, fixed_shapes=True):
    """The runner's planner; ``fixed_shapes`` False: eager / compile_dynamic's (nothing
    captured, Np not padded to a capture size)."""
    return StepPlanner(BatchPadder(list(sizes), tp, sp), DPContext(), k,
                       allow_capture=fixed_shapes, capture_mixed=mixed,
                       pad_tokens=fixed_shapes)


def test_plan_docstring_example():
    p = planner()
    decode = p.plan(12, 3, uniform_decode=True)
    assert (decode.num_reqs_padded, decode.num_tokens_padded, decode.capturable,
            decode.uniform_decode) == (4, 16, True, True)
    mixed = p.plan(9, 2, uniform_decode=False)
    assert (mixed.num_reqs_padded, mixed.num_tokens_padded, mixed.capturable,
            mixed.uniform_decode) == (2, 16, False, False)
    assert planner(mixed=True).plan(9, 2, uniform_decode=False).capturable
    assert not planner(mixed=True).plan(40, 2, uniform_decode=False).capturable
    assert p.plan(0, 0, uniform_decode=False).all_idle


@given(k=st.integers(0, 5), b=st.integers(1, 40), extra=st.integers(0, 60),
       uniform=st.booleans(), tp=st.sampled_from([1, 2, 4]), sp=st.booleans(),
       mixed=st.booleans())
def test_a_plan_fits_its_step(k, b, extra, uniform, tp, sp, mixed):
    """Bp >= B and Np >= N; padding requests get a padding token to sample at; a capturable
    plan is the uniform [Bp, 1+K] layout in a bucket, or (capture_mixed) any step whose Np and
    Bp are both capture sizes; with SP every size is TP-aligned."""
    n = b * (1 + k) if uniform else b + extra
    plan = planner(k, tp=tp, sp=sp, mixed=mixed).plan(n, b, uniform)
    assert plan.num_reqs_padded >= b and plan.num_tokens_padded >= n
    if plan.num_reqs_padded > b:
        assert plan.num_tokens_padded > n
    sizes = (1, 2, 4, 8, 16)
    if plan.uniform_decode:
        assert uniform and plan.capturable and plan.num_reqs_padded in sizes
        assert plan.num_tokens_padded == plan.num_reqs_padded * (1 + k)
    elif plan.capturable:
        assert mixed and plan.num_reqs_padded in sizes and plan.num_tokens_padded in sizes
    else:  # eager: the step fits no capture key (or mixed steps are not captured)
        assert not mixed or plan.num_reqs_padded > 16 or plan.num_tokens_padded > 16
    if sp and tp > 1:
        assert plan.num_tokens_padded % tp == 0 and plan.num_reqs_padded % tp == 0
    assert plan.num_tokens_across_dp == (plan.num_tokens_padded,)


@given(k=st.integers(0, 8), b=st.integers(1, 40), extra=st.integers(0, 60),
       uniform=st.booleans(), tp=st.sampled_from([1, 2, 4]), sp=st.booleans())
def test_a_step_that_takes_any_shape_is_not_padded_to_a_capture_size(k, b, extra, uniform,
                                                                      tp, sp):
    """eager / compile_dynamic: Np = the tokens fed, plus one for padding requests to sample
    at, SP-aligned; nothing captured; Bp as with capture (a capture size)."""
    n = b * (1 + k) if uniform else b + extra
    plan = planner(k, tp=tp, sp=sp, fixed_shapes=False).plan(n, b, uniform)
    captured = planner(k, tp=tp, sp=sp).plan(n, b, uniform)
    assert plan.num_reqs_padded == captured.num_reqs_padded >= b
    spare = int(plan.num_reqs_padded > b)
    aligned = -(-(n + spare) // tp) * tp if sp and tp > 1 else n + spare
    assert plan.num_tokens_padded == aligned <= captured.num_tokens_padded
    assert not plan.capturable and not plan.uniform_decode


def test_step_sizes_worked_example():
    """StepSizes' docstring: capture sizes [1, 2, 4, 8], K = 3, 3 sequences, a 20-token
    budget -> Bp 4 (3 padded), Np 21 (the budget + 1 spare token, above every capture size,
    more than a uniform step's 4 x (1 + 3)); with 8 sequences the uniform step sets Np: 32."""
    sizes = StepSizes.of(BatchPadder([1, 2, 4, 8], 1, False), 3, 3, 20, 64)
    assert (sizes.max_num_reqs, sizes.max_num_tokens) == (4, 21)
    assert (sizes.num_speculative_tokens, sizes.max_num_seqs, sizes.max_model_len) == (3, 3, 64)
    assert StepSizes.of(BatchPadder([1, 2, 4, 8], 1, False), 3, 8, 20, 64).max_num_tokens == 32
