"""Log-probabilities (``logprobs``, ``prompt_logprobs``, ``echo``) and several prompts per
request: the engine's and the server's values against log-softmax of a dense forward of the
target over the same tokens (no KV cache, no engine), for plain decoding, EAGLE-3 and MTP
(padded and ragged), greedy and sampled; and a stop string under speculation."""

import json
import time

import httpx
import pytest
import torch

from specdec.engine.llm import LLM
from specdec.engine.sequence import SamplingParams
from specdec.entrypoints.serve import build_server_app

from helpers import ServerThread, held_steps, metrics

MAX_MODEL_LEN = 128


def finished(url: str, reason: str) -> float:
    """The server's specdec:request_success_total for one finish reason."""
    key = "specdec:request_success_total" + json.dumps({"finished_reason": reason})
    return metrics(url).get(key, 0.0)


def finished_by(url: str, reason: str, want: float, timeout_s: float = 30.0) -> float:
    """``finished`` once it reaches ``want`` (or after ``timeout_s``): a request that a stop
    string ended has its stream end at once, and the engine counts it as it frees it, before
    its next step -- a read right after the response can come first on a busy box."""
    deadline = time.monotonic() + timeout_s
    while (got := finished(url, reason)) < want and time.monotonic() < deadline:
        time.sleep(0.02)
    return got

NAME = "specdec-logprobs"
TOL = 1e-5
SPECS = {"none": None,
         "eagle3-padded": {"method": "eagle3", "num_speculative_tokens": 3},
         "eagle3-ragged": {"method": "eagle3", "num_speculative_tokens": 3,
                           "disable_padded_drafter_batch": True},
         "mtp-padded": {"method": "mtp", "num_speculative_tokens": 2},
         "mtp-ragged": {"method": "mtp", "num_speculative_tokens": 2,
                        "disable_padded_drafter_batch": True},
         # a tree step's token j is drawn at its accepted path's node j, not at row j
         "eagle3-dynamic-tree": {"method": "eagle3", "num_speculative_tokens": 3,
                                 "tree_topk": 2, "num_draft_tokens": 6},
         "mtp-static-tree": {"method": "mtp", "num_speculative_tokens": 2,
                             "speculative_token_tree": [(0,), (1,), (0, 0), (1, 0)]}}
SAMPLING = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 1.0, "seed": 7},
            "top_p": {"temperature": 0.8, "top_p": 0.9, "seed": 3}}


def engine(spec, **kw) -> LLM:
    return LLM(speculative_config=spec, dtype=torch.float64, max_model_len=MAX_MODEL_LEN, **kw)


def dense_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64: log-softmax of the target's logits at each position of one
    dense forward (row p predicts the token at p + 1)."""
    with torch.inference_mode():
        hidden, _ = llm.target(torch.tensor([ids]), torch.arange(len(ids))[None])
        return torch.log_softmax(llm.target.compute_logits(hidden[0]).double(), dim=-1)


def check_entry(e, ref_row: torch.Tensor, token: int, n: int) -> None:
    """One TokenLogprob against its reference row: the token's value and rank, the top n."""
    assert e.token_id == token
    assert abs(e.logprob - float(ref_row[token])) < TOL
    assert e.rank == int((ref_row > ref_row[token] + TOL).sum()) + 1 or \
        e.rank == int((ref_row > ref_row[token] - TOL).sum()) + 1  # ties within rounding
    top = ref_row.topk(n)
    assert [lp for _, lp in e.top] == pytest.approx(top.values.tolist(), abs=TOL)
    for (tok, _), want in zip(e.top, top.indices.tolist()):
        assert tok == want or abs(float(ref_row[tok]) - float(ref_row[want])) < TOL


# ---- the engine ---------------------------------------------------------------------------------
@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("spec", list(SPECS))
def test_engine_logprobs_equal_a_dense_forward(spec, sampling):
    """LLM.generate: every output token's log-probability (and its top 3) and every prompt
    token's (top 2; a 40-token prompt prefilled in 16-token chunks) equal the dense
    forward's; a request that asks for none beside them gets none."""
    llm = engine(SPECS[spec], max_num_batched_tokens=16)
    prompts = [[5, 9, 13], list(range(1, 41)), [(i * 7) % 500 for i in range(23)]]
    asking = SamplingParams(max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True,
                            **SAMPLING[sampling])
    quiet = SamplingParams(max_tokens=12, ignore_eos=True, **SAMPLING[sampling])
    outs = llm.generate(prompts, [asking, quiet, asking])
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is None
    for out in (outs[0], outs[2]):
        ids = out.prompt_token_ids + out.token_ids
        ref = dense_logprobs(llm, ids)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        assert len(out.logprobs) == len(out.token_ids) == 12
        for p, e in enumerate(out.prompt_logprobs[1:] + out.logprobs, start=1):
            check_entry(e, ref[p - 1], ids[p], 2 if p < len(out.prompt_token_ids) else 3)
    if SPECS[spec] is not None:
        assert sum(sum(o.num_accepted) for o in outs) > 0  # drafts were accepted


def test_prompt_logprobs_under_tensor_parallelism_are_refused():
    llm = LLM(tensor_parallel_size=2, max_model_len=MAX_MODEL_LEN)
    with pytest.raises(ValueError, match=r"sampling_params\[0\].prompt_logprobs=1: not "
                                         r"supported with tensor_parallel_size=2"):
        llm.generate([[5, 9]], SamplingParams(prompt_logprobs=1))


@pytest.mark.parametrize("name,value", [("logprobs", 21), ("prompt_logprobs", -1)])
def test_sampling_params_bound_the_counts(name, value):
    with pytest.raises(ValueError, match=f"{name}={value}: allowed 0 <= {name} <= 20"):
        SamplingParams(**{name: value})


# ---- the server ---------------------------------------------------------------------------------
def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json={"model": NAME, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={"model": NAME, "stream": True, **body},
                      timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: {")]


@pytest.fixture(scope="module")
def eagle3():
    """EAGLE-3 K=3 padded (float64), served; and its LLM for the dense references."""
    llm = engine(SPECS["eagle3-padded"], max_num_batched_tokens=16)
    s = ServerThread(build_server_app(llm, NAME))
    yield s, llm
    s.close()


@pytest.mark.parametrize("spec", list(SPECS))
def test_served_logprobs_equal_a_dense_forward(spec):
    """/v1/completions logprobs=2 and /v1/chat/completions top_logprobs=2, greedy and
    sampled: each token's value equals the dense forward's log-softmax within 1e-5 and its
    top entries are the dense top 2 (completions: the token's own first, as vLLM)."""
    llm = engine(SPECS[spec])
    s = ServerThread(build_server_app(llm, NAME))
    try:
        for sampling in SAMPLING.values():
            body = {"prompt": "def fibonacci(n):", "max_tokens": 10, "logprobs": 2,
                    "return_token_ids": True, "ignore_eos": True, **sampling}
            choice = post(s.url, "/v1/completions", body)["choices"][0]
            ids = choice["prompt_token_ids"] + choice["token_ids"]
            ref = dense_logprobs(llm, ids)
            n = len(choice["prompt_token_ids"])
            lp = choice["logprobs"]
            assert len(lp["token_logprobs"]) == len(choice["token_ids"]) == 10
            for j, (value, top) in enumerate(zip(lp["token_logprobs"], lp["top_logprobs"])):
                row = ref[n + j - 1]
                assert abs(value - float(row[ids[n + j]])) < TOL
                assert sorted(top.values(), reverse=True)[:2] == pytest.approx(
                    row.topk(2).values.tolist(), abs=TOL)
                assert next(iter(top.values())) == value  # the token's own first
            assert "".join(lp["tokens"]) == choice["text"]
            assert lp["text_offset"] == [sum(map(len, lp["tokens"][:j])) for j in range(10)]

            chat = post(s.url, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "logprobs": True, "top_logprobs": 2, "return_token_ids": True,
                "ignore_eos": True, **sampling})["choices"][0]
            ids = chat["prompt_token_ids"] + chat["token_ids"]
            ref, n = dense_logprobs(llm, ids), len(chat["prompt_token_ids"])
            content = chat["logprobs"]["content"]
            assert len(content) == 6
            for j, c in enumerate(content):
                assert abs(c["logprob"] - float(ref[n + j - 1][ids[n + j]])) < TOL
                assert [t["logprob"] for t in c["top_logprobs"]] == pytest.approx(
                    ref[n + j - 1].topk(2).values.tolist(), abs=TOL)
                assert bytes(c["bytes"]).decode() == c["token"]
    finally:
        s.close()


def test_echo_gives_the_prompt_positions(eagle3):
    """echo + logprobs (lm-eval's loglikelihood request): the prompt text comes first, its
    positions' log-probabilities (the first null) equal the dense prefill's; streamed, the
    chunks concatenate to the same text, logprobs and offsets."""
    s, llm = eagle3
    prompt = "class Stack:\n    def push(self, x):"
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True,
            "return_token_ids": True}
    choice = post(s.url, "/v1/completions", body)["choices"][0]
    ids = choice["prompt_token_ids"] + choice["token_ids"]
    ref = dense_logprobs(llm, ids)
    lp = choice["logprobs"]
    assert choice["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert abs(lp["token_logprobs"][p] - float(ref[p - 1][ids[p]])) < TOL
        top = lp["top_logprobs"][p]  # the token's own and the most likely one
        assert max(top.values()) == pytest.approx(float(ref[p - 1].max()), abs=TOL)
    events = stream(s.url, "/v1/completions", body)
    parts = [e["choices"][0] for e in events if e["choices"]]
    assert "".join(c["text"] for c in parts) == choice["text"]
    joined = {k: sum((c["logprobs"][k] for c in parts), []) for k in lp}
    assert joined == lp


def test_vllm_prompt_logprobs(eagle3):
    """prompt_logprobs=2 (vLLM's field): per prompt token (the first null) the token's own
    entry (its log-probability and rank) and the 2 most likely, ranks 1 and 2."""
    s, llm = eagle3
    choice = post(s.url, "/v1/completions", {"prompt": "import os\nimport sys\n",
                                             "max_tokens": 2, "temperature": 0,
                                             "prompt_logprobs": 2, "return_token_ids": True}
                  )["choices"][0]
    ids = choice["prompt_token_ids"]
    ref = dense_logprobs(llm, ids)
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        own = got[p][str(ids[p])]
        assert abs(own["logprob"] - float(ref[p - 1][ids[p]])) < TOL
        assert own["rank"] == int((ref[p - 1] > ref[p - 1][ids[p]]).sum()) + 1
        best = ref[p - 1].topk(2)
        for rank, (tok, value) in enumerate(zip(best.indices.tolist(), best.values.tolist()), 1):
            if tok != ids[p]:  # the prompt token's own entry keeps its own rank
                assert got[p][str(tok)]["rank"] == rank
            assert abs(got[p][str(tok)]["logprob"] - value) < TOL
            assert got[p][str(tok)]["decoded_token"] == llm.tokenizer.decode(
                [tok], skip_special_tokens=False)


def test_every_prompt_form(eagle3):
    """A string, a list of strings, token ids and a list of token-id lists: each prompt its
    own choice (index in order) equal to it alone; usage summed; streamed, every choice's
    chunks carry its index."""
    s, _ = eagle3
    texts = ["def add(a, b):\n    return", "with open(path) as", "import os\n"]
    base = {"max_tokens": 8, "temperature": 0, "return_token_ids": True}
    alone = [post(s.url, "/v1/completions", {**base, "prompt": t}) for t in texts]
    ids = [a["choices"][0]["prompt_token_ids"] for a in alone]
    for prompt in (texts, ids):
        got = post(s.url, "/v1/completions", {**base, "prompt": prompt})
        assert [c["index"] for c in got["choices"]] == [0, 1, 2]
        for c, a in zip(got["choices"], alone):
            assert (c["text"], c["token_ids"]) == (a["choices"][0]["text"],
                                                   a["choices"][0]["token_ids"])
        for key in ("prompt_tokens", "completion_tokens"):
            assert got["usage"][key] == sum(a["usage"][key] for a in alone)
    one = post(s.url, "/v1/completions", {**base, "prompt": ids[1]})["choices"]
    assert [(c["index"], c["text"]) for c in one] == [(0, alone[1]["choices"][0]["text"])]
    events = stream(s.url, "/v1/completions", {**base, "prompt": texts,
                                               "stream_options": {"include_usage": True}})
    assert len({e["id"] for e in events}) == 1
    for i, a in enumerate(alone):
        text = "".join(c["text"] for e in events for c in e["choices"] if c["index"] == i)
        assert text == a["choices"][0]["text"]
    assert events[-1]["usage"]["completion_tokens"] == sum(
        a["usage"]["completion_tokens"] for a in alone)


def test_a_bad_prompt_among_several_is_named_and_nothing_runs(eagle3):
    s, llm = eagle3
    before = sum(finished(s.url, r) for r in ("length", "stop", "eos", "abort"))
    for prompt, says in (([[5, 6], [7, 10**6]], "prompt[1]: token ids [1000000] outside"),
                         ([[5, 6], []], "prompt[1]: empty"),
                         (["ok", [1] * MAX_MODEL_LEN], "prompt[1]: 128 token ids"),
                         ([[]], "prompt[0]: empty")):  # a list of one: named by its index
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": prompt, "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 400 and says in r.json()["error"]["message"], r.text
        assert r.json()["error"]["param"] == "prompt"
    assert sum(finished(s.url, r) for r in ("length", "stop", "eos", "abort")) == before


def test_a_stop_string_under_eagle3_ends_the_tokens_too(eagle3):
    """``return self.`` and ``def foo`` with stop "\\n": the usage and the streamed token ids
    stop at the token that completes the stop string (as plain decoding, one token per step,
    counts them), though a speculative step brought more; /metrics counts a "stop"."""
    s, llm = eagle3
    tok = llm.tokenizer
    for prompt in ("return self.", "def foo"):
        ids = tok.encode(prompt).ids
        plain = LLM(dtype=torch.float64, max_model_len=MAX_MODEL_LEN).generate(
            [ids], max_tokens=30)[0].token_ids
        want = next(n for n in range(1, len(plain) + 1) if "\n" in tok.decode(plain[:n]))
        stops = finished(s.url, "stop")
        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "stop": ["\n"],
                "return_token_ids": True}
        got = post(s.url, "/v1/completions", body)
        c = got["choices"][0]
        assert c["finish_reason"] == "stop" and "\n" not in c["text"]
        assert c["token_ids"] == plain[:want]
        assert got["usage"]["completion_tokens"] == want
        events = stream(s.url, "/v1/completions", {**body, "stream_options": {
            "include_usage": True}})
        assert sum((c["token_ids"] for e in events for c in e["choices"]), []) == plain[:want]
        assert events[-1]["usage"]["completion_tokens"] == want
        assert finished_by(s.url, "stop", stops + 2) == stops + 2


def test_tokenizer_info(eagle3):
    s, llm = eagle3
    info = httpx.get(f"{s.url}/tokenizer_info", timeout=30).json()
    eos = llm.tokenizer.id_to_token(llm.target.config.eos_token_ids[0])
    assert (info["eos_token"], info["model_max_length"]) == (eos, MAX_MODEL_LEN)


def test_several_prompts_are_admitted_all_or_none():
    """Three prompts at a server with two free places (max_num_seqs=2 and max_waiting=1, one
    request already in): 503, and none of the three runs; then two are served. Three at a
    server that admits two in all is a 400: no retry would ever admit them."""
    import threading
    s = ServerThread(build_server_app(LLM(max_model_len=64, max_num_seqs=2), NAME,
                                      max_waiting=1))
    engine = s.app.state.engine
    try:
        with held_steps(engine.llm):
            first = threading.Thread(target=post, args=(s.url, "/v1/completions",
                                                        {"prompt": [4], "max_tokens": 4}))
            first.start()
            deadline = time.monotonic() + 30
            while len(engine._handles) < 1:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [[5], [6], [7]],
                                                            "max_tokens": 4}, timeout=60)
            assert r.status_code == 503 and "max_waiting=1" in r.json()["error"]["message"]
            assert len(engine._handles) == 1  # the two admitted before the third: taken back
        first.join(60)
        health = httpx.get(f"{s.url}/health", timeout=30).json()
        assert (health["running"], health["waiting"]) == (0, 0)
        assert finished(s.url, "length") == 1  # the first request's
        assert sum(finished(s.url, reason) for reason in ("abort", "stop")) == 0
        got = post(s.url, "/v1/completions", {"prompt": [[5], [6]], "max_tokens": 4})
        assert [c["finish_reason"] for c in got["choices"]] == ["length", "length"]
        engine.max_waiting = 0
        r = httpx.post(f"{s.url}/v1/completions", json={"prompt": [[5], [6], [7]],
                                                        "max_tokens": 4}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    finally:
        s.close()
