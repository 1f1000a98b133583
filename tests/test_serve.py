"""``specdec serve`` over real HTTP (uvicorn in a thread, or a subprocess), with the official
``openai`` client and raw ``httpx``; and ``specdec bench serve --launch --quick``."""

import asyncio
import gc
import json
import logging
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from specdec.bench import serve as bench_serve
from specdec.engine.llm import LLM
from specdec.entrypoints.serve import build_server_app

from helpers import ServerThread, metrics

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):",
           "for i in range(10):"]
MAX_MODEL_LEN = 128
NAME = "specdec-test"


def serve(llm, **kw) -> ServerThread:
    return ServerThread(build_server_app(llm, NAME, **kw))


@pytest.fixture(scope="module")
def server():
    """The module's shared server: EAGLE-3 K=3 padded on the embedded model."""
    llm = LLM(speculative_config={"method": "eagle3", "num_speculative_tokens": 3},
              max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    s = serve(llm)
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


# ---- correctness -------------------------------------------------------------------------------
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "ragged"])
@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3", "ngram"])
def test_greedy_completions_equal_generate(method, padded):
    spec = {"method": method, "num_speculative_tokens": 3, "disable_padded_drafter_batch": not padded}
    kw = dict(speculative_config=spec, dtype=torch.float64, max_model_len=MAX_MODEL_LEN)
    expected = [o.token_ids for o in LLM(**kw).generate(PROMPTS, max_tokens=24)]
    s = serve(LLM(**kw))
    try:
        c = openai.AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)

        async def one(prompt):
            r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=24,
                                           temperature=0, extra_body={"return_token_ids": True})
            return r.choices[0].model_extra["token_ids"]

        async def all_at_once():
            return await asyncio.gather(*(one(p) for p in PROMPTS))

        assert asyncio.run(all_at_once()) == expected
    finally:
        s.close()


@pytest.mark.parametrize("method", ["eagle3", "ngram"])
def test_per_request_spec_decode_metrics_equal_the_engines_counts(method):
    """--per-request-spec-decode-metrics summary: each response (a stream: the chunk that
    ends it) carries metrics.speculative_decoding with the drafted / accepted / step counts
    LLM.generate reports for the same request; the histogram of accepted drafts per step
    adds up to the steps and, weighted, to the accepted drafts. Off by default."""
    k = 3
    kw = dict(speculative_config={"method": method, "num_speculative_tokens": k},
              dtype=torch.float64, max_model_len=MAX_MODEL_LEN)
    want = LLM(**kw).generate(PROMPTS, max_tokens=24, ignore_eos=True)
    s = serve(LLM(**kw), per_request_spec_metrics=True)
    plain = serve(LLM(**kw))
    try:
        for prompt, o in zip(PROMPTS, want):
            body = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                    "ignore_eos": True}
            got = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
            m = got["metrics"]["speculative_decoding"]
            assert (m["num_spec_tokens"], m["num_spec_steps"], m["num_draft_tokens"],
                    m["num_accepted_draft_tokens"]) == (
                k, o.num_decode_steps, sum(o.num_drafted), sum(o.num_accepted))
            assert m["mean_acceptance_length"] == pytest.approx(o.acceptance_length)
            hist = m["acceptance_histogram"]
            assert len(hist) == k + 1 and sum(hist) == m["num_spec_steps"]
            assert sum(j * n for j, n in enumerate(hist)) == m["num_accepted_draft_tokens"]
            with httpx.stream("POST", f"{s.url}/v1/completions", json={**body, "stream": True},
                              timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: {")]
            assert [e.get("metrics") for e in events] == [None] * (len(events) - 1) + [
                got["metrics"]]
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert "metrics" not in httpx.post(f"{plain.url}/v1/completions", json=body,
                                               timeout=60).json()
        assert sum(sum(o.num_accepted) for o in want) > 0
    finally:
        s.close()
        plain.close()


def test_a_request_seed_gives_the_same_sample_under_concurrent_load(client, server):
    """temperature 1, the same seed: the same tokens, whatever else the server is running;
    the seed is what decides (another seed gives another sample)."""
    async def one(seed, prompt=PROMPTS[0]):
        c = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        r = await c.completions.create(model=NAME, prompt=prompt, max_tokens=32, seed=seed,
                                       temperature=1.0, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    async def with_load():
        return await asyncio.gather(one(5), *(one(None, p) for p in PROMPTS))

    alone = asyncio.run(one(5))
    assert asyncio.run(with_load())[0] == alone
    assert asyncio.run(one(6)) != alone


def test_stream_concatenates_to_the_text(client):
    kw = dict(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text != ""
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 40


def test_chat_stream_concatenates_to_the_message(client):
    kw = dict(model=NAME, messages=[{"role": "user", "content": "def add(a, b):"}],
              max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kw)
    parts = [c.choices[0].delta.content or "" for c in
             client.chat.completions.create(**kw, stream=True) if c.choices]
    assert "".join(parts) == whole.choices[0].message.content != ""
    assert whole.choices[0].message.role == "assistant"


def test_stop_strings_and_stop_token_ids(client):
    base = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                     extra_body={"return_token_ids": True})
    text, ids = base.choices[0].text, base.choices[0].model_extra["token_ids"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                    stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    by_id = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=40,
                                      temperature=0, extra_body={"stop_token_ids": [ids[5]],
                                                                 "return_token_ids": True})
    assert by_id.choices[0].model_extra["token_ids"] == ids[:ids.index(ids[5]) + 1]
    assert by_id.choices[0].finish_reason == "stop"


def test_64_concurrent_streams_complete_with_usage(server):
    lengths = [4 + (7 * i) % 29 for i in range(64)]
    prompts = [[(31 * i + j) % 2000 + 1 for j in range(3 + i % 40)] for i in range(64)]

    async def one(http, prompt, n):
        body = dict(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True, stream=True,
                    return_token_ids=True, stream_options={"include_usage": True})
        tokens, usage, reason = 0, None, None
        async with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                usage = event["usage"] or usage
                for ch in event["choices"]:
                    tokens += len(ch["token_ids"])
                    reason = ch["finish_reason"] or reason
        return tokens, usage, reason

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=70)) as h:
            return await asyncio.gather(*(one(h, p, n) for p, n in zip(prompts, lengths)))

    for (tokens, usage, reason), p, n in zip(asyncio.run(main()), prompts, lengths):
        assert tokens == n and reason == "length"
        assert usage == {"prompt_tokens": len(p), "completion_tokens": n,
                         "total_tokens": len(p) + n}


def wait_until_idle(url: str) -> dict:
    """/metrics once no request runs or waits (30 s at most)."""
    deadline = time.monotonic() + 30
    while True:
        now = metrics(url)
        if now["specdec:num_requests_running"] == 0 and now["specdec:num_requests_waiting"] == 0:
            return now
        assert time.monotonic() < deadline, "the aborted request is still in the engine"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_the_blocks(server):
    allocator = server.app.state.engine.llm.allocator
    start = metrics(server.url)
    assert start["specdec:kv_cache_free_blocks"] == len(allocator.free)
    body = dict(prompt=PROMPTS[0], max_tokens=100, temperature=0, ignore_eos=True, stream=True)
    with httpx.Client(timeout=60) as h, h.stream("POST", f"{server.url}/v1/completions",
                                                 json=body) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metrics(server.url)["specdec:num_requests_running"] == 1
    now = wait_until_idle(server.url)
    assert now["specdec:kv_cache_free_blocks"] == start["specdec:kv_cache_free_blocks"]
    assert len(allocator.free) == start["specdec:kv_cache_free_blocks"]
    key = 'specdec:request_success_total{"finished_reason": "abort"}'
    assert now[key] == start.get(key, 0) + 1
    assert now["specdec:generation_tokens_total"] < start["specdec:generation_tokens_total"] + 100


@pytest.fixture(scope="module")
def long_server():
    """Plain decoding up to 1024 positions: a 1000-token reply takes seconds."""
    s = serve(LLM(max_model_len=1024, max_num_seqs=2))
    yield s
    s.close()


@pytest.mark.parametrize("n", [1, 2])
def test_a_client_gone_before_its_reply_aborts_quietly(long_server, caplog, n):
    """A non-streamed request whose client goes away (here: its read timeout) is aborted,
    every choice, and the server logs no error for it (the cancelled choices' gather was
    left unread: asyncio logged "exception was never retrieved" with a traceback)."""
    url = long_server.url
    start = metrics(url)
    body = dict(prompt=PROMPTS[0], max_tokens=1000, ignore_eos=True, n=n, temperature=0.5)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=body, timeout=0.3)
    now = wait_until_idle(url)
    gc.collect()
    key = 'specdec:request_success_total{"finished_reason": "abort"}'
    assert now[key] == start.get(key, 0) + n
    assert now["specdec:kv_cache_free_blocks"] == start["specdec:kv_cache_free_blocks"]
    assert now["specdec:generation_tokens_total"] < start["specdec:generation_tokens_total"] + 900
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_a_client_gone_before_its_body_arrived_is_no_server_error(server, caplog, path):
    """A client that sends its headers and part of its body, then closes the connection:
    nothing is queued and uvicorn logs no "Exception in ASGI application" (starlette's
    ClientDisconnect was unhandled); the server goes on serving."""
    import socket

    uvicorn_log = logging.getLogger("uvicorn.error")  # uvicorn's own: it does not propagate
    uvicorn_log.addHandler(caplog.handler)
    try:
        start = metrics(server.url)
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as c:
            c.sendall(f"POST /v1/{path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\"".encode())
            time.sleep(0.2)  # the server is reading the body
        time.sleep(0.3)  # and sees the disconnect
        assert httpx.get(f"{server.url}/health").json()["waiting"] == 0
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    now = metrics(server.url)
    assert now["specdec:kv_cache_free_blocks"] == start["specdec:kv_cache_free_blocks"]


def test_the_engine_keeps_no_step_history(server, client):
    """A server steps forever: ``LLM.steps`` (the offline record of every step) stays empty."""
    llm = server.app.state.engine.llm
    before = metrics(server.url)["specdec:step_seconds_count"]
    client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    assert metrics(server.url)["specdec:step_seconds_count"] > before
    assert llm.steps == []


# ---- errors ------------------------------------------------------------------------------------
TOO_LONG = list(range(1, MAX_MODEL_LEN + 1))
BAD = [  # (path, body, param named)
    ("completions", b"{not json", None),
    ("completions", b"[1, 2]", None),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": [99999]}, "prompt"),
    ("completions", {"prompt": TOO_LONG, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("completions", {"prompt": "x", "temperature": 2.5}, "temperature"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "x", "seed": 1.5}, "seed"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ("completions", {"prompt": "x", "stop": 7.5}, "stop"),
    ("completions", {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "n": 2, "temperature": 0}, "n"),  # greedy: n=1, as vLLM
    ("completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": -1}, "max_completion_tokens"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_field(server, path, body, param):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/{path}", headers={"Content-Type": "application/json"}, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400
    assert err["param"] == param
    assert (param or "JSON").split(".")[0] in err["message"]


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="x", temperature=9)


def test_unknown_model_is_404(server):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_engine_error_fails_that_step_only(server, client):
    runner = server.app.state.engine.llm.runner
    kw = dict(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0)
    before = client.completions.create(**kw).choices[0].text
    execute = runner.execute

    def broken(batch):
        runner.execute = execute  # fail exactly one step
        raise RuntimeError("injected device fault")

    runner.execute = broken
    r = httpx.post(f"{server.url}/v1/completions", json=kw, timeout=60)
    assert r.status_code == 500 and "injected device fault" in r.json()["error"]["message"]
    assert client.completions.create(**kw).choices[0].text == before  # still serving, same text


# ---- the other endpoints -----------------------------------------------------------------------
def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


def test_metrics_parse_and_count(server, client):
    client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=16, temperature=0)
    m = metrics(server.url)
    for name in ("specdec:num_requests_running", "specdec:num_requests_waiting",
                 "specdec:generation_tokens_total", "specdec:step_seconds_count",
                 "specdec:spec_decode_num_drafts_total", "specdec:host_syncs_total",
                 "specdec:spec_decode_mean_acceptance_length"):
        assert name in m
    drafted = [m[f'specdec:spec_decode_num_draft_tokens_per_pos_total{{"position": "{j}"}}']
               for j in range(3)]
    accepted = [m[f'specdec:spec_decode_num_accepted_tokens_per_pos_total{{"position": "{j}"}}']
                for j in range(3)]
    assert all(0 <= a <= d for a, d in zip(accepted, drafted)) and sum(accepted) > 0
    assert m["specdec:spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + m["specdec:spec_decode_num_accepted_tokens_total"]
        / m["specdec:spec_decode_num_drafts_total"])
    assert m["specdec:host_syncs_total"] == 0  # padded


# ---- subprocesses: SIGTERM, and the endpoint harness -------------------------------------------
def test_sigterm_lets_the_running_request_finish():
    proc, url = bench_serve.launch(["--method", "none", "--max-model-len", "128"])
    try:
        result = {}

        def stream():
            body = dict(prompt="x = ", max_tokens=120, temperature=0, ignore_eos=True,
                        stream=True, stream_options={"include_usage": True})
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                result["lines"] = [line for line in r.iter_lines() if line]

        t = threading.Thread(target=stream)
        t.start()
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["running"] == 0:
            assert t.is_alive(), "the request ended before SIGTERM could reach it mid-stream"
            assert time.monotonic() < deadline, "the request never started running"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # a graceful stop is a success

        t.join(10)
        assert result["lines"][-1] == "data: [DONE]"
        assert json.loads(result["lines"][-2][6:])["usage"]["completion_tokens"] == 120
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bench_serve_launch_quick(tmp_path):
    """Poisson arrivals on a server with the replay backend: prefill chunks join decodes, and
    every step (all fit a capture key here) replays a graph, as /metrics reports."""
    run = subprocess.run([sys.executable, "-m", "specdec.commands.cli", "bench", "serve",
                          "--launch", "--quick", "--repeats", "2", "--graph-backend", "replay",
                          "--request-rate", "50", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads((tmp_path / "results.json").read_text())
    assert r["schema_version"] == bench_serve.SCHEMA_VERSION and r["kind"] == "endpoint"
    assert {"itl", "itl_chunk", "ttft", "tpot", "e2e"} <= set(r["definitions"])
    assert [c["concurrency"] for c in r["configs"]] == [1, 4]
    for name in r["plots"]:
        assert (tmp_path / name).stat().st_size > 0
    for c in r["configs"]:
        s = c["summary"]
        assert {"itl_ms", "itl_chunk_ms", "tpot_ms", "ttft_ms", "e2e_ms"} <= set(s)
        assert s["acceptance_length"] > 1 and len(s["per_position_acceptance_rate"]) == 3
        assert s["output_tokens"] == 2 * c["concurrency"] * 32
        assert s["num_steps"] > 0 and s["captured_share"] == 1.0
        for rep in c["repeats"]:
            assert len(rep["requests"]) == c["concurrency"]
            for q in rep["requests"]:
                assert q["output_tokens"] == sum(q["chunk_tokens"]) == 32
                assert len(q["itl_ms"]) == 32 - q["chunk_tokens"][0]
                assert sum(q["itl_ms"]) == pytest.approx(q["e2e_ms"] - q["ttft_ms"], rel=1e-9)
