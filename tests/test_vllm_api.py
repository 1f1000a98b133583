"""A script written against vLLM's offline API runs unchanged (issue 51, items 2 and 4):
``RequestOutput.outputs[0]`` (vLLM's CompletionOutput), ``prompt``, ``cumulative_logprob``,
``LLM.chat`` rendering the folder's chat template as the server does, and it equals the same
settings through ``specdec serve``'s app."""

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
