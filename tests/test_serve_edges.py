"""``specdec serve`` edge cases over real HTTP (issue 22, server items): big bodies off the
event loop and 413, inputs that used to be 500s, OpenAI fields refused or accepted, the
admission limit, the acceptance gauge, /tokenize and /detokenize, SIGTERM under load."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.bench import serve as bench_serve
from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.serve import build_server_app

from benchmarks.bench_served_stub import engine_pid
from helpers import ServerThread, exited, held_steps, metrics

MAX_MODEL_LEN = 128
MAX_NUM_SEQS = 4
NAME = "specdec-edges"


@pytest.fixture(scope="module")
def server():
    llm = LLM(speculative_config={"method": "eagle3", "num_speculative_tokens": 3},
              max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)
    s = ServerThread(build_server_app(llm, NAME, max_waiting=2))
    yield s
    s.close()


def post(server, path, body, **kw):
    kw = {"content": body} if isinstance(body, (bytes, str)) else {"json": body}
    return httpx.post(f"{server.url}{path}", headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def assert_400(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split(".")[0] in err["message"], err
    return err


# ---- 1: big requests ---------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", ["def f(x):\n    return x\n" * 200_000, [1.5] * 1_000_000],
                         ids=["5MB-text", "1M-floats"])
def test_a_huge_prompt_leaves_health_answering(server, prompt):
    """While a 5 MB body is handled, /health answers within 0.5 s; the 400 is short."""
    body = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
    assert len(body) > 4_000_000
    result = {}
    t = threading.Thread(target=lambda: result.update(r=post(server, "/v1/completions", body)))
    worst = 0.0
    with httpx.Client(timeout=10) as h:
        t.start()
        while t.is_alive():
            start = time.monotonic()
            assert h.get(f"{server.url}/health").status_code == 200
            worst = max(worst, time.monotonic() - start)
            time.sleep(0.02)
    t.join()
    assert worst < 0.5, f"/health took {worst:.2f} s"
    err = assert_400(result["r"], "prompt")
    assert "max_model_len=128" in err["message"] and len(result["r"].content) < 1000


def test_a_body_over_the_limit_is_413(server):
    app = server.app
    app.state.max_request_bytes = 1000
    try:
        r = post(server, "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 1})
        # no Content-Length: the limit holds while the body is read
        chunked = httpx.post(f"{server.url}/v1/completions", content=iter([b"{", b" " * 3000]))
    finally:
        app.state.max_request_bytes = 16 * 2**20
    for resp in (r, chunked):
        assert resp.status_code == 413, resp.text
        assert "--max-request-bytes" in resp.json()["error"]["message"]
        assert "1000 bytes" in resp.json()["error"]["message"]


def test_errors_echo_only_a_short_prefix_of_the_input(server):
    r = post(server, "/v1/completions", {"prompt": [1.5] * 100, "max_tokens": 1})
    assert_400(r, "prompt")
    assert len(r.content) < 400 and "(100 items)" in r.text


# ---- 2: what used to be a 500 ------------------------------------------------------------------
BECAME_400 = [
    ("/v1/completions", '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}", "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "seed": -' + "9" * 5000 + "}", "seed"),
    ("/v1/completions", '{"max_tokens": 2, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
     "prompt"),
    ("/v1/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "messages"),
    ("/v1/completions", '{"prompt": "abc\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "abc\\ud800"}]}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "\\udc00"}]}]}', "messages.0.content"),
    ("/v1/completions", '{"prompt": "x", "stop": ["\\ud800"]}', "stop"),
]


@pytest.mark.parametrize("path,body,param", BECAME_400, ids=[
    "int-5000-digits", "negative-int-5000-digits", "nested-100000", "chat-nested-100000",
    "surrogate-prompt", "surrogate-chat", "surrogate-content-part", "surrogate-stop"])
def test_former_500s_are_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    err = assert_400(r, param)
    assert len(r.content) < 1000
    assert any(word in err["message"] for word in ("digits", "deep", "surrogate")), err


# ---- 3: OpenAI fields --------------------------------------------------------------------------
REFUSED = [
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True},
     "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages.0.content"),
]
CHAT = {"messages": [{"role": "user", "content": "x"}]}
BAD_LOGPROBS = [  # (path, body, field, what the message says)
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs", "0 <= logprobs <= 20"),
    ("/v1/completions", {"prompt": "x", "logprobs": True}, "logprobs", "take an int"),
    ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs", "a chat field"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs",
     "0 <= prompt_logprobs <= 20"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 2}, "logprobs", "true or false"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 3}, "top_logprobs", "logprobs=true"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 30}, "top_logprobs",
     "<= 20"),
]


@pytest.mark.parametrize("path,body,param,says", BAD_LOGPROBS)
def test_bad_logprob_fields_are_400_naming_the_field(server, path, body, param, says):
    err = assert_400(post(server, path, body), param)
    assert says in err["message"], err


@pytest.mark.parametrize("path,body,param", REFUSED, ids=[b[2] for b in REFUSED][:-1] + ["image"])
def test_unimplemented_fields_are_refused_by_name(server, path, body, param):
    err = assert_400(post(server, path, body), param)
    assert "not supported" in err["message"] or "'text'" in err["message"], err


def test_no_op_values_and_nulls_are_accepted(server):
    """The values that change nothing are fine, and null means the default."""
    base = {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0}
    want = post(server, "/v1/completions", base).json()["choices"][0]["text"]
    for extra in ({"logprobs": None, "echo": False, "best_of": 1, "n": None}, {"logprobs": False},
                  {"top_p": None, "stop": None, "presence_penalty": 0, "logit_bias": {}}):
        r = post(server, "/v1/completions", {**base, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
    # temperature null is OpenAI's default (1.0): a seeded sample equals temperature 1
    seeded = {"prompt": "def f(x):", "max_tokens": 6, "seed": 3, "return_token_ids": True}
    one = post(server, "/v1/completions", {**seeded, "temperature": 1.0}).json()
    null = post(server, "/v1/completions", {**seeded, "temperature": None}).json()
    assert null["choices"][0]["token_ids"] == one["choices"][0]["token_ids"]


def test_chat_content_parts_equal_the_joined_string(server):
    parts = [{"type": "text", "text": "def add(a, b):"}, {"type": "text", "text": "# sum"}]
    body = {"max_tokens": 6, "temperature": 0}
    as_parts = post(server, "/v1/chat/completions",
                    {**body, "messages": [{"role": "user", "content": parts}]})
    as_str = post(server, "/v1/chat/completions",
                  {**body, "messages": [{"role": "user", "content": "def add(a, b):\n# sum"}]})
    assert as_parts.status_code == 200, as_parts.text
    assert as_parts.json()["choices"][0]["message"] == as_str.json()["choices"][0]["message"]
    assert as_parts.json()["usage"] == as_str.json()["usage"]


def test_top_p_that_rounds_to_zero_is_greedy(server):
    """top_p <= 1/vocab keeps only the top token: served as greedy, not a stop at once."""
    body = {"prompt": "def f(x):", "max_tokens": 8, "return_token_ids": True,
            "ignore_eos": True}
    greedy = post(server, "/v1/completions", {**body, "temperature": 0}).json()
    for top_p in (1e-50, 1e-6):
        r = post(server, "/v1/completions", {**body, "temperature": 1, "top_p": top_p,
                                             "seed": 1}).json()
        assert r["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"]
        assert r["usage"]["completion_tokens"] == 8
    r = post(server, "/v1/completions", {**body, "temperature": 1, "top_p": 1e-9, "n": 2})
    assert r.status_code == 200, r.text  # each of the n samples is the top token
    assert [c["token_ids"] for c in r.json()["choices"]] == [
        greedy["choices"][0]["token_ids"]] * 2


def test_usage_counts_each_prompt_once_whatever_n(server):
    """OpenAI and vLLM count a prompt's tokens once however many samples share it."""
    for path, base in (("/v1/completions", {"prompt": ["def f(x):", "import os"]}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "def f(x):"}]})):
        body = {**base, "max_tokens": 3, "ignore_eos": True, "temperature": 1.0, "seed": 0}
        one = post(server, path, body).json()["usage"]
        for stream in (False, True):
            extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
            r = post(server, path, {**body, "n": 3, **extra})
            got = (json.loads(r.text.split("data: ")[-2])["usage"] if stream
                   else r.json()["usage"])
            assert got["prompt_tokens"] == one["prompt_tokens"], (path, stream)
            assert got["completion_tokens"] == 3 * one["completion_tokens"], (path, stream)


def test_stream_options_without_stream_and_more_samples_than_admitted_are_400(server):
    assert_400(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                "stream_options": {"include_usage": True}}),
               "stream_options")
    # 4 rows + 2 waiting: a request of 7 samples could never be admitted (not a 503 to retry)
    err = assert_400(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 7,
                                                      "temperature": 1.0}), "n")
    assert "at most 6 at once" in err["message"]
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "n": 6,
                                         "temperature": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 6


def test_a_request_the_engine_fails_alone_is_answered_and_released(server):
    """A step that fails one request (``EngineCore._update``: e.g. extract_hidden_states
    cannot write its file; here a fault injected once) finishes it with reason "error" and
    no tokens: its client gets a 500 with the error, its place is freed, and the server goes
    on serving (it once waited for tokens that never came)."""
    engine = server.app.state.engine
    core = engine.llm.core
    apply = core._apply

    def fails_once(*args):
        core._apply = apply
        raise OSError("injected: cannot write the file")
    core._apply = fails_once
    try:
        r = post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4})
    finally:
        core._apply = apply
    assert r.status_code == 500 and "injected: cannot write the file" in r.text, r.text
    assert len(engine._handles) == 0 and not engine.llm.has_unfinished()
    assert post(server, "/v1/completions", {"prompt": "def f(x):", "max_tokens": 4}
                ).status_code == 200


# ---- 5: admission --------------------------------------------------------------------------------
@pytest.mark.parametrize("max_waiting", [2, 0])
def test_a_burst_admits_exactly_the_batch_plus_max_waiting(server, max_waiting):
    """Steps are held until the whole burst has been answered or admitted, so the count does
    not depend on timing: max_num_seqs + max_waiting get 200, the rest 503."""
    engine = server.app.state.engine
    engine.max_waiting = max_waiting
    statuses, refusals = [], []

    def one():
        r = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        statuses.append(r.status_code)
        if r.status_code == 503:
            refusals.append(r.json()["error"]["message"])

    threads = [threading.Thread(target=one) for _ in range(10)]
    try:
        with held_steps(engine.llm):
            for t in threads:
                t.start()
            admitted = MAX_NUM_SEQS + max_waiting
            deadline = time.monotonic() + 30
            while statuses.count(503) < 10 - admitted or len(engine._handles) < admitted:
                assert time.monotonic() < deadline, (statuses, len(engine._handles))
                time.sleep(0.01)
    finally:
        for t in threads:
            t.join(60)
        engine.max_waiting = 2
    assert sorted(statuses) == [200] * admitted + [503] * (10 - admitted)
    assert f"max_waiting={max_waiting}" in refusals[0] and "max_num_seqs=4" in refusals[0]


def test_idle_server_with_max_waiting_0_serves(server):
    engine = server.app.state.engine
    engine.max_waiting = 0
    try:
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    finally:
        engine.max_waiting = 2
    assert r.status_code == 200, r.text


# ---- 6: the gauge --------------------------------------------------------------------------------
def test_acceptance_gauge_equals_its_counters(server):
    for p in ("def f(x):", "import os\n", "class A:"):
        post(server, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
    text = httpx.get(f"{server.url}/metrics").text
    m = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    drafts = m["specdec:spec_decode_num_drafts_total"]
    assert drafts > 0
    assert m["specdec:spec_decode_mean_acceptance_length"] == pytest.approx(
        1 + m["specdec:spec_decode_num_accepted_tokens_total"] / drafts, rel=1e-12)


def test_a_request_ended_by_a_stop_string_carries_its_spec_decode_metrics(server):
    """--per-request-spec-decode-metrics summary: a request that ends on a stop string (the
    server aborts it in the engine) carries metrics.speculative_decoding too, streamed or
    not: the engine's counts at one of its steps from the one whose text reached the stop
    string on (the abort lands between steps), before it would have ended by length, as the
    same request stepped alone in a reference LLM counts them."""
    ref, prompt = LLM(speculative_config={"method": "eagle3", "num_speculative_tokens": 3},
                      max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS), "def f(x):"
    req = ref.add_request(ref.tokenizer.encode(prompt).ids,
                          SamplingParams(max_tokens=40, ignore_eos=True))
    states = []  # (text, steps, drafted, accepted) after each step
    while ref.step() is not None:
        states.append((ref.tokenizer.decode(req.output_token_ids), req.num_steps_decoding,
                       sum(req.num_drafted), sum(req.num_accepted)))
    full, third = states[-1][0], len(states[len(states) // 3][0])
    at = next(i for i in range(third, len(full)) if full.find(full[i:i + 3]) == i)
    stop = full[at:at + 3]  # first seen a third of the way in
    reached = next(j for j, st in enumerate(states) if stop in st[0])
    allowed = [st[1:] for st in states[reached:-1]]
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stop": [stop]}
    server.app.state.model.per_request_spec_metrics = True
    try:
        got = post(server, "/v1/completions", body).json()
        with httpx.stream("POST", f"{server.url}/v1/completions",
                          json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
    finally:
        server.app.state.model.per_request_spec_metrics = False
    assert got["choices"][0]["text"] == full[:at]
    assert got["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("metrics" not in e for e in events[:-1])
    for m in (got["metrics"]["speculative_decoding"],
              events[-1]["metrics"]["speculative_decoding"]):
        assert (m["num_spec_steps"], m["num_draft_tokens"],
                m["num_accepted_draft_tokens"]) in allowed, (m, allowed)
        assert sum(m["acceptance_histogram"]) == m["num_spec_steps"]


# ---- 16: /tokenize, /detokenize ----------------------------------------------------------------
def test_tokenize_detokenize_round_trip(server):
    text = "def fibonacci(n):\n    return n"
    tok = post(server, "/tokenize", {"model": NAME, "prompt": text, "return_token_strs": True})
    assert tok.status_code == 200, tok.text
    out = tok.json()
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) > 0
    assert out["max_model_len"] == MAX_MODEL_LEN
    served = post(server, "/v1/completions", {"prompt": text, "max_tokens": 1,
                                              "return_token_ids": True}).json()
    assert served["choices"][0]["prompt_token_ids"] == out["tokens"]
    back = post(server, "/detokenize", {"model": NAME, "tokens": out["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    used = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1}).json()
    assert chat["count"] == used["usage"]["prompt_tokens"]
    assert_400(post(server, "/detokenize", {"tokens": [10**6]}), "tokens")
    assert_400(post(server, "/tokenize", {"prompt": 5}), "prompt")
    assert post(server, "/tokenize", {"prompt": "x", "model": "gpt-9"}).status_code == 404


# ---- 4: SIGTERM under load -------------------------------------------------------------------
def open_streams(url: str, n: int) -> tuple[list[threading.Thread], list]:
    """n streamed 120-token requests in threads, all running in the engine on return;
    results[i] gets stream i's non-empty SSE lines once it ends."""
    results = [None] * n

    def stream(i):
        body = dict(prompt=[5 + i, 6, 7], max_tokens=120, temperature=0, ignore_eos=True,
                    stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            results[i] = [line for line in r.iter_lines() if line]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health").json()["running"] < n:
        assert all(t.is_alive() for t in threads), "a stream ended before all were running"
        assert time.monotonic() < deadline, "the streams never all ran"
        time.sleep(0.01)
    return threads, results


def test_sigterm_under_load_exits_0_and_ends_every_stream():
    """Streams still running when --shutdown-timeout ends get finish_reason "abort" and
    [DONE]; the process exits 0."""
    proc, url = bench_serve.launch(["--method", "none", "--max-model-len", "128",
                                    "--max-num-seqs", "8", "--shutdown-timeout", "0.5"])
    try:
        threads, results = open_streams(url, 6)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()[-2000:]
        for t in threads:
            t.join(10)
        reasons = []
        for lines in results:
            assert lines and lines[-1] == "data: [DONE]", lines and lines[-3:]
            events = [json.loads(line[6:]) for line in lines[:-1]]
            assert all("error" not in e for e in events)
            reasons.append(events[-1]["choices"][0]["finish_reason"])
        assert set(reasons) <= {"abort", "length"} and "abort" in reasons, reasons
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- 7: the engine process -------------------------------------------------------------------
def test_the_engine_process_is_forked_only_on_a_cpu_from_a_one_thread_process():
    """Forked: a CPU engine from a process running one thread; spawned: an accelerator's
    engine (its runtime does not survive a fork), or once another thread runs (a fork would
    copy none of it, nor the locks it holds)."""
    code = ("import threading, time\n"
            "from specdec.entrypoints.async_engine import engine_start_method as m\n"
            "print(m('cpu'), m('cuda:0'), m('npu'), m(None))\n"
            "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
            "print(m('cpu'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split("\n")
    assert out[:2] == ["fork spawn spawn spawn", "spawn"]


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_the_engine_process_exits_when_the_api_process_is_killed():
    """The CPU engine process is forked from the API process: it closes its copy of the API
    process's end of their pipe, so a killed API process still closes the pipe and the engine
    exits instead of running on as an orphan."""
    proc, _ = bench_serve.launch(["--method", "none", "--max-model-len", "128"])
    engine = engine_pid(proc.pid)
    try:
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 20
        while not exited(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exited(engine), "the engine process outlived the API process"
    finally:
        if not exited(engine):
            os.kill(engine, signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_killing_the_engine_process_fails_its_streams_and_exits_nonzero():
    """The engine dies mid-stream: every open stream ends with an error event and [DONE]
    within seconds (nothing hangs), the server stops and exits non-zero, saying why."""
    proc, url = bench_serve.launch(["--method", "none", "--max-model-len", "128",
                                    "--max-num-seqs", "4"])
    try:
        engine = engine_pid(proc.pid)
        threads, results = open_streams(url, 3)
        start = time.monotonic()
        os.kill(engine, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert proc.wait(timeout=30) == 1
        assert time.monotonic() - start < 30
        assert "engine process exited with code -9" in proc.stderr.read()
        for lines in results:
            assert lines[-1] == "data: [DONE]"
            error = json.loads(lines[-2][6:])["error"]
            assert error["code"] == 500 and "engine process exited" in error["message"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_request_whose_messages_outgrow_the_pipe_is_served():
    """One request of n=200 queues 200 messages to the engine process at once, more than its
    pipe holds. Under ``specdec serve`` (uvloop, which made the pipe non-blocking) a full
    pipe failed a send with BlockingIOError, and the server took its live engine for dead,
    answered 500 and exited."""
    proc, url = bench_serve.launch(["--method", "none", "--max-model-len", "128"])
    try:
        prompt = "def f(x):\n    return x\n" * 12
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "prompt": prompt, "n": 200, "max_tokens": 1, "temperature": 1.0, "seed": 0})
        assert r.status_code == 200, r.text[:300]
        assert len(r.json()["choices"]) == 200
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    finally:
        bench_serve.stop(proc)


def test_engine_threads_sets_the_engine_process_torch_threads():
    """--engine-threads N: the engine process runs N torch threads (read back from its
    torch and printed at start-up); below 1 is refused naming the flag. The engine process
    froze its start-up objects out of Python's collections (/metrics says how many)."""
    port = bench_serve.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdec.commands.cli", "serve", "--method",
                             "none", "--max-model-len", "64", "--engine-threads", "1", "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline()
        assert "(engine process" in line and ", 1 torch threads; device cpu" in line, line
        assert "dtype float32 (auto: float32 on CPU" in line  # what was chosen, once
        url = bench_serve.wait_healthy(proc, f"http://127.0.0.1:{port}", "serve", 120)
        assert metrics(url)["specdec:engine_gc_frozen_objects"] > 10_000  # torch's alone
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    bad = subprocess.run([sys.executable, "-m", "specdec.commands.cli", "serve",
                          "--engine-threads", "0"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--engine-threads=0" in bad.stderr
