"""benchmarks/bench_sampling: the verification rows (plain sampled vs penalties + top-k) run and
the table reads them; the engine rows' step selection (uniform decodes only)."""

from benchmarks import bench_sampling


def test_verify_rows_and_the_table():
    rows = bench_sampling.verify_rows(1, (64,), b=2, k=1, width=9)
    assert [(v, b) for v, b, *_ in rows] == [(64, 2)]
    assert all(s > 0 and p > 0 for *_, s, p in rows)
    out = bench_sampling.table("t", ("vocab", "B"), [(64, 2, 0.5, 0.75)])
    assert out.splitlines()[-1] == "| 64 | 2 | 0.50 | 0.75 | 1.50x |"


def test_decode_ms_reads_the_uniform_decode_steps():
    from specdec import LLM

    llm = LLM(max_model_len=64, max_num_seqs=2)
    ms = bench_sampling.decode_ms(llm, bench_sampling.PROCESSED, 2, 5)
    decodes = [s for s in llm.steps if s.num_reqs == 2 and s.num_tokens == 2]
    assert len(decodes) == 4  # 5 tokens: the prefill's, then 4 decodes; the first is skipped
    assert ms == 1000 * sorted(s.seconds for s in decodes[1:])[1]  # the median of 3
