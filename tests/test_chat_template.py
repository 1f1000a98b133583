"""The served chat prompt is transformers' ``apply_chat_template``: for templates as
transformers saves and reads them (``chat_template.jinja``, ``tokenizer_config.json``, a list of
named templates), with the tokenizer's bos/eos tokens, the prompt ids of a chat request equal
``AutoTokenizer.from_pretrained(folder).apply_chat_template(messages,
add_generation_prompt=True, tokenize=True)``; a template's ``raise_exception`` is a 400
carrying its message."""

import asyncio
import json
import string

import httpx
import jinja2
import pytest
from hypothesis import given, strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from specdec.entrypoints.api_server import build_app, encode_chat
from specdec.entrypoints.async_engine import AsyncEngine
from specdec.entrypoints.chat import load_chat_template, plain_template
from specdec.entrypoints.protocol import ApiError, ChatMessage
from specdec.entrypoints.serve import served_model
from specdec.entrypoints.stub_engine import StubLLM
from specdec.flags import UsageError

from helpers import ServerThread

transformers = pytest.importorskip("transformers")

SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "<|im_start|>", "<|im_end|>"]

# ChatML (Qwen's shape), its block tags on their own indented lines: trim_blocks and
# lstrip_blocks decide its whitespace
CHATML = """{% for message in messages %}
    <|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
    <|im_start|>assistant
{% endif %}"""

# Mistral-7B-Instruct-v0.2's: bos and eos tokens, turns that must alternate, a system message
# only first
MISTRAL = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}"
    "{%- endif %}{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{- raise_exception("
    "'After the optional system message, conversation roles must alternate user/assistant/"
    "user/assistant/...') }}{%- endif %}{%- if message['role'] == 'user' %}"
    "{%- if loop.first and system_message is defined %}"
    "{{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' [INST] ' + message['content'] + ' [/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content'] + eos_token }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with the "
    "exception of an initial optional system message!') }}{%- endif %}{%- endfor %}")

# what else transformers gives templates: namespace, loop controls, a tojson that escapes
# neither HTML nor non-ASCII, {% generation %} blocks, strftime_now, tools given as none
FEATURES = """{% set ns = namespace(n=0) %}
{% if tools is not none %}tools!{% endif %}
{% for m in messages %}
    {% if m.role == 'system' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {{ ns.n }}{{ m | tojson }}
    {% if m.role == 'assistant' %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endif %}
    {% if ns.n == 3 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}{{ strftime_now('%Y') }}{{ eos_token }}{% endif %}"""

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4 <b>é</b>"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}, {"role": "user", "content": "ok"}],
]


def tiny_tokenizer() -> Tokenizer:
    """Every printable ASCII character (and é) a token, the special tokens whole, and a
    post-processor that adds <s> (as Llama's does): a rendered prompt tokenized with special
    tokens would start with two."""
    chars = sorted(set(string.printable) | {"é"})
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIAL + chars)}, "<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens(SPECIAL)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    return tok


def save(folder, template, style: str):
    """A tokenizer folder as transformers writes it (``save_pretrained``: chat_template.jinja),
    then rewritten to ``style``: "config" (the template in tokenizer_config.json, bos/eos as
    AddedToken dicts, as older transformers wrote them) or "named" (a list of named
    templates, "default" among them)."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tiny_tokenizer(),
                                               bos_token="<s>", eos_token="</s>",
                                               unk_token="<unk>", chat_template=template)
    tok.save_pretrained(folder)
    if style == "jinja":
        assert (folder / "chat_template.jinja").read_text() == template
        return folder
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if style == "config":
        added = {"__type": "AddedToken", "lstrip": False, "normalized": False, "rstrip": False,
                 "single_word": False, "special": True}
        config.update(chat_template=template, bos_token={**added, "content": "<s>"},
                      eos_token={**added, "content": "</s>"})
    else:
        config["chat_template"] = [{"name": "tool_use", "template": "{{ 'tools' }}"},
                                   {"name": "default", "template": template}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def model_over(folder):
    """What the chat endpoint renders and tokenizes with, for this folder."""
    return served_model("tiny", Tokenizer.from_file(str(folder / "tokenizer.json")), folder,
                        max_model_len=4096, vocab_size=200)


def chat_ids(model, messages) -> list[int]:
    """The prompt ids a chat request gives the engine (its endpoint's ``encode_chat``)."""
    return asyncio.run(encode_chat(model, [ChatMessage(**m) for m in messages],
                                   add_generation_prompt=True))


def hf_ids(folder, messages) -> list[int]:
    return transformers.AutoTokenizer.from_pretrained(folder).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)


@pytest.mark.parametrize("template,style", [
    (CHATML, "jinja"), (CHATML, "config"), (MISTRAL, "jinja"), (MISTRAL, "config"),
    (MISTRAL, "named"), (FEATURES, "jinja")],
    ids=["chatml-jinja", "chatml-config", "bos-eos-jinja", "bos-eos-config",
         "bos-eos-named-list", "transformers-env"])
def test_chat_prompt_ids_equal_transformers_apply_chat_template(tmp_path, template, style):
    folder = save(tmp_path, template, style)
    model = model_over(folder)
    for messages in CHATS:
        want = hf_ids(folder, messages)
        assert chat_ids(model, messages) == want, messages
    if template is MISTRAL:  # one <s>: the template's, none added by the tokenizer again
        assert want[0] == 1 != want[1] and want.count(1) == 1
        assert want.count(2) == 2  # an eos per assistant turn


def test_a_template_that_refuses_the_messages_is_a_400_with_its_message(tmp_path):
    """Through the chat endpoint (an engine that echoes the prompt): the prompt the engine
    gets is transformers'; a system message not first makes the template raise_exception:
    400 with its message, as transformers raises it; /tokenize renders the same ids."""
    folder = save(tmp_path, MISTRAL, "jinja")
    (folder / "config.json").write_text(json.dumps({"vocab_size": 200}))
    stub = StubLLM(4, str(folder), max_num_seqs=2, max_model_len=4096)
    server = ServerThread(build_app(AsyncEngine(stub), model_over(folder)))
    bad = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "messages": CHATS[1], "max_tokens": 2, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["prompt_token_ids"] == hf_ids(folder, CHATS[1])
        tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": CHATS[1]}).json()
        assert tokenized["tokens"] == hf_ids(folder, CHATS[1])
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"messages": bad, "max_tokens": 2})
    finally:
        server.close()
    with pytest.raises(jinja2.TemplateError) as hf:
        hf_ids(folder, bad)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and err["type"] == "invalid_request_error"
    assert "chat template" in err["message"] and str(hf.value) in err["message"]
    assert "Only user and assistant roles are supported" in str(hf.value)


def test_a_template_error_on_the_messages_is_a_400_naming_the_chat_template(tmp_path):
    folder = save(tmp_path, "{{ messages[0].content.no.such }}", "jinja")
    with pytest.raises(ApiError) as e:
        chat_ids(model_over(folder), CHATS[0])
    assert e.value.status == 400 and e.value.param == "messages"
    assert "chat template" in e.value.message and "no" in e.value.message


@pytest.mark.parametrize("template,says", [
    ("{% for m in messages %}{{ m.content }}", "does not compile"),
    ([{"name": "tool_use", "template": "x"}], "none named 'default'"),
    (7, "must be a string or a list")])
def test_a_broken_template_is_a_usage_error_at_start_up(tmp_path, template, says):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    with pytest.raises(UsageError, match=says):
        load_chat_template(tmp_path)


def test_a_folder_without_a_template_gets_the_plain_one(tmp_path):
    render = load_chat_template(tmp_path)
    assert render([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"


@given(turns=st.lists(st.tuples(st.text(max_size=12), st.text(max_size=12)), min_size=1,
                      max_size=4))
def test_the_plain_templates_next_prompt_repeats_the_prompt_and_its_reply(turns):
    """Each turn's prompt starts with the earlier turn's prompt followed by its reply as
    generated, so a multi-turn chat's prefix-cache hits reach into the replies."""
    messages = []
    for user, reply in turns:
        messages.append({"role": "user", "content": user})
        prompt = plain_template(messages)
        messages.append({"role": "assistant", "content": reply})
        assert plain_template(messages + [{"role": "user", "content": "next"}]).startswith(
            prompt + reply)
