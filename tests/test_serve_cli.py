"""``specdec serve`` in-process: its --max-model-len default on a model with fewer than 512
positions, --port checks (range, a port in use, before the engine and before the start-up
line), and the sampling fields the server refuses by name instead of ignoring."""

import socket

import httpx
import pytest

from specdec.commands.cli import main
from specdec.engine.llm import LLM
from specdec.entrypoints import serve
from specdec.entrypoints.async_engine import ProcessEngine
from specdec.entrypoints.serve import build_server_app

from helpers import ServerThread
from hf_models import build_llama2


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A 2-layer Llama without a tokenizer; max_position_embeddings 256."""
    return build_llama2(tmp_path_factory.mktemp("llama2"))


def stop(engine) -> None:
    engine.conn.close()  # the engine process exits when its pipe closes
    engine.process.join(30)
    assert engine.process.exitcode is not None


def test_max_model_len_defaults_to_the_models_positions_and_port_0_prints_the_real_port(
        llama_dir, monkeypatch, capsys):
    """Served like LLM(model=...): min(512, max_position_embeddings) = 256 tokens, where a
    fixed default of 512 could not build the engine; --port 0 takes a free port and the
    start-up line names it."""
    served = {}
    monkeypatch.setattr(serve, "serve_until_signal",
                        lambda app, sock, *a: served.update(app=app, sock=sock))
    code = main(["serve", "--model", str(llama_dir), "--method", "none", "--port", "0"])
    assert code == 0, capsys.readouterr().err
    app, sock = served["app"], served["sock"]
    try:
        port = sock.getsockname()[1]
        assert port != 0 and f"on http://127.0.0.1:{port} " in capsys.readouterr().out
        assert app.state.engine.info.max_model_len == app.state.model.max_model_len == 256
    finally:
        sock.close()
        stop(app.state.engine)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert ("--max-model-len MAX_MODEL_LEN prompt + output tokens (default: min(512, the "
            "model's max_position_embeddings))") in " ".join(capsys.readouterr().out.split())


@pytest.fixture
def no_engine(monkeypatch):
    """Starting the engine fails the test: the checks must come first."""
    def start_process(self, timeout_s=600.0):
        pytest.fail("the engine was started")
    monkeypatch.setattr(ProcessEngine, "start_process", start_process)


@pytest.mark.parametrize("port", ["-1", "65536", "99999"])
def test_a_port_out_of_range_is_refused_naming_the_flag(port, no_engine, capsys):
    assert main(["serve", "--port", port]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert f"--port={port}" in err and "0 <= --port <= 65535" in err, err


@pytest.mark.parametrize("value", ["-5", "nan", "inf"])
def test_a_shutdown_timeout_out_of_range_is_refused_naming_the_flag(value, no_engine, capsys):
    """A negative or NaN one aborted running requests at once on shutdown."""
    assert main(["serve", "--shutdown-timeout", value]) == 2
    err = capsys.readouterr().err
    assert f"--shutdown-timeout={float(value)}: allowed a number of seconds >= 0" in err, err


@pytest.mark.parametrize("argv,says", [
    (["--method", "none", "-k", "2"], "-k 2 sets the drafter, and none runs here"),
    (["--method", "none", "--no-padded"], "--no-padded sets the drafter")])
def test_drafter_flags_without_a_drafter_are_refused_before_the_engine(argv, says, no_engine,
                                                                        capsys):
    assert main(["serve", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and says in err, err


def test_a_port_in_use_is_one_line_and_exit_2_before_the_engine_starts(no_engine, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1  # no start-up line claiming it serves
    assert f"--port={port}: 127.0.0.1:{port} is already in use" in err, err


def test_a_port_taken_while_the_engine_starts_stops_the_engine(llama_dir, monkeypatch, capsys):
    """The port is bound again once the engine is up: taken meanwhile, the same one line and
    exit 2, the engine process stopped, no start-up line."""
    taken, started = socket.socket(), []
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    real_start = ProcessEngine.start_process

    def start_then_take_the_port(self, timeout_s=600.0):
        started.append(self)
        info = real_start(self, timeout_s)
        taken.bind(("127.0.0.1", port))
        taken.listen()
        return info

    monkeypatch.setattr(ProcessEngine, "start_process", start_then_take_the_port)
    monkeypatch.setattr(serve, "serve_until_signal", lambda *a: pytest.fail("served"))
    with taken:
        code = main(["serve", "--model", str(llama_dir), "--method", "none", "--port",
                     str(port)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "is already in use" in err, err
    assert started[0].process.exitcode is not None  # stopped, not left running


# ---- request fields: refused by name unless their value does nothing ----------------------
@pytest.fixture(scope="module")
def server(llama_dir):
    s = ServerThread(build_server_app(LLM(model=str(llama_dir), max_model_len=64), "llama"))
    yield s
    s.close()


BASE = {"prompt": [5, 6, 7], "max_tokens": 4, "return_token_ids": True}
CHAT = "/v1/chat/completions"
REFUSED = [  # (path, the field and its value, what the message says): out of range, or not built
    ("/v1/completions", {"top_k": -2}, "allowed 0 or -1 (every token), or >= 1"),
    ("/v1/completions", {"min_p": 1.5}, "in [0.0, 1.0]"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens <= max_tokens=4"),
    ("/v1/completions", {"response_format": {"type": "json_object"}}, 'only {"type": "text"}'),
    ("/v1/completions", {"use_beam_search": False}, "the fields are: model, max_tokens"),
    ("/v1/completions", {"max_token": 3}, "the fields are: model, max_tokens"),
    (CHAT, {"tools": []}, "unknown field"),
    (CHAT, {"stream_options": {"include_usage": True, "include_obfuscation": True}},
     "unknown field"),
]


@pytest.mark.parametrize("path,extra,says", REFUSED,
                         ids=[f"{p[4:8]}-{next(iter(e))}" for p, e, _ in REFUSED])
def test_unimplemented_and_unknown_fields_are_400_naming_the_field(server, path, extra, says):
    body = {**BASE, **extra} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}], **extra}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    name = next(iter(extra))
    if name == "stream_options":
        name = "stream_options.include_obfuscation"
    assert err["param"] == name and err["message"].startswith(name) and says in err["message"]


def test_no_op_values_of_vllm_fields_and_user_change_nothing(server):
    """top_k -1 / 0 / null, min_p 0, min_tokens 0, response_format text and user: served as
    without them (a seeded sample: the same tokens)."""
    seeded = {**BASE, "seed": 7, "temperature": 1.0}
    want = httpx.post(f"{server.url}/v1/completions", json=seeded, timeout=60).json()
    for extra in ({"top_k": -1, "min_p": 0, "min_tokens": 0, "user": "alice"},
                  {"top_k": 0, "min_p": 0.0, "response_format": {"type": "text"}},
                  {"top_k": None, "min_p": None, "min_tokens": None, "response_format": None}):
        r = httpx.post(f"{server.url}/v1/completions", json={**seeded, **extra}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


def test_a_synthetic_shape_is_served_as_built_in_process(monkeypatch, capsys):
    """``serve --synthetic llama-tiny --synthetic-init random`` (seeded weights, no download)
    with EAGLE-3 K=2 serves the tokens the same shape built in this process gives."""
    import torch

    from specdec.models.synthetic import synthetic_engine

    served = {}
    monkeypatch.setattr(serve, "serve_until_signal",
                        lambda app, sock, *a: served.update(app=app, sock=sock))
    assert main(["serve", "--synthetic", "llama-tiny", "--synthetic-init", "random", "--seed",
                 "3", "--method", "eagle3", "-k", "2", "--port", "0", "--max-model-len",
                 "64"]) == 0
    assert "synthetic-llama-tiny on http" in capsys.readouterr().out
    served["sock"].close()
    server, prompts = ServerThread(served["app"]), [[5, 6, 7], [200, 1, 2, 3, 4]]
    try:
        got = [httpx.post(f"{server.url}/v1/completions", timeout=60, json=dict(
            prompt=p, max_tokens=8, ignore_eos=True, temperature=0, return_token_ids=True))
            .json()["choices"][0]["token_ids"] for p in prompts]
    finally:
        server.close()
    parts = synthetic_engine("llama-tiny", "eagle3", dtype=torch.float32, device="cpu", seed=3,
                             init="random")
    one = LLM(**parts, speculative_config={"method": "eagle3", "num_speculative_tokens": 2},
              max_model_len=64).generate(prompts, max_tokens=8, ignore_eos=True)
    assert got == [o.token_ids for o in one]


@pytest.mark.parametrize("argv, says", [
    (["--draft-acceptance", "0.5"], "--draft-acceptance sets the synthetic target's weights "
                                    "or its head's rates: give --synthetic"),
    (["--synthetic-init", "random"], "--synthetic-init sets the synthetic target's weights"),
    (["--synthetic", "llama-tiny", "--method", "mtp", "-k", "2", "--draft-acceptance", "0.5"],
     "give one rate per draft position, 2"),
    (["--synthetic", "llama-tiny", "--method", "ngram", "--draft-acceptance", "0.5,0.4,0.3"],
     "method='ngram' has none on llama-tiny"),
    (["--synthetic", "llama-9b"], "--synthetic='llama-9b': allowed"),
])
def test_synthetic_flags_that_cannot_do_what_they_say_are_refused(argv, says, capsys):
    assert main(["serve", *argv, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err
