"""Counter-based random numbers: uniform, independent across keys/counters/lanes/streams, a
pure function of its inputs, and drawn without a host sync."""

import torch

from specdec.engine import counter_rng
from specdec.engine.counter_rng import exponentials, request_key, uniforms
from specdec.graphs import compile_dynamic
from specdec.syncs import forbid_host_sync


def test_uniforms_are_uniform_and_reproducible():
    keys = torch.arange(4000, dtype=torch.int64) * 977
    counters = torch.arange(4000, dtype=torch.int64) % 13
    u = uniforms(keys, counters, stream=1, lanes=50)
    assert u.dtype == torch.float64 and u.shape == (4000, 50)
    assert bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, uniforms(keys, counters, stream=1, lanes=50))
    # chi-square over 20 equal bins (200k draws): p ~ 0.01 cut-off at 36.2 for 19 dof
    counts = torch.histc(u.flatten().float(), bins=20, min=0, max=1)
    expected = u.numel() / 20
    assert float(((counts - expected) ** 2 / expected).sum()) < 36.2
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002


def test_neighbouring_inputs_give_uncorrelated_numbers():
    keys = torch.arange(20_000, dtype=torch.int64)
    zeros = torch.zeros_like(keys)
    base = uniforms(keys, zeros, 1, 2)
    for other in (uniforms(keys + 1, zeros, 1, 2),  # next key
                  uniforms(keys, zeros + 1, 1, 2),  # next position
                  uniforms(keys, zeros, 2, 2),  # other stream
                  base[:, 1:]):  # next lane
        c = torch.corrcoef(torch.stack([base[:, 0], other[:, 0]]))[0, 1]
        assert abs(float(c)) < 0.03
    # keys and streams are not interchangeable: key k + 1 on one stream is not key k on the
    # next (sample i + 1 of a seeded n > 1 request is keyed seed + i + 1)
    for s in (1, 2):
        lanes = [uniforms(keys + d, zeros, s + d2, 4) for d, d2 in ((1, 0), (0, 1))]
        assert not bool((lanes[0] == lanes[1]).any())


def test_exponentials_have_mean_one_and_are_positive():
    e = exponentials(torch.arange(1000), torch.zeros(1000, dtype=torch.int64), 2, 200)
    assert e.dtype == torch.float32 and bool((e > 0).all())
    assert abs(float(e.mean()) - 1.0) < 0.01 and abs(float(e.var()) - 1.0) < 0.03


def test_no_host_sync():
    keys = torch.arange(8)
    with forbid_host_sync():
        counter_rng.exponentials(keys, keys, 2, 16)


def test_request_key():
    assert request_key(42, 0, "a") == 42  # a request's own seed is its key
    assert request_key(None, 0, "a") == request_key(None, 0, "a")
    assert len({request_key(None, s, r) for s in range(3) for r in "abc"}) == 9
    assert 0 <= request_key(None, 2**63 - 1, "x") < 2**63


def test_inductor_with_symbolic_sizes_draws_the_eager_numbers():
    """compile_dynamic's sampled steps: inductor's CPU kernels with the row and lane counts
    symbolic give the eager numbers bit for bit for every size (``arange(lanes) * <64-bit
    constant>`` did not: NaN exponentials past the first vector of lanes)."""
    def draw(keys, counters, like):
        return (uniforms(keys, counters, 1, like.shape[1]),
                exponentials(keys, counters, 2, like.shape[1]))

    compiled = compile_dynamic(draw, "inductor", realize_reused=True)  # as the runner's verify
    for rows, lanes in ((2, 40), (3, 2048), (5, 17), (1, 2049)):
        keys = torch.arange(rows, dtype=torch.int64) * 977 + 5
        counters = torch.arange(rows, dtype=torch.int64) + 30
        like = torch.empty(rows, lanes)
        for got, want in zip(compiled(keys, counters, like), draw(keys, counters, like)):
            assert torch.equal(got, want), (rows, lanes)
