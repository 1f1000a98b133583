"""Chat messages -> one prompt string: the tokenizer's own chat template when the model folder
ships one (``tokenizer_config.json: chat_template``, Jinja), else a plain one."""

import json
from pathlib import Path


def plain_template(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """``[{"role": "user", "content": "hi"}]`` -> ``"user: hi\\nassistant:"``."""
    return ("".join(f"{m['role']}: {m['content']}\n" for m in messages)
            + ("assistant:" if add_generation_prompt else ""))


def load_chat_template(model_dir: Path):
    """-> a function messages -> prompt: the folder's Jinja template, or ``plain_template``."""
    config = Path(model_dir) / "tokenizer_config.json"
    template = json.loads(config.read_text()).get("chat_template") if config.exists() else None
    if not isinstance(template, str):
        return plain_template
    import jinja2
    compiled = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(template)
    return lambda messages, add_generation_prompt=True: compiled.render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="",
        eos_token="")
