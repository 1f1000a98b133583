"""Chat messages -> one prompt string, as transformers' ``apply_chat_template`` renders it: the
folder's chat template (``chat_template.jinja``, else ``tokenizer_config.json: chat_template``)
in the Jinja environment transformers gives templates, with the tokenizer's special-token
strings; else a plain ``role: content`` template. The prompt is then tokenized without adding
special tokens (the template writes them), as ``apply_chat_template(tokenize=True)`` does.

One renderer for ``LLM.chat`` and the server's /v1/chat/completions (``specdec.entrypoints.chat``
turns a folder's ChatConfigError into the commands' one-line UsageError)."""

import json
from datetime import datetime
from pathlib import Path

# the roles a message may have: OpenAI's "developer" is rendered as "system" (the role chat
# templates know); "tool" (a tool's result) reaches the template, which may refuse it
ROLES = ("system", "developer", "user", "assistant", "tool")
ROLE_AS = {"developer": "system"}


class ChatConfigError(ValueError):
    """The folder's chat template or special tokens cannot be read."""

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names a template sees the special tokens under
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its ``raise_exception``) or failed on them."""


def template_messages(name: str, messages) -> list[dict]:
    """One conversation, checked -> the dicts a template renders: ``role`` one of ROLES
    ("developer" becomes "system"), ``content`` a str or a list of ``{"type": "text", "text":
    str}`` parts (joined with newlines, as vLLM joins them), a tool message's ``tool_call_id``
    kept. ``name``: how errors name the conversation, e.g. ``messages[0]``."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"{name}={messages!r}: must be a non-empty list of "
                        "{'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        where = f"{name}[{i}]"
        if not isinstance(m, dict):
            raise TypeError(f"{where}={m!r}: must be a dict with role and content")
        if unknown := sorted(set(m) - {"role", "content", "tool_call_id"}):
            raise ValueError(f"{where}: unknown keys {unknown}; allowed: role, content, "
                             "tool_call_id")
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}.role={role!r}: allowed {list(ROLES)}")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) and len(p) == 2 for p in content):
                raise ValueError(f"{where}.content: parts must be {{'type': 'text', 'text': "
                                 "str}} (text only)")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise TypeError(f"{where}.content={content!r}: must be a str or a list of text "
                            "parts")
        msg = {"role": ROLE_AS.get(role, role), "content": content}
        if "tool_call_id" in m:
            if role != "tool" or not isinstance(m["tool_call_id"], str):
                raise ValueError(f"{where}.tool_call_id: a str, on a 'tool' message only")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def plain_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """``[{"role": "user", "content": "hi"}]`` -> ``"user: hi\\nassistant:"``. An assistant
    message is the generation prompt then its content (``"assistant:" + content + "\\n"``,
    no space added), so a conversation's next prompt repeats the text the model was given and
    the reply it generated: the prefix cache then reuses the reply's K/V too."""
    return ("".join(f"{m['role']}:{'' if m['role'] == 'assistant' else ' '}{m['content']}\n"
                    for m in messages)
            + ("assistant:" if add_generation_prompt else ""))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def find_chat_template(model_dir) -> str | None:
    """The folder's chat template as transformers' tokenizer loads it: ``chat_template.jinja``
    (what ``save_pretrained`` writes), else ``tokenizer_config.json``'s ``chat_template`` (a
    string, or a list of ``{"name", "template"}``: the one named "default"); None if none."""
    folder = Path(model_dir)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    where = folder / "tokenizer_config.json"
    template = _read_json(where).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise ChatConfigError(f"{where}: chat_template lists templates "
                                  f"{sorted(map(str, named))} but none named 'default', the "
                                  "one a chat request uses")
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ChatConfigError(f"{where}: chat_template must be a string or a list of "
                              f"{{\"name\", \"template\"}}, got {type(template).__name__}")
    return template


def special_tokens(model_dir) -> dict[str, str]:
    """``{"bos_token": "<s>", ...}``: the tokenizer's named special tokens, each a string or an
    AddedToken's ``{"content": ...}``, from ``tokenizer_config.json`` (else the legacy
    ``special_tokens_map.json``)."""
    folder, found = Path(model_dir), {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        for key, value in _read_json(folder / name).items():
            if key not in SPECIAL_TOKENS or key in found or value is None:
                continue
            value = value.get("content") if isinstance(value, dict) else value
            if not isinstance(value, str):
                raise ChatConfigError(f"{folder / name}: {key} must be a string or an "
                                      f"AddedToken {{\"content\": ...}}, got "
                                      f"{json.dumps(value)[:60]}")
            found[key] = value
    return found


def environment():
    """The Jinja environment transformers renders chat templates in: sandboxed and immutable,
    trim_blocks and lstrip_blocks, ``{% break %}``/``{% continue %}``, ``{% generation %}``
    blocks (rendered as their body), a ``tojson`` that escapes neither HTML nor non-ASCII,
    and the globals ``raise_exception(message)`` and ``strftime_now(format)``."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):  # transformers marks the assistant's tokens with it
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def load_chat_template(model_dir):
    """-> a function (messages, add_generation_prompt=True) -> prompt: the folder's template
    (``find_chat_template``) rendered with its special tokens, or ``plain_template``. A template
    that does not compile is a ChatConfigError; one that fails on the messages a
    ChatTemplateError."""
    template = find_chat_template(model_dir)
    if template is None:
        return plain_template
    import jinja2
    try:
        compiled = environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatConfigError(f"{model_dir}: its chat template does not compile: {e} "
                              f"(line {e.lineno})") from None
    tokens = special_tokens(model_dir)

    def render(messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return compiled.render(messages=messages, tools=None, documents=None,
                                   add_generation_prompt=add_generation_prompt, **tokens)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from None
    return render
