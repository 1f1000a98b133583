"""specdec.engine.penalties: min_tokens and the repetition / frequency / presence penalties at
every verified position equal vLLM's, computed directly per position (sampling_reference), with
each position counting the drafts before it; neutral rows come back bit for bit; no host sync."""

import pytest
import torch
from hypothesis import given, strategies as st

from specdec.engine.penalties import process_logits
from specdec.engine.sequence import SamplingParams
from specdec.syncs import forbid_host_sync

import sampling_reference as ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run(*args, **kw) -> torch.Tensor:
    """process_logits over one batch whose request b has params[b] (``inputs``)."""
    return process_logits(*inputs(*args, **kw))


def inputs(logits, drafts, table, rows, first, num_prompt, params, eos=(), device="cpu"):
    """process_logits' arguments for a batch whose request b has params[b], on ``device``."""
    b = len(params)
    stop = torch.full((b, 16), -1, dtype=torch.int32)
    for i, p in enumerate(params):
        ids = p.min_tokens_stop_ids(eos)
        stop[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32) if ids else stop[i, :0]
    f32 = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)
    args = [logits, drafts, table, rows, first, num_prompt,
            num_prompt + torch.tensor([p.min_tokens for p in params]), stop,
            f32("repetition_penalty"), f32("frequency_penalty"), f32("presence_penalty")]
    return [a.to(device) for a in args]


def test_docstring_example():
    table = torch.tensor([[1, 2, 2, -1, -1, -1]], dtype=torch.int32)
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = run(torch.ones(1, 3, 4), torch.tensor([[3, 0]]), table, torch.tensor([0]),
              torch.tensor([3]), torch.tensor([1]), [p])
    assert out.tolist() == [[[1.0, 0.5, -0.75, 1.0], [1.0, 0.5, -0.75, -0.25],
                             [-0.25, 0.5, -0.75, -0.25]]]


@st.composite
def batches(draw):
    """A step's requests: prompt and output tokens in token-table rows (in any order, spare
    rows of junk), drafts (junk past num_draft, ids outside the vocabulary), settings."""
    vocab, k = draw(st.integers(2, 9)), draw(st.integers(0, 3))
    b = draw(st.integers(1, 4))
    width = 12
    table = torch.full((b + 2, width), -1, dtype=torch.int32)
    table[b:] = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=width,
                                           max_size=width)), dtype=torch.int32)
    rows = draw(st.permutations(range(b + 2)))[:b]
    tok = st.integers(0, vocab - 1)
    reqs = []
    for i in range(b):
        prompt = draw(st.lists(tok, min_size=1, max_size=5))
        output = draw(st.lists(tok, max_size=width - 1 - len(prompt)))
        known = prompt + output
        table[rows[i], :len(known)] = torch.tensor(known, dtype=torch.int32)
        if draw(st.booleans()):  # tokens past the known ones (a later step's) are not read
            table[rows[i], len(known):] = draw(tok)
        drafts = draw(st.lists(st.one_of(tok, st.sampled_from([-1, vocab, vocab + 3])),
                               min_size=k, max_size=k))
        params = SamplingParams(
            max_tokens=20, repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.4, -1.5, 2.0])),
            presence_penalty=draw(st.sampled_from([0.0, 0.7, -0.3])),
            min_tokens=draw(st.integers(0, 5)),
            stop_token_ids=draw(st.lists(tok, max_size=2)))
        reqs.append((prompt, output, drafts, params))
    logits = torch.tensor(draw(st.lists(st.floats(-4, 4, width=32), min_size=b * (k + 1) * vocab,
                                        max_size=b * (k + 1) * vocab))).view(b, k + 1, vocab)
    return vocab, k, table, torch.tensor(rows), reqs, logits


@given(batch=batches(), eos=st.sampled_from([(), (0,), (1, 0)]))
def test_every_position_equals_vllms_direct_computation(batch, eos):
    vocab, k, table, rows, reqs, logits = batch
    eos = tuple(t for t in eos if t < vocab)
    prompts, outputs, drafts, params = zip(*reqs)
    first = torch.tensor([len(p) + len(o) for p, o in zip(prompts, outputs)])
    got = run(logits, torch.tensor(drafts).view(len(reqs), k), table, rows, first,
              torch.tensor([len(p) for p in prompts]), params, eos)
    for i, (prompt, output, draft, p) in enumerate(reqs):
        for j in range(k + 1):  # row j counts drafts 0..j-1 (the rows a valid draft reaches)
            if any(not 0 <= d < vocab for d in draft[:j]):
                continue  # after an invalid draft: never used
            want = ref.process(logits[i, j].tolist(), prompt, output + draft[:j], p, eos)
            torch.testing.assert_close(got[i, j], torch.tensor(want, dtype=torch.float32),
                                       rtol=1e-6, atol=1e-6)


def test_a_penalty_at_a_later_draft_position_counts_the_drafts_before_it():
    """Row 1's argmax is draft 0's token until draft 0 is counted: then another token wins."""
    logits = torch.tensor([[[0.0, 2.0, 1.5], [0.0, 2.0, 1.5]]])
    table = torch.tensor([[0, 0, -1, -1]], dtype=torch.int32)
    p = SamplingParams(frequency_penalty=1.0)
    out = run(logits, torch.tensor([[1]]), table, torch.tensor([0]), torch.tensor([2]),
              torch.tensor([1]), [p])
    assert out.argmax(-1).tolist() == [[1, 2]]  # row 0: 1 (no output yet); row 1: 2


def test_neutral_rows_come_back_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 7, generator=g) * 5
    table = torch.randint(0, 7, (3, 10), generator=g, dtype=torch.int32)
    out = run(logits, torch.randint(0, 7, (3, 3), generator=g), table, torch.arange(3),
              torch.tensor([6, 9, 3]), torch.tensor([2, 2, 1]), [SamplingParams()] * 3, (0,))
    assert torch.equal(out, logits)


@pytest.mark.parametrize("device", DEVICES)
def test_no_host_sync(device):
    p = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, min_tokens=3)
    table = torch.tensor([[1, 2, 3, -1], [2, 2, -1, -1]], dtype=torch.int32)
    args = (torch.randn(2, 3, 5), torch.tensor([[1, 4], [0, 0]]), table, torch.tensor([1, 0]),
            torch.tensor([2, 3]), torch.tensor([1, 2]), [p, p], (4,))
    want = run(*args)
    on_device = inputs(*args, device=device)
    with forbid_host_sync():
        got = process_logits(*on_device)
    assert torch.equal(got.cpu(), want)
