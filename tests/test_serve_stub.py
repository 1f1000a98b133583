"""``specdec serve --stub-engine``: the served-path benchmark's core at a tiny size."""

import pytest
from rich.console import Console

from benchmarks import bench_served_stub as stub_bench
from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.engine_loop import EngineLoop
from specdec.entrypoints.stub_engine import StubLLM

pytest.importorskip("uvicorn")


def test_stub_server_streams_exact_chunks_and_counts_cpu():
    """4 requests of 8 tokens at 2 streams, 4 tokens per step: every stream gets its two
    steps' tokens ([4, 4], or [8] merged), with the client in this process and split over 2
    forked ones."""
    prompts = [[100 + i] * 16 for i in range(4)]
    with stub_bench.stub_server(4, 2, 32) as (url, pids):
        body = stub_bench.stream_body(url, 8)
        rows = [stub_bench.measure(url, body, prompts, 2, pids, procs) for procs in (1, 2)]
    for row in rows:
        assert (row["requests"], row["tokens"]) == (4, 4 * 8)
        for rec in row["records"]:
            assert rec["output_tokens"] == 8
            # one chunk per stub step, or whole steps merged when the handler lagged
            assert [n for _, n in rec["chunks"]] in ([4, 4], [8])
        assert row["tokens_per_s"] > 0
        assert row["steps"] >= 4  # /metrics counted the engine's steps (2 per request)
        assert set(row["cpu_s"]) == {"engine", "api", "client"}
        assert all(v >= 0 for v in row["cpu_s"].values()) and row["cpu_s"]["client"] > 0
    assert [row["client_procs"] for row in rows] == [1, 2]
    console = Console(width=200, record=True)
    console.print(stub_bench.table(rows, 4))
    assert "steps/s" in console.export_text()


def test_stub_llm_under_the_engine_loop():
    """Prompt ids echoed N per step, finished at max_tokens ("length"), aborts honoured."""
    llm = StubLLM.from_kwargs(4, dict(model=None, max_num_seqs=1, max_model_len=64))
    core = EngineLoop(llm)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    core.add("a", [5, 6, 7], params)
    core.add("b", [8, 9], params)
    out = core.step()
    assert [(u.request_id, u.token_ids, u.finish_reason) for u in out.updates] == [
        ("a", [5, 6, 7, 5], None)]
    assert (out.running, out.waiting) == (1, 1)  # max_num_seqs=1: b waits
    [u] = core.step().updates
    assert (u.token_ids, u.finish_reason, u.stats.num_accepted) == ([6, 7], "length", [2, 2, 2])
    assert core.abort("b").finish_reason == "abort" and not core.has_work()
