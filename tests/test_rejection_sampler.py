"""rejection_sample: greedy == a plain-Python reference, stochastic rows preserve the target
distribution (chi-square, with controls showing the test rejects wrong samplers), top-p;
vLLM's filters (target_probs) and the penalties (engine.penalties) at every draft position
against their direct computation (sampling_reference); argument checks, and no host sync."""

import pytest
import torch
from hypothesis import given, strategies as st

from specdec.engine.penalties import process_logits
from specdec.engine.rejection_sampler import rejection_sample, target_probs
from specdec.engine.runner import processed_variant
from specdec.engine.sequence import SamplingParams
from specdec.syncs import forbid_host_sync

import sampling_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def rng(b: int, seed: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, counters) giving each of b rows its own random numbers."""
    keys = torch.arange(b, dtype=torch.int64, device=device) + seed * 1_000_003
    return keys, torch.zeros(b, dtype=torch.int64, device=device)
P_MIN = 1e-3  # chi-square p-value threshold


def greedy_reference(logits: torch.Tensor, drafts: list[list[int]], num_draft: list[int]):
    """Per-request plain-Python greedy verification -> [B][K+1] ints."""
    out = []
    num_rows = logits.shape[1]
    for rows, draft, n in zip(logits.tolist(), drafts, num_draft):
        argmax = [max(range(len(row)), key=row.__getitem__) for row in rows]
        emitted = []
        for j in range(n):
            if draft[j] != argmax[j]:
                break
            emitted.append(draft[j])
        emitted.append(argmax[len(emitted)])
        out.append(emitted + [-1] * (num_rows - len(emitted)))
    return out


def make_batch(b: int, k: int, seed: int):
    """Random logits; drafts match the argmax for a random prefix, then mismatch; padding
    drafts past num_draft hold junk (-1, ids >= V)."""
    g = torch.Generator().manual_seed(seed)

    def randint(lo, hi):  # inclusive
        return int(torch.randint(lo, hi + 1, (), generator=g))

    vocab = [2, 5, 50][randint(0, 2)]
    logits = torch.randn(b, k + 1, vocab, generator=g) * 3
    argmax = logits.argmax(-1).tolist()
    drafts, num_draft = [], []
    for r in range(b):
        n = randint(0, k)
        prefix = randint(0, n)
        row = [argmax[r][j] if j < prefix else randint(0, vocab - 1) for j in range(k)]
        if prefix < n:
            row[prefix] = (argmax[r][prefix] + randint(1, vocab - 1)) % vocab
        for j in range(n, k):
            row[j] = [-1, vocab, vocab + 7, randint(0, vocab - 1)][randint(0, 3)]
        drafts.append(row)
        num_draft.append(n)
    return logits, drafts, num_draft


def check_structure(out: list[list[int]], drafts, num_draft, vocab):
    """Accepted drafts, then one token in [0, V) (never the rejected draft), then -1."""
    for row, draft, n in zip(out, drafts, num_draft):
        a = (row + [-1]).index(-1) - 1  # number of accepted drafts
        assert 0 <= a <= n and row[:a] == draft[:a]
        assert 0 <= row[a] < vocab
        if a < n:
            assert row[a] != draft[a]
        assert row[a + 1:] == [-1] * (len(row) - a - 1)


@given(b=st.integers(1, 64), k=st.integers(1, 8), seed=st.integers(0, 2**31 - 1),
       with_top_p=st.booleans())
def test_greedy_rows_match_reference_in_mixed_batch(b, k, seed, with_top_p):
    logits, drafts, num_draft = make_batch(b, k, seed)
    g = torch.Generator().manual_seed(seed)
    greedy = torch.rand(b, generator=g) < 0.5
    temperature = torch.where(greedy, 0.0, 0.3 + 2 * torch.rand(b, generator=g))
    top_p = 0.2 + 0.8 * torch.rand(b, generator=g) if with_top_p else None
    out = rejection_sample(logits, torch.tensor(drafts, dtype=torch.int32),
                           torch.tensor(num_draft, dtype=torch.int32), temperature,
                           *rng(b, seed), top_p)
    assert out.dtype == torch.int32 and out.shape == (b, k + 1)
    out = out.tolist()
    ref = greedy_reference(logits, drafts, num_draft)
    for r in range(b):
        if greedy[r]:
            assert out[r] == ref[r]
    check_structure(out, drafts, num_draft, logits.shape[2])


def one_hot_logits(argmax_rows: list[list[int]], vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(argmax_rows), vocab).float()


def test_docstring_example():
    logits = one_hot_logits([[1, 2, 3], [1, 0, 3], [2, 0, 0]], 4)
    out = rejection_sample(logits, torch.tensor([[1, 2], [1, 2], [0, 0]], dtype=torch.int32),
                           torch.tensor([2, 2, 0], dtype=torch.int32), torch.zeros(3), *rng(3))
    assert out.tolist() == [[1, 2, 3], [1, 0, -1], [2, -1, -1]]


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_all_accepted_and_all_rejected(k):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(8, k + 1, 11, generator=g)
    argmax = logits.argmax(-1).int()
    num_draft = torch.full((8,), k, dtype=torch.int32)
    out = rejection_sample(logits, argmax[:, :k], num_draft, torch.zeros(8), *rng(8))
    assert torch.equal(out, argmax)  # every draft accepted, then the bonus argmax
    out = rejection_sample(logits, (argmax[:, :k] + 1) % 11, num_draft, torch.zeros(8), *rng(8))
    expected = torch.full((8, k + 1), -1, dtype=torch.int32)
    expected[:, 0] = argmax[:, 0]  # first draft rejected, recovered argmax
    assert torch.equal(out, expected)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_out_of_vocab_draft_is_rejected(temperature):
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    out = rejection_sample(logits, torch.tensor([[-1, 0], [5, 0]], dtype=torch.int32),
                           torch.tensor([2, 2], dtype=torch.int32), torch.full((2,), temperature),
                           *rng(2))
    assert out[:, 1:].tolist() == [[-1, -1], [-1, -1]]
    assert ((out[:, 0] >= 0) & (out[:, 0] < 5)).all()


def test_same_keys_same_output_and_rows_are_independent_of_the_batch():
    logits, drafts, num_draft = make_batch(32, 4, seed=7)
    args = (logits, torch.tensor(drafts, dtype=torch.int32),
            torch.tensor(num_draft, dtype=torch.int32), torch.ones(32))
    top_p = torch.full((32,), 0.9)
    first = rejection_sample(*args, *rng(32, 3), top_p)
    again = rejection_sample(*args, *rng(32, 3), top_p)
    other = rejection_sample(*args, *rng(32, 4), top_p)
    assert torch.equal(first, again) and not torch.equal(first, other)
    keys, counters = rng(32, 3)
    later = rejection_sample(*args, keys, counters + 1, top_p)  # the next position draws anew
    assert not torch.equal(first, later)
    rows = [5, 17, 2]  # a sub-batch in another order: each row keeps its own tokens
    sub = rejection_sample(*(a[rows] for a in args), keys[rows], counters[rows], top_p[rows])
    assert torch.equal(sub, first[rows])


# ---- distribution preservation -------------------------------------------------------------

N = 20_000
VOCAB = 6
T = 0.8
LOGITS = torch.tensor([[1.0, 0.5, -0.3, 0.2, 1.2, -1.0],   # row 0: verifies draft 0
                       [0.0, 1.5, 0.3, -0.5, 0.8, 0.1],    # row 1: draft 1 or bonus
                       [0.4, -0.2, 1.1, 0.0, 0.3, 0.9]])   # row 2: bonus when K=2
P = torch.softmax(LOGITS.double() / T, dim=-1)
DRAFTS = [0, 4]


def chi_square_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of integer samples to probs; a sample outside
    the support (probs == 0) fails outright."""
    counts = torch.bincount(samples.long(), minlength=len(probs)).double()
    assert len(counts) == len(probs), "sample outside the vocabulary"
    support = probs > 0
    assert counts[~support].sum() == 0, "sample outside the support"
    counts, probs = counts[support], probs[support]
    expected = counts.sum() * probs
    stat = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(df, stat / 2))


def sample_identical(num_draft: int, top_p=None, drafts=DRAFTS, seed=0):
    k = len(drafts)
    logits = LOGITS[: k + 1].expand(N, k + 1, VOCAB)
    top_p = None if top_p is None else torch.full((N,), top_p)
    return rejection_sample(logits, torch.tensor(drafts, dtype=torch.int32).expand(N, k),
                            torch.full((N,), num_draft, dtype=torch.int32), torch.full((N,), T),
                            *rng(N, seed), top_p)


@pytest.mark.parametrize("num_draft", [0, 1, 2])
def test_first_token_follows_target_distribution(num_draft):
    out = sample_identical(num_draft)
    assert chi_square_pvalue(out[:, 0], P[0]) > P_MIN
    if num_draft == 0:
        assert (out[:, 1:] == -1).all()


def test_chi_square_rejects_wrong_samplers():
    """The same test fails for a sampler that ignores rejection, or resamples from p."""
    d, p_d = DRAFTS[0], P[0, DRAFTS[0]]
    always_accept = torch.full((N,), d)
    assert chi_square_pvalue(always_accept, P[0]) < P_MIN
    # Wrong recovery: on rejection draw from p instead of the residual (p - q)+.
    g = torch.Generator().manual_seed(0)
    accepted = torch.rand(N, generator=g, dtype=torch.float64) < p_d
    resampled = torch.multinomial(P[0], N, replacement=True, generator=g)
    assert chi_square_pvalue(torch.where(accepted, d, resampled), P[0]) < P_MIN


@pytest.mark.parametrize("num_draft", [1, 2])
def test_second_token_given_acceptance_follows_target(num_draft):
    """Given draft 0 accepted, position 1 is draft 1 verified against p1 (num_draft=2) or
    the bonus from p1 (num_draft=1): either way distributed as p1."""
    out = sample_identical(num_draft)
    accepted = out[:, 0] == DRAFTS[0]
    assert accepted.sum() > N * 0.15
    assert chi_square_pvalue(out[accepted, 1], P[1]) > P_MIN
    assert (out[~accepted, 1] == -1).all()
    if num_draft == 2:  # bonus after both drafts accepted
        both = accepted & (out[:, 1] == DRAFTS[1])
        assert chi_square_pvalue(out[both, 2], P[2]) > P_MIN


def nucleus(probs: list[float], top_p: float) -> list[int]:
    """Plain-Python top-p: most likely tokens until their mass reaches top_p."""
    kept, mass = [], 0.0
    for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if mass >= top_p:
            break
        kept.append(token)
        mass += probs[token]
    return kept


@pytest.mark.parametrize("drafts", [[4, 1], [3, 1]])  # draft 0 inside / outside the nucleus
def test_top_p_stays_in_nucleus_and_preserves_distribution(drafts):
    top_p = 0.6
    out = sample_identical(num_draft=2, top_p=top_p, drafts=drafts)
    for j in range(3):
        keep = nucleus(P[j].tolist(), top_p)
        assert 1 < len(keep) < VOCAB
        col = out[:, j]
        assert torch.isin(col[col >= 0], torch.tensor(keep)).all()
    keep = nucleus(P[0].tolist(), top_p)
    filtered = torch.zeros(VOCAB, dtype=torch.float64)
    filtered[keep] = P[0, keep] / P[0, keep].sum()
    assert chi_square_pvalue(out[:, 0], filtered) > P_MIN
    if drafts[0] not in keep:  # p(d) = 0 after filtering: always rejected
        assert (out[:, 1] == -1).all()


def test_a_top_p_that_rounds_to_zero_keeps_the_most_likely_token():
    """top_p 1e-50 is 0 in float32: the filter kept no token, and the row drew token 0."""
    from specdec.engine.rejection_sampler import target_probs
    logits = torch.randn(3, 2, VOCAB, generator=torch.Generator().manual_seed(0))
    for top_p in (1e-50, 1e-9):
        probs = target_probs(logits, torch.ones(3), torch.full((3,), top_p))
        want = torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float()
        assert torch.equal(probs, want), top_p


# ---- argument checks and host syncs --------------------------------------------------------

def valid_args(b=3, k=2, vocab=5):
    return dict(target_logits=torch.zeros(b, k + 1, vocab),
                draft_token_ids=torch.zeros(b, k, dtype=torch.int32),
                num_draft_tokens=torch.zeros(b, dtype=torch.int32),
                temperature=torch.zeros(b), keys=torch.zeros(b, dtype=torch.int64),
                counters=torch.zeros(b, dtype=torch.int64), top_p=torch.ones(b))


@pytest.mark.parametrize("field, bad", [
    ("target_logits", torch.zeros(3, 5)),
    ("target_logits", torch.zeros(3, 3, 5, dtype=torch.int64)),
    ("target_logits", torch.zeros(3, 0, 5)),
    ("draft_token_ids", torch.zeros(3, 3, dtype=torch.int32)),  # K inconsistent with logits
    ("draft_token_ids", torch.zeros(2, 2, dtype=torch.int32)),
    ("draft_token_ids", torch.zeros(3, 2)),
    ("num_draft_tokens", torch.zeros(3, 1, dtype=torch.int32)),
    ("num_draft_tokens", torch.zeros(3, dtype=torch.bool)),
    ("temperature", torch.zeros(4)),
    ("temperature", torch.zeros(3, dtype=torch.int32)),
    ("top_p", torch.ones(2)),
    ("top_p", torch.ones(3, dtype=torch.int64)),
    ("keys", torch.zeros(3)),
    ("counters", torch.zeros(4, dtype=torch.int64)),
])
def test_bad_arguments_raise_value_error_naming_the_field(field, bad):
    args = valid_args()
    args[field] = bad
    with pytest.raises(ValueError, match=field):
        rejection_sample(**args)


def test_non_tensor_argument_raises_type_error():
    args = valid_args()
    args["temperature"] = [0.0, 0.0, 0.0]
    with pytest.raises(TypeError, match="temperature"):
        rejection_sample(**args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_top_p", [False, True])
def test_no_host_sync(device, with_top_p):
    logits, drafts, num_draft = make_batch(16, 4, seed=1)
    args = (logits.to(device), torch.tensor(drafts, dtype=torch.int32).to(device),
            torch.tensor(num_draft, dtype=torch.int32).to(device),
            torch.tensor([0.0, 1.0] * 8).to(device), *rng(16, 0, device),
            torch.full((16,), 0.7).to(device) if with_top_p else None)
    with forbid_host_sync():
        out = rejection_sample(*args)
    check_structure(out.tolist(), drafts, num_draft, logits.shape[2])


# ---- vLLM's filters (min_p, top_k, top_p) and the penalties, under speculation ---------------

def test_target_probs_docstring_example():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().view(1, 1, 4)
    one = torch.ones(1)

    def probs(**kw):
        return target_probs(logits, one, **{k: torch.tensor([v]) for k, v in kw.items()})[0, 0]
    torch.testing.assert_close(probs(top_k=3), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)
    for kw in (dict(min_p=0.5), dict(top_p=0.6), dict(top_k=3, top_p=0.8)):
        torch.testing.assert_close(probs(**kw), torch.tensor([0.625, 0.375, 0, 0]))


@given(vocab=st.integers(1, 12), rows=st.integers(1, 3), seed=st.integers(0, 2**31 - 1),
       data=st.data())
def test_target_probs_equal_vllms_filters_computed_directly(vocab, rows, seed, data):
    """temperature, then min_p, top_k (ties kept: logits on a coarse grid tie often), top_p
    over what is left: the distribution equals the plain-Python one at every row, with the
    vocabulary sorted and (no top_p) with the k-th largest from a topk of W >= every top_k
    (the runner's processed_top<W>)."""
    g = torch.Generator().manual_seed(seed)
    b = 4
    logits = (torch.randint(-6, 7, (b, rows, vocab), generator=g) / 2).float()
    partial = data.draw(st.booleans())  # no top_p, small top_ks: the runner's topk of W
    top_ps, most = ([1.0], max(1, vocab // 3)) if partial else ([1.0, 0.9, 0.5, 0.05], vocab + 1)
    params = [SamplingParams(temperature=data.draw(st.sampled_from([0.3, 1.0, 1.7])),
                             top_p=data.draw(st.sampled_from(top_ps)),
                             top_k=data.draw(st.one_of(st.just(0), st.integers(1, most))),
                             min_p=data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0])))
              for _ in range(b)]
    column = lambda name, dtype: torch.tensor([getattr(p, name) for p in params], dtype=dtype)
    temperature, top_k = column("temperature", torch.float32), column("top_k", torch.int64)
    calls = [(column("top_p", torch.float32), top_k, None)]
    variant = processed_variant(params, vocab)  # the runner's topk of W: no top_p, top_k <= W
    if "_top" in variant:
        calls.append((None, top_k, int(variant[len("processed_top"):])))
    for top_p, top_k, width in calls:
        got = target_probs(logits, temperature, top_p, top_k, column("min_p", torch.float32),
                           width)
        for i, p in enumerate(params):
            for j in range(rows):
                want = sampling_reference.probs(logits[i, j].tolist(), p)
                torch.testing.assert_close(got[i, j], torch.tensor(want, dtype=torch.float32),
                                           rtol=1e-5, atol=1e-6)


def test_processed_variant_sorts_what_the_requests_rank():
    p = SamplingParams
    assert processed_variant([p(temperature=1.0, repetition_penalty=1.2)], 100) == "processed"
    assert processed_variant([p(temperature=1.0, top_k=40), p(temperature=1.0, top_k=50),
                              p(temperature=1.0)], 100) == "processed_top64"
    assert processed_variant([p(temperature=1.0, top_k=40), p(temperature=1.0, top_k=50,
                                                              top_p=0.9)],
                             100) == "processed_sorted"  # top_p sorts the vocabulary
    assert processed_variant([p(temperature=1.0, top_k=70)], 100) == "processed_sorted"
    assert processed_variant([p(top_p=0.5), p(temperature=1.0, min_p=0.2)], 100) == \
        "processed"  # a greedy request's filters change nothing


def processed_sample(logits, drafts, params, table, first, num_prompt, seed=0):
    """process_logits then rejection_sample for N identical rows (one request's step N times,
    each with its own random key)."""
    n, k = logits.shape[0], drafts.shape[1]
    p = params
    full = lambda v, dtype=torch.float32: torch.full((n,), v, dtype=dtype)
    stop = torch.full((n, 16), -1, dtype=torch.int32)
    held = p.min_tokens_stop_ids(())
    stop[:, :len(held)] = torch.tensor(held or [-1], dtype=torch.int32)[:len(held)]
    processed = process_logits(
        logits, drafts, table, torch.zeros(n, dtype=torch.int64), full(first, torch.int64),
        full(num_prompt, torch.int64), full(num_prompt + p.min_tokens, torch.int64), stop,
        full(p.repetition_penalty), full(p.frequency_penalty), full(p.presence_penalty))
    return rejection_sample(processed, drafts, full(k, torch.int32), full(p.temperature),
                            *rng(n, seed), full(p.top_p), full(p.top_k, torch.int64),
                            full(p.min_p))


SETTINGS = [SamplingParams(temperature=0.8, repetition_penalty=1.7, top_k=4),
            SamplingParams(temperature=1.0, frequency_penalty=0.9, presence_penalty=0.5,
                           min_p=0.15),
            SamplingParams(temperature=1.2, min_tokens=3, stop_token_ids=[5], top_p=0.8,
                           presence_penalty=-0.8)]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("params", SETTINGS, ids=["rep+top_k", "freq+pres+min_p",
                                                  "min_tokens+top_p+pres"])
def test_processed_distribution_is_kept_at_every_draft_position(params, k):
    """Each position j, given drafts 0..j-1 accepted, is distributed as vLLM's processed
    target distribution with those drafts counted (chi-square against the direct
    computation), the bonus after all K too; not as the one without them counted (the
    control). Draft j is row j's most likely token (with the drafts before it counted), so
    every position is reached often."""
    prompt, output = [2, 3], [5]  # known tokens: the table's row 0
    table = torch.tensor([prompt + output + [-1] * 6], dtype=torch.int32)
    rows_logits = LOGITS.tolist() + [[0.3, 1.1, -0.4, 0.9, 0.6, 0.2]]
    logits = torch.tensor(rows_logits[:k + 1]).expand(N, k + 1, VOCAB)
    chosen = []
    for j in range(k):
        chosen.append(sampling_reference.argmax(sampling_reference.probs(
            sampling_reference.process(rows_logits[j], prompt, output + chosen, params), params)))
    drafts = torch.tensor(chosen, dtype=torch.int32).expand(N, k)
    out = processed_sample(logits, drafts, params, table, 3, 2, seed=k)
    given_prefix = torch.ones(N, dtype=torch.bool)
    for j in range(k + 1):
        want = sampling_reference.probs(sampling_reference.process(
            rows_logits[j], prompt, output + drafts[0, :j].tolist(), params), params)
        assert given_prefix.sum() > 300, j
        assert chi_square_pvalue(out[given_prefix, j], torch.tensor(want)) > P_MIN, j
        if j < k:
            given_prefix &= out[:, j] == drafts[0, j]
    wrong = sampling_reference.probs(sampling_reference.process(  # drafts not counted
        rows_logits[1], prompt, output, params), params)
    first_accepted = out[:, 0] == drafts[0, 0]
    assert chi_square_pvalue(out[first_accepted, 1], torch.tensor(wrong)) < P_MIN


def test_a_penalty_changes_the_argmax_at_a_later_draft_position_greedy():
    """Greedy with a frequency penalty: the target's raw argmax is 1 at both rows and the
    drafts are [1, 1]; draft 0 is accepted, and row 1 (draft 0 counted) prefers 2, so draft 1 is
    rejected and 2 emitted -- what plain decoding with the penalty emits."""
    logits = torch.tensor([[[0.0, 2.0, 1.5], [0.0, 2.0, 1.5], [0.0, 2.0, 1.5]]])
    p = SamplingParams(frequency_penalty=1.0)
    table = torch.tensor([[0, -1, -1, -1, -1]], dtype=torch.int32)
    out = processed_sample(logits, torch.tensor([[1, 1]], dtype=torch.int32), p, table, 1, 1)
    assert out.tolist() == [[1, 2, -1]]
    raw = rejection_sample(logits, torch.tensor([[1, 1]], dtype=torch.int32),
                           torch.tensor([2], dtype=torch.int32), torch.zeros(1), *rng(1))
    assert raw.tolist() == [[1, 1, 1]]  # unprocessed: every draft accepted
