"""A script written against vLLM's offline API runs unchanged (issue 51, items 2 and 4):
``RequestOutput.outputs[0]`` (vLLM's CompletionOutput), ``prompt``, ``cumulative_logprob``,
``LLM.chat`` rendering the folder's chat template as the server does, and it equals the same
settings through ``specdec serve``'s app."""

import json
import shutil

import httpx
import pytest

from specdec import LLM, SamplingParams
from specdec.engine.outputs import CompletionOutput, RequestOutput
from specdec.entrypoints.serve import build_server_app

from helpers import ServerThread

# ChatML's shape; the conversation's roles and text are all in the prompt
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATION = [{"role": "system", "content": "Write Python."},
                {"role": "user", "content": "def add(a, b):"}]
PROMPTS = ["def fibonacci(n):", "import os\n"]
SPEC = {"method": "ngram", "num_speculative_tokens": 2}


@pytest.fixture(scope="module")
def chat_folder(folder, tmp_path_factory):
    """conftest's tiny target with a ChatML chat template beside its tokenizer."""
    target = tmp_path_factory.mktemp("chat") / "target"
    shutil.copytree(folder / "target", target)
    (target / "chat_template.jinja").write_text(CHATML)
    return target


@pytest.fixture(scope="module")
def llm(chat_folder):
    return LLM(str(chat_folder), speculative_config=SPEC, max_model_len=128, max_num_seqs=4)


def vllm_script(llm):
    """What a vLLM user writes (vllm.LLM / SamplingParams / outputs[0]); -> what it read."""
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
    seen = []
    for out in llm.generate(PROMPTS, params):
        c = out.outputs[0]
        seen.append(dict(prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                         index=c.index, text=c.text, token_ids=list(c.token_ids),
                         finish_reason=c.finish_reason, cumulative_logprob=c.cumulative_logprob,
                         logprobs=len(c.logprobs), finished=out.finished))
    for out in llm.chat(CONVERSATION, SamplingParams(max_tokens=8, temperature=0.0)):
        seen.append(dict(prompt=out.prompt, text=out.outputs[0].text,
                         token_ids=out.outputs[0].token_ids))
    return seen


def test_a_vllm_script_runs_and_equals_the_server(llm):
    seen = vllm_script(llm)
    for s, prompt in zip(seen, PROMPTS):
        assert s["prompt"] == prompt and s["index"] == 0 and s["finished"]
        assert len(s["token_ids"]) == 8 == s["logprobs"] and s["finish_reason"] == "length"
        assert s["cumulative_logprob"] < 0
        assert s["prompt_token_ids"] == llm.tokenizer.encode(prompt).ids
    chat = seen[-1]
    assert chat["prompt"] == ("<|im_start|>system\nWrite Python.<|im_end|>\n<|im_start|>user\n"
                              "def add(a, b):<|im_end|>\n<|im_start|>assistant\n")
    server = ServerThread(build_server_app(llm, "tiny"))
    try:
        for s, prompt in zip(seen, PROMPTS):
            r = httpx.post(f"{server.url}/v1/completions", json=dict(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0.0), timeout=60).json()
            assert r["choices"][0]["text"] == s["text"]
        body = dict(model="tiny", messages=CONVERSATION, max_tokens=8, temperature=0.0)
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        assert r["choices"][0]["message"]["content"] == chat["text"]
        ids = httpx.post(f"{server.url}/tokenize", json=dict(model="tiny",
                                                             messages=CONVERSATION)).json()
        assert ids["tokens"] == llm.chat(CONVERSATION, SamplingParams(max_tokens=1))[
            0].prompt_token_ids
    finally:
        server.close()


def test_the_old_attributes_are_outputs_0(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, logprobs=1))[0]
    c = out.outputs[0]
    assert isinstance(c, CompletionOutput) and len(out.outputs) == 1
    assert (out.text, out.token_ids, out.finish_reason, out.logprobs, out.stop_reason) == (
        c.text, c.token_ids, c.finish_reason, c.logprobs, c.stop_reason)
    assert out.cumulative_logprob == pytest.approx(sum(t.logprob for t in c.logprobs))
    assert out.cumulative_logprob < 0
    plain = llm.generate(PROMPTS[0], max_tokens=6)[0]
    assert plain.cumulative_logprob is None and plain.logprobs is None  # none asked (vLLM)
    assert plain.token_ids == out.token_ids and plain.prompt == PROMPTS[0]
    assert llm.generate(out.prompt_token_ids, max_tokens=2)[0].prompt is None  # ids given


def test_stop_reason_is_the_stop_token(llm):
    free = llm.generate(PROMPTS[1], max_tokens=6, ignore_eos=True)[0].token_ids
    stop = free[2]
    out = llm.generate(PROMPTS[1], max_tokens=6, ignore_eos=True, stop_token_ids=[stop])[0]
    assert out.finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.token_ids == free[:free.index(stop) + 1]
    assert llm.generate(PROMPTS[1], max_tokens=2)[0].stop_reason is None
    # as vLLM, the stop token's text is not the output's, unless include_stop_str_in_output
    kept = out.token_ids
    assert out.text == llm.tokenizer.decode(kept[:-1]) != llm.tokenizer.decode(kept)
    shown = llm.generate(PROMPTS[1], SamplingParams(
        max_tokens=6, ignore_eos=True, stop_token_ids=[stop], include_stop_str_in_output=True))[0]
    assert shown.token_ids == kept and shown.text == llm.tokenizer.decode(kept)
    also = llm.generate(PROMPTS[1], SamplingParams(  # the stop-string matcher agrees
        max_tokens=6, ignore_eos=True, stop_token_ids=[stop], stop=["never in the text"]))[0]
    assert (also.token_ids, also.text) == (kept, out.text)
    word = llm.tokenizer.decode([stop])  # a stop string only the stop token spells: no match
    both = llm.generate(PROMPTS[1], SamplingParams(
        max_tokens=6, ignore_eos=True, stop_token_ids=[stop], stop=[word]))[0]
    assert word not in out.text and both.outputs[0].stop_reason == stop
    server = ServerThread(build_server_app(llm, "tiny"))
    try:
        for include in (False, True):
            for stream in (False, True):
                r = httpx.post(f"{server.url}/v1/completions", json=dict(
                    model="tiny", prompt=PROMPTS[1], max_tokens=6, ignore_eos=True,
                    stop_token_ids=[stop], include_stop_str_in_output=include,
                    stream=stream, temperature=0), timeout=60)
                text = ("".join(json.loads(line[6:])["choices"][0]["text"]
                                for line in r.text.splitlines()
                                if line.startswith("data: {")) if stream
                        else r.json()["choices"][0]["text"])
                assert text == (shown.text if include else out.text), (include, stream)
    finally:
        server.close()


def test_chat_takes_conversations_and_checks_them(llm):
    many = llm.chat([CONVERSATION, CONVERSATION[1:]], SamplingParams(max_tokens=4))
    assert len(many) == 2 and many[0].prompt.startswith("<|im_start|>system")
    assert many[1].prompt.startswith("<|im_start|>user")
    dev = llm.chat([{"role": "developer", "content": "Write Python."}, CONVERSATION[1]],
                   SamplingParams(max_tokens=4))[0]
    assert dev.prompt == many[0].prompt  # developer is rendered as system
    with pytest.raises(ValueError, match=r"messages\[1\]\.role='robot': allowed \['system', "
                                         "'developer', 'user', 'assistant', 'tool'\\]"):
        llm.chat([CONVERSATION[0], {"role": "robot", "content": "x"}])
    with pytest.raises(TypeError, match=r"messages\[0\]\.content=3"):
        llm.chat([{"role": "user", "content": 3}])
    with pytest.raises(TypeError, match="messages=\\[\\]: must be a conversation"):
        llm.chat([])


def test_request_output_is_vllms_shape():
    """The fields vLLM code reads, by name."""
    c = CompletionOutput(0, "x", [5], None, None, "length")
    out = RequestOutput("0", "p", [1], None, [c])
    assert (out.request_id, out.prompt, out.prompt_token_ids, out.prompt_logprobs,
            out.outputs, out.finished) == ("0", "p", [1], None, [c], True)
    assert c.stop_reason is None and out.num_drafted == [] and out.acceptance_length == 1.0


# ---- item 4: inputs and flags -------------------------------------------------------------
def test_tokenizer_may_be_a_folder_or_its_file(chat_folder, llm, tmp_path):
    for given in (chat_folder, str(chat_folder), chat_folder / "tokenizer.json"):
        other = LLM(target=llm.target, tokenizer=given, max_model_len=64, max_num_seqs=1)
        assert other.tokenizer.encode(PROMPTS[0]).ids == llm.tokenizer.encode(PROMPTS[0]).ids
    with pytest.raises(ValueError, match=r"tokenizer='.*empty': no tokenizer.json there"):
        LLM(target=llm.target, tokenizer=tmp_path / "empty", max_model_len=64)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a readable tokenizer"):
        LLM(target=llm.target, tokenizer=tmp_path / "bad.json", max_model_len=64)


def test_prompt_dicts_are_vllms_text_and_tokens_prompts(llm):
    ids = llm.tokenizer.encode(PROMPTS[1]).ids
    plain = llm.generate([PROMPTS[0], ids], max_tokens=5)
    dicts = llm.generate([{"prompt": PROMPTS[0]}, {"prompt_token_ids": ids}], max_tokens=5)
    assert [o.token_ids for o in dicts] == [o.token_ids for o in plain]
    assert [o.prompt for o in dicts] == [PROMPTS[0], None]
    assert llm.generate({"prompt": PROMPTS[0]}, max_tokens=5)[0].token_ids == plain[0].token_ids
    with pytest.raises(ValueError, match=r"prompts\[0\]: a prompt dict holds one key, 'prompt'"
                                         r".*got keys \['multi_modal_data', 'prompt'\]"):
        llm.generate([{"prompt": "x", "multi_modal_data": {}}])
    with pytest.raises(TypeError, match=r"prompts\[0\]\['prompt'\]=\[1\]: must be a str"):
        llm.generate([{"prompt": [1]}])


def test_serve_takes_model_positionally(folder, capsys):
    from specdec.commands.cli import build_parser, main
    from specdec.entrypoints.serve import model_from_args
    target = str(folder / "target")
    for argv in (["serve", target], ["serve", "--model", target],
                 ["serve", target, "--model", target + "/"]):
        assert model_from_args(build_parser().parse_args(argv)) == target
    assert model_from_args(build_parser().parse_args(["serve"])) is None
    code = main(["serve", target, "--model", str(folder / "mtp")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "name different folders" in err


def test_gpu_memory_utilization_is_refused_on_cpu_and_sizes_the_kv_cache(llm, monkeypatch,
                                                                          capsys):
    import torch

    from specdec.commands.cli import main
    from specdec.engine import config
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.9 sizes the KV cache on an "
                                         r"accelerator.*allowed here: None"):
        LLM(gpu_memory_utilization=0.9, device="cpu")
    code = main(["generate", "--prompt", "x", "--gpu-memory-utilization", "0.9"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "gpu_memory_utilization=0.9" in err
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5: must be finite, in"):
        config.EngineConfig(device="cpu", gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="max_num_seqs=None: give an int >= 1, or "
                                         "gpu_memory_utilization"):
        config.EngineConfig(max_num_seqs=None, device="cpu")
    # on an accelerator (the device and its memory faked): the most rows the share holds
    specs = llm.target.kv_cache_spec()
    cfg = config.EngineConfig(max_num_seqs=1, max_model_len=64, device="cpu")
    cfg.device, cfg.gpu_memory_utilization, cfg.max_num_seqs = torch.device("cuda"), 0.5, None
    row = cfg.kv_cache_bytes(specs, rows=1) - cfg.kv_cache_bytes(specs, rows=0)
    total, used = 100 * row, 10 * row
    monkeypatch.setattr(config, "total_memory", lambda device: total)
    monkeypatch.setattr(config, "free_memory", lambda device: total - used)
    cfg.size_kv_cache(specs)
    fixed = cfg.kv_cache_bytes(specs, rows=0)  # the state's trash row: 0 without linear layers
    assert cfg.max_num_seqs == (50 * row - used - fixed) // row == 40
    assert cfg.num_kv_blocks == 40 * 4  # 64 tokens = 4 blocks of 16 per row
    cfg.max_num_seqs = 41  # given: checked against the share
    with pytest.raises(ValueError, match=r"max_num_seqs=41, max_model_len=64 needs"):
        cfg.size_kv_cache(specs)
    cfg.max_num_seqs, cfg.gpu_memory_utilization = None, 0.1
    with pytest.raises(ValueError, match="one request row of max_model_len=64 needs"):
        cfg.size_kv_cache(specs)


def test_enforce_eager_and_the_batch_flags(llm, monkeypatch, capsys):
    from specdec.bench import serve as bench_serve
    from specdec.commands import generate as generate_command
    from specdec.commands.cli import build_parser, main
    from specdec.flags import UsageError, engine_kwargs
    for argv in (["generate", "--prompt", "x"], ["serve"]):
        kw = engine_kwargs(build_parser().parse_args([*argv, "--enforce-eager"]))
        assert kw["graph_backend"] == "eager"
        with pytest.raises(UsageError, match="--enforce-eager conflicts with --graph-backend "
                                             "replay"):
            engine_kwargs(build_parser().parse_args([*argv, "--enforce-eager",
                                                     "--graph-backend", "replay"]))
    assert LLM(target=llm.target, tokenizer=llm.tokenizer, max_model_len=64, max_num_seqs=1,
               enforce_eager=True, graph_backend="eager").graph_backend == "eager"
    with pytest.raises(ValueError, match="enforce_eager=True conflicts with graph_backend="
                                         "'replay'"):
        LLM(target=llm.target, enforce_eager=True, graph_backend="replay")
    seen = {}

    def record(model, spec, **kw):
        seen.update(kw)
        raise UsageError("recorded")
    monkeypatch.setattr(generate_command, "build_llm", record)
    assert main(["generate", "--prompt", "x", "--max-num-seqs", "3",
                 "--max-num-batched-tokens", "64", "--enforce-eager"]) == 2
    assert (seen["max_num_seqs"], seen["max_num_batched_tokens"], seen["graph_backend"]) == (
        3, 64, "eager")
    capsys.readouterr()
    args = build_parser().parse_args(["bench", "serve", "--launch", "--max-num-seqs", "8",
                                      "--max-num-batched-tokens", "512", "--enforce-eager",
                                      "--gpu-memory-utilization", "0.8"])
    assert bench_serve.engine_flags(args) == [
        "--enforce-eager", "--gpu-memory-utilization", "0.8", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512"]
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://x",
                                      "--max-num-seqs", "8"])
    with pytest.raises(UsageError, match="--max-num-seqs: the launched server's engine flags"):
        bench_serve.engine_flags(args)


def test_developer_and_tool_roles(chat_folder, tmp_path):
    import asyncio

    from tokenizers import Tokenizer

    from specdec.entrypoints.api_server import encode_chat
    from specdec.entrypoints.protocol import ApiError, ChatMessage
    from specdec.entrypoints.serve import served_model

    def ids(folder, messages):
        model = served_model("tiny", Tokenizer.from_file(str(chat_folder / "tokenizer.json")),
                             folder, max_model_len=128, vocab_size=300)
        return asyncio.run(encode_chat(model, [ChatMessage(**m) for m in messages]))
    system = ids(chat_folder, CONVERSATION)
    assert ids(chat_folder, [{**CONVERSATION[0], "role": "developer"}, CONVERSATION[1]]) == system
    tool = [*CONVERSATION, {"role": "tool", "content": "4", "tool_call_id": "c1"}]
    assert len(ids(chat_folder, tool)) > len(system)  # ChatML renders any role
    refusing = tmp_path / "refusing"
    shutil.copytree(chat_folder, refusing)
    (refusing / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role')"
        " }}{% endif %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(ApiError) as e:
        ids(refusing, tool)
    assert e.value.status == 400 and "no tool role" in str(e.value)
    with pytest.raises(ApiError) as e:
        ids(chat_folder, [{"role": "user", "content": "x", "tool_call_id": "c1"}])
    assert e.value.status == 400 and "tool_call_id" in str(e.value)


def test_metrics_under_vllms_names(llm):
    from helpers import metrics
    server = ServerThread(build_server_app(llm, "tiny"))
    try:
        for prompt in PROMPTS:
            httpx.post(f"{server.url}/v1/completions", json=dict(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0.0), timeout=60)
        m = metrics(server.url)
    finally:
        server.close()
    lab = '{"engine": "0", "model_name": "tiny"}'
    for name in ("prompt_tokens_total", "generation_tokens_total",
                 "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total"):
        assert m["vllm:" + name + lab] == m["specdec:" + name] > 0, name
    for j in range(2):
        pos = f'{{"engine": "0", "model_name": "tiny", "position": "{j}"}}'
        assert m["vllm:spec_decode_num_accepted_tokens_per_pos_total" + pos] == m[
            f'specdec:spec_decode_num_accepted_tokens_per_pos_total{{"position": "{j}"}}']
    assert m["vllm:num_requests_running" + lab] == m["vllm:num_requests_waiting" + lab] == 0
    assert m["vllm:kv_cache_usage_perc" + lab] == 0.0  # every block free again
    success = '{"engine": "0", "finished_reason": "length", "model_name": "tiny"}'
    assert m["vllm:request_success_total" + success] == 2


# ---- item 3: vLLM's sampling fields -------------------------------------------------------
PENALIZED = dict(temperature=0.8, seed=7, top_k=20, min_p=0.05, repetition_penalty=1.2,
                 presence_penalty=0.3, frequency_penalty=0.2, min_tokens=3, max_tokens=12)


def sampling_script(llm, **fields):
    """A vLLM script using the sampling fields: n samples per prompt, read from outputs."""
    params = SamplingParams(n=2, **PENALIZED, **fields)
    return [[(c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason)
             for c in out.outputs] for out in llm.generate(PROMPTS, params)]


def test_a_vllm_sampling_script_runs_and_equals_the_server(llm):
    free = sampling_script(llm)
    assert [[c[0] for c in out] for out in free] == [[0, 1], [0, 1]]
    assert all(c[3] == "length" and len(c[2]) == 12 for out in free for c in out)
    assert free[0][0][2] != free[0][1][2]  # two samples, two streams
    # sample i is the request seeded seed + i (vLLM's child seeds)
    alone = llm.generate(PROMPTS[0], SamplingParams(**{**PENALIZED, "seed": 8}))[0]
    assert alone.token_ids == free[0][1][2]
    text = free[0][0][1]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    at = text.index(stop)
    got = sampling_script(llm, stop=[stop, "never in the text"])
    c = got[0][0]
    assert c[1] == text[:at] and (c[3], c[4]) == ("stop", stop)
    assert c[2] == free[0][0][2][:len(c[2])] and llm.tokenizer.decode(c[2]).startswith(
        text[:at + len(stop)])  # the tokens through the one that completes the stop string
    kept = sampling_script(llm, stop=stop, include_stop_str_in_output=True)[0][0]
    assert kept[1] == text[:at + len(stop)] and kept[2] == c[2]
    # as vLLM, no stop string is looked for before min_tokens (3): not the text's first chars
    early = sampling_script(llm, stop=text[:2])[0][0]
    assert early[1] != "" and text.startswith(early[1])
    assert early[3] == "length" or text[len(early[1]):].startswith(text[:2])
    server = ServerThread(build_server_app(llm, "tiny"))
    try:
        for fields, want in (({}, free), ({"stop": [stop, "never in the text"]}, got),
                             ({"stop": stop, "include_stop_str_in_output": True}, None)):
            r = httpx.post(f"{server.url}/v1/completions", json=dict(
                model="tiny", prompt=PROMPTS, n=2, return_token_ids=True, **PENALIZED,
                **fields), timeout=60).json()
            choices = r["choices"]
            assert [ch["index"] for ch in choices] == [0, 1, 2, 3]  # prompt * n + sample
            if want is None:
                assert choices[0]["text"] == kept[1]
                continue
            flat = [c for out in want for c in out]
            assert [(ch["text"], ch["token_ids"]) for ch in choices] == [
                (c[1], c[2]) for c in flat]
            assert [ch["finish_reason"] for ch in choices] == [c[3] for c in flat]
        body = dict(model="tiny", messages=CONVERSATION, n=2, **PENALIZED)
        chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
        want = llm.chat(CONVERSATION, SamplingParams(n=2, **PENALIZED))[0].outputs
        assert [(ch["index"], ch["message"]["content"]) for ch in chat["choices"]] == [
            (c.index, c.text) for c in want]
    finally:
        server.close()


def test_n_and_the_fields_not_built_are_refused_by_name(llm):
    with pytest.raises(ValueError, match="n=2 with temperature=0.0: greedy sampling gives one "
                                         "output.*allowed: n=1, or temperature > 0"):
        SamplingParams(n=2)
    with pytest.raises(ValueError, match=r"params.n=2: add_request queues one sample"):
        llm.add_request(PROMPTS[0], SamplingParams(n=2, temperature=1.0))
    for name, value in (("bad_words", ["x"]), ("logit_bias", {1: 2.0}),
                        ("allowed_token_ids", [1]), ("best_of", 2)):
        with pytest.raises(ValueError, match=f"{name}=.*: not supported by this engine; "
                                             "allowed: None"):
            SamplingParams(**{name: value})
    for kw, says in ((dict(top_k=-2), "top_k=-2: allowed 0 or -1"),
                     (dict(min_p=2.0), "min_p=2.0: must be finite, in"),
                     (dict(repetition_penalty=0.0), "repetition_penalty=0.0"),
                     (dict(presence_penalty=-2.5), r"presence_penalty=-2.5: must be finite, in "
                                                   r"\[-2.0, 2.0\]"),
                     (dict(min_tokens=5, max_tokens=4), "min_tokens=5: allowed 0 <= min_tokens "
                                                        "<= max_tokens=4"),
                     (dict(stop=[""]), r"stop\[0\]='': stop strings must be non-empty"),
                     (dict(n=0), "n=0: allowed 1 <= n")):
        with pytest.raises(ValueError, match=says):
            SamplingParams(**kw)
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's other spelling of "off"
    no_tokenizer = LLM(target=llm.target, max_model_len=64, max_num_seqs=1)
    with pytest.raises(ValueError, match=r"sampling_params\[0\].stop=\['x'\]: stop strings are "
                                         "matched on the decoded text"):
        no_tokenizer.generate([[1, 2]], SamplingParams(stop="x"))
