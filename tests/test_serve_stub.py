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


def test_account_splits_a_served_token_by_part_and_process(monkeypatch, capsys):
    """``serve --stub-engine 4 --account``: after a streamed and a plain request of 8 tokens,
    GET /account counts the 16 tokens the engine emitted, each engine part (adds applied,
    steps, outputs sent) and API part (submits, pipe reads, detokenizing, the stream's JSON)
    with its calls, CPU within each process's total; POST /account/reset zeroes it."""
    import httpx

    from specdec.commands.cli import main
    from specdec.entrypoints import serve

    from helpers import ServerThread

    got = {}
    monkeypatch.setattr(serve, "serve_until_signal",
                        lambda app, sock, *a: got.update(app=app, sock=sock))
    assert main(["serve", "--stub-engine", "4", "--account", "--port", "0"]) == 0, \
        capsys.readouterr().err
    got["sock"].close()
    server = ServerThread(got["app"])
    try:
        for stream in (True, False):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json=dict(
                prompt=[100 + i for i in range(8)], max_tokens=8, ignore_eos=True,
                stream=stream))
            assert r.status_code == 200
        report = httpx.get(f"{server.url}/account").json()
        httpx.post(f"{server.url}/account/reset")
        after = httpx.get(f"{server.url}/account").json()
    finally:
        server.close()
    engine, api = report["engine"], report["api"]
    assert engine["tokens"] == 16 and after["engine"]["tokens"] == 0
    assert engine["parts"]["apply"]["calls"] == 2 and engine["parts"]["step"]["calls"] >= 4
    assert engine["parts"]["send"]["calls"] >= 4
    assert api["parts"]["submit"]["calls"] == 2 and api["parts"]["receive"]["calls"] >= 1
    assert api["parts"]["detokenize"]["calls"] >= 2 and api["parts"]["serialize"]["calls"] >= 1
    for proc in (engine, api):
        counted = sum(p["cpu_s"] for name, p in proc["parts"].items() if name != "rest")
        assert 0 < counted <= proc["cpu_s"] + 1e-6
    assert "receive" not in after["api"]["parts"]
