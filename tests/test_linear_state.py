"""The state-slot layout of ``specdec.linear_state`` and the gated delta rule: the docstrings'
worked examples, and the recurrence against transformers' chunked form."""

import pytest
import torch
from hypothesis import given, strategies as st

from specdec.attention import AttentionMetadata
from specdec.linear_state import LinearStateSpec, StateCache
from specdec.models.layers.gated_deltanet import (
    gated_delta_chunked,
    gated_delta_scan,
    l2norm,
)

SPEC = LinearStateSpec(conv_dim=4, conv_kernel=4, num_heads=1, key_dim=2, value_dim=2)


def _meta(**kw) -> AttentionMetadata:
    i32 = torch.int32
    return AttentionMetadata(slot_mapping=torch.full((6,), -1),
                             query_start_loc=torch.tensor([0, 3, 5, 6], dtype=i32),
                             seq_lens=torch.tensor([10, 2, 1], dtype=i32),
                             block_table=torch.zeros(3, 1, dtype=i32), max_seq_len=10, **kw)


def test_layout_worked_example():
    cache = StateCache([SPEC], num_rows=3, num_slots=3, device="cpu")
    cache.current[:] = torch.tensor([1, 0, 0])
    lay = cache.layout(_meta(rows=torch.tensor([0, 1, 2], dtype=torch.int32),
                             num_draft_tokens=torch.tensor([2, 0, 0], dtype=torch.int32),
                             max_query_len=3), 6)
    assert lay.token_index.tolist() == [[0, 1, 2], [3, 4, 5], [5, 5, 5]]
    assert lay.flat_to_bt.tolist() == [0, 1, 2, 3, 4, 6]
    assert lay.read.tolist() == [1, 3, 6]
    assert lay.fresh.tolist() == [False, True, True]
    assert lay.write.tolist() == [[0, 1, 2], [6, 3, 6], [6, 6, 6]]
    assert lay.valid.tolist() == [[True] * 3, [True, True, False], [True, False, False]]
    assert lay.last_write.tolist() == [2, 3, 6] and lay.num_slots == 3
    assert lay.stage_index is None  # no snapshots: nothing staged
    staging = StateCache([SPEC], num_rows=3, num_slots=3, device="cpu", snapshots=2,
                         block_size=4)
    lay = staging.layout(_meta(rows=torch.tensor([0, 1, 2], dtype=torch.int32),
                               num_draft_tokens=torch.tensor([2, 0, 0], dtype=torch.int32),
                               max_query_len=3), 6)
    assert lay.stage_index.tolist() == [0, -1, -1] and lay.stage_row.tolist() == [0, 2, 2]


def test_layout_without_rows_puts_every_request_on_the_trash_row():
    """An idle rank's dummy step (no rows, no drafts, no bound): reads and writes only the
    trash row; T is the token count."""
    cache = StateCache([SPEC], num_rows=3, num_slots=3, device="cpu")
    lay = cache.layout(_meta(), 6)
    assert lay.token_index.shape == (3, 6)
    assert set(lay.read.tolist()) <= {6, 7, 8} and set(lay.write.flatten().tolist()) <= {6, 7, 8}


def test_accept_worked_example():
    cache = StateCache([SPEC], num_rows=4, num_slots=3, device="cpu")
    cache.current[:] = 2
    cache.accept(torch.tensor([0, 1, 2], dtype=torch.int32),
                 torch.tensor([[11, 12, -1], [21, -1, -1], [-1, -1, -1]], dtype=torch.int32))
    assert cache.current.tolist() == [1, 0, 0, 2]


def test_state_bytes_per_slot():
    assert SPEC.bytes_per_slot() == 4 * (3 * 4 + 1 * 2 * 2)
    assert SPEC.bytes_per_token(torch.float16) == 0


def test_scan_and_l2norm_worked_examples():
    torch.testing.assert_close(l2norm(torch.tensor([3.0, 4.0]), eps=0.0), torch.tensor([0.6, 0.8]))
    one = torch.ones(1, 1, 1, 1)
    o, state = gated_delta_scan(one, one, 2 * one, torch.zeros(1, 1, 1),
                                torch.full((1, 1, 1), 0.5), torch.zeros(1, 1, 1, 1))
    assert o.tolist() == [[[[1.0]]]] and state.tolist() == [[[[1.0]]]]


def test_scan_equals_transformers_chunked_rule_and_its_final_state():
    """The token-by-token recurrence equals transformers' chunked gated delta rule (chunk 4,
    so 3 chunks over 10 tokens) from a random initial state, outputs and final state."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
    )

    g = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 10, 3, 8, 4
    q, k = (l2norm(torch.randn(b, t, h, dk, generator=g)) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g)
    decay = -torch.rand(b, t, h, generator=g)
    beta = torch.rand(b, t, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    seen = []
    o, last = gated_delta_scan(q * dk ** -0.5, k, v, decay, beta, state,
                               lambda j, s: seen.append(s))
    want, final = torch_chunk_gated_delta_rule(q, k, v, decay, beta, chunk_size=4,
                                               initial_state=state, output_final_state=True)
    torch.testing.assert_close(o, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, final, rtol=1e-5, atol=1e-5)
    assert len(seen) == t and seen[-1] is last


@pytest.mark.parametrize("chunk", [1, 3, 4, 64])
def test_chunked_form_equals_the_token_by_token_rule(chunk):
    """``gated_delta_chunked`` (chunks of 1, 3, 4 tokens and one of 64 over 10 tokens, the
    last chunk partial) equals the recurrence, outputs and final state; a token with
    beta = g = 0 (a padding position) leaves the state as it is."""
    g = torch.Generator().manual_seed(1)
    b, t, h, dk, dv = 2, 10, 3, 8, 4
    q, k = (l2norm(torch.randn(b, t, h, dk, generator=g)) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g)
    decay, beta = -torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g)
    decay[1, 6:], beta[1, 6:] = 0.0, 0.0  # request 1 has 6 tokens
    state = torch.randn(b, h, dk, dv, generator=g)
    want, want_state = gated_delta_scan(q, k, v, decay, beta, state)
    got, got_state = gated_delta_chunked(q, k, v, decay, beta, state, chunk)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    after_six = gated_delta_scan(q[1:, :6], k[1:, :6], v[1:, :6], decay[1:, :6],
                                 beta[1:, :6], state[1:])[1]
    torch.testing.assert_close(got_state[1:], after_six, rtol=1e-5, atol=1e-5)


@given(t=st.integers(1, 12), chunk=st.integers(1, 5), at=st.lists(st.integers(-1, 12),
                                                                  min_size=2, max_size=2),
       seed=st.integers(0, 2**16))
def test_the_chunked_forms_state_at_a_token_is_the_recurrences(t, chunk, at, seed):
    """``gated_delta_chunked(..., at=)``: the state after token at[b] of each sequence is the
    token-by-token rule's state there (its ``on_state``); the initial state where at[b] lies
    outside the tokens."""
    g = torch.Generator().manual_seed(seed)
    b, h, dk, dv = 2, 2, 4, 3
    q, k = (l2norm(torch.randn(b, t, h, dk, generator=g)) for _ in range(2))
    v = torch.randn(b, t, h, dv, generator=g)
    decay, beta = -torch.rand(b, t, h, generator=g), torch.rand(b, t, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g)
    seen = []
    gated_delta_scan(q, k, v, decay, beta, state, lambda j, st: seen.append(st))
    want = torch.stack([seen[i][j] if 0 <= i < t else state[j] for j, i in enumerate(at)])
    *_, got = gated_delta_chunked(q, k, v, decay, beta, state, chunk, at=torch.tensor(at))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
