"""The server's chat renderer: ``specdec.engine.chat_template`` (shared with ``LLM.chat``), with
a folder's unreadable template or special tokens as the commands' one-line UsageError."""

from functools import wraps

from specdec.engine import chat_template
from specdec.engine.chat_template import (ROLES, SPECIAL_TOKENS, ChatTemplateError,  # noqa: F401
                                          environment, plain_template, template_messages)
from specdec.flags import UsageError


def _usage_errors(fn):
    @wraps(fn)
    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except chat_template.ChatConfigError as e:
            raise UsageError(str(e)) from None
    return call


find_chat_template = _usage_errors(chat_template.find_chat_template)
special_tokens = _usage_errors(chat_template.special_tokens)
load_chat_template = _usage_errors(chat_template.load_chat_template)
