"""Benchmark prompt sets from files (``--dataset-name`` / ``--dataset-path``, as vLLM's
``bench serve`` names them). One reader per format, each -> a list of ``Conversation``:

* ``custom``: JSONL, one ``{"prompt": str, "output_tokens": int, "category": str}`` a line
  (vLLM's custom format: ``prompt`` required, ``output_tokens`` its optional per-line output
  length; ``category`` is this harness's addition). Any other key is refused (a misspelt
  ``output_tokens`` would otherwise be ignored).
* ``sharegpt``: a JSON list (or JSONL) of ``{"conversations": [{"from": "human" | "gpt" | ...,
  "value": str}, ...]}``. The human turns are the user turns; the reply after a human turn,
  counted by ``count_tokens``, is that turn's output length (as vLLM sizes ``sharegpt``
  requests; vLLM takes the first two turns whatever their roles). Other keys (``id``...) are
  not read.
* ``spec_bench``: SpecBench's ``question.jsonl``, ``{"category": str, "turns": [str, ...]}`` a
  line (``question_id``, ``reference``... not read); no output lengths.

A single-turn benchmark sends each conversation's first turn (``Conversation.row``); the
multi-turn mode sends every turn. A malformed line is a ``DatasetError`` naming
``file:line``, what is wrong and what is allowed; a well-formed entry that holds no prompt
(a ShareGPT conversation without a human turn, or whose first is blank) is left out and
listed in ``Dataset.skipped``.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

from specdec.flags import UsageError

NAMES = ("random", "custom", "sharegpt", "spec_bench")  # random: the generated prompts
CUSTOM_KEYS = ("prompt", "output_tokens", "category")
SHAREGPT_USER = ("human", "user")
SHAREGPT_REPLY = ("gpt", "assistant", "chatgpt", "bard", "bing", "model")
SHAREGPT_OTHER = ("system",)  # read past: neither a prompt nor a reply


class DatasetError(UsageError):
    """A malformed dataset file: ``file:line: what is wrong``."""


class Row(NamedTuple):
    """One single-turn prompt: its text, output length (None: the bench's ``output_len``)
    and category (None: the dataset has none)."""

    prompt: str
    max_tokens: int | None
    category: str | None


class Conversation(NamedTuple):
    """User turns in order, each turn's output length (None: the bench's), the category and
    where it was read (``file:line``)."""

    turns: list[str]
    max_tokens: list[int | None]
    category: str | None
    where: str

    @property
    def row(self) -> Row:
        return Row(self.turns[0], self.max_tokens[0], self.category)


@dataclass
class Dataset:
    name: str
    path: str
    conversations: list[Conversation]
    skipped: list[str] = field(default_factory=list)  # "file:line: why" of entries left out

    def rows(self) -> list[Row]:
        return [c.row for c in self.conversations]

    @property
    def kind(self) -> str:
        return f"{self.name} dataset {self.path}"

    def warnings(self) -> list[str]:
        """The entries left out for holding no prompt, and why."""
        return left_out_warning(self.kind, "entries without a prompt", self.skipped)


def left_out_warning(kind: str, what: str, lines: list[str]) -> list[str]:
    """[] for no ``lines``, else one warning naming the first 3 ``"file:line: why"``."""
    if not lines:
        return []
    return [f"{kind}: {len(lines)} {what} left out: " + "; ".join(lines[:3])
            + (" ..." if len(lines) > 3 else "")]


# ---- the file's entries with their line numbers ----------------------------------------------
def read_text(path: Path) -> str:
    """The file as UTF-8 text (a leading byte-order mark dropped); DatasetError naming the
    line of the first byte that is not UTF-8."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DatasetError(f"{path}:{line}: byte 0x{raw[e.start]:02x} is not UTF-8 (allowed: "
                           "UTF-8 text)") from None


def jsonl_entries(path: Path) -> list[tuple[int, object]]:
    """[(line number, parsed JSON)] of a JSONL file; blank lines are not entries. Lines end
    at "\n" only (a "\r" before it is JSON whitespace): U+2028 and the like may stand
    unescaped inside a JSON string."""
    out = []
    for n, line in enumerate(read_text(path).split("\n"), start=1):
        if line.strip():
            try:
                out.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg} at column "
                                   f"{e.colno})") from None
    return out


def json_list_entries(path: Path, text: str) -> list[tuple[int, object]]:
    """[(line where the element starts, element)] of a file holding one JSON list, e.g.
    ``'[\\n {"a": 1},\\n {"a": 2}]'`` -> ``[(2, {"a": 1}), (3, {"a": 2})]``."""
    dec = json.JSONDecoder()
    out, i = [], text.index("[") + 1

    def skip(i):
        while i < len(text) and text[i].isspace():
            i += 1
        return i

    def line(i):
        return text.count("\n", 0, i) + 1

    def close(i):  # text[i] is the list's closing "]": nothing may follow it
        if (rest := skip(i + 1)) < len(text):
            raise DatasetError(f"{path}:{line(rest)}: text after the list's closing ']' "
                               "(allowed: one JSON list, or JSONL)")
        return out

    i = skip(i)
    if i < len(text) and text[i] == "]":
        return close(i)
    while True:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column "
                               f"{e.colno})") from None
        out.append((line(i), obj))
        i = skip(end)
        if i < len(text) and text[i] == ",":
            i = skip(i + 1)
        elif i < len(text) and text[i] == "]":
            return close(i)
        else:
            raise DatasetError(f"{path}:{line(i)}: expected ',' or ']' after the list element "
                               f"that starts on line {out[-1][0]}")


def entries(path: Path) -> list[tuple[int, object]]:
    """A JSON list's elements, or a JSONL file's lines (whichever the file holds)."""
    text = read_text(path)
    if text.lstrip().startswith("["):
        return json_list_entries(path, text)
    return jsonl_entries(path)


def _object(path: Path, n: int, entry) -> dict:
    if not isinstance(entry, dict):
        raise DatasetError(f"{path}:{n}: expected a JSON object, got {type(entry).__name__}")
    return entry


def _text(path: Path, n: int, key: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{path}:{n}: {key}={value!r}: allowed a non-empty string")
    return value


# ---- the readers -----------------------------------------------------------------------------
def read_custom(path: Path) -> list[Conversation]:
    """vLLM's custom JSONL: ``{"prompt": "def f(x):", "output_tokens": 32, "category":
    "code"}`` -> one single-turn Conversation(["def f(x):"], [32], "code", "FILE:1")."""
    out = []
    for n, entry in jsonl_entries(path):
        e = _object(path, n, entry)
        if unknown := sorted(set(e) - set(CUSTOM_KEYS)):
            raise DatasetError(f"{path}:{n}: unknown keys {unknown}; allowed: "
                               f"{', '.join(CUSTOM_KEYS)}")
        if "prompt" not in e:
            raise DatasetError(f"{path}:{n}: no 'prompt' (required; allowed keys: "
                               f"{', '.join(CUSTOM_KEYS)})")
        out_len = e.get("output_tokens")
        if out_len is not None and (not isinstance(out_len, int) or isinstance(out_len, bool)
                                    or out_len < 1):
            raise DatasetError(f"{path}:{n}: output_tokens={out_len!r}: allowed an int >= 1")
        category = e.get("category")
        if category is not None:
            _text(path, n, "category", category)
        out.append(Conversation([_text(path, n, "prompt", e["prompt"])], [out_len], category,
                                f"{path}:{n}"))
    return out


def read_sharegpt(path: Path, count_tokens: Callable[[str], int] | None = None,
                  skipped: list[str] | None = None) -> list[Conversation]:
    """ShareGPT conversations: the human turns, each with the token count of the reply after
    it (``count_tokens``; None without it or without a reply). An entry with no human turn, or
    a blank first one, is left out and appended to ``skipped`` as ``"FILE:LINE: why"``."""
    roles = SHAREGPT_USER + SHAREGPT_REPLY + SHAREGPT_OTHER
    out = []
    for n, entry in entries(path):
        e = _object(path, n, entry)
        turns = e.get("conversations")
        if not isinstance(turns, list):
            raise DatasetError(f"{path}:{n}: conversations={turns!r}: allowed a list of "
                               '{"from": ..., "value": ...} turns')
        user, lengths = [], []
        for j, t in enumerate(turns):
            if not isinstance(t, dict) or not isinstance(t.get("value"), str) \
                    or t.get("from") not in roles:
                raise DatasetError(f"{path}:{n}: conversations[{j}]={t!r}: allowed "
                                   f'{{"from": one of {list(roles)}, "value": a string}}')
            if t["from"] in SHAREGPT_USER:
                user.append(t["value"])
                nxt = turns[j + 1] if j + 1 < len(turns) else None
                reply = nxt["value"] if isinstance(nxt, dict) and \
                    nxt.get("from") in SHAREGPT_REPLY and isinstance(nxt.get("value"), str) \
                    else None
                lengths.append(max(count_tokens(reply), 1) if count_tokens and reply is not None
                               else None)
        if not user or not user[0].strip():
            if skipped is not None:
                skipped.append(f"{path}:{n}: " + ("no human turn" if not user
                                                   else "the first human turn is blank"))
            continue
        out.append(Conversation(user, lengths, None, f"{path}:{n}"))
    return out


def read_spec_bench(path: Path) -> list[Conversation]:
    """SpecBench's questions: ``{"question_id": 81, "category": "writing", "turns": ["Write
    a haiku.", "Now in French."]}`` -> Conversation(["Write a haiku.", "Now in French."],
    [None, None], "writing", "FILE:1")."""
    out = []
    for n, entry in jsonl_entries(path):
        e = _object(path, n, entry)
        for key in ("category", "turns"):
            if key not in e:
                raise DatasetError(f"{path}:{n}: no {key!r} (SpecBench's question lines hold "
                                   "category and turns)")
        turns = e["turns"]
        if not isinstance(turns, list) or not turns:
            raise DatasetError(f"{path}:{n}: turns={turns!r}: allowed a non-empty list of "
                               "strings")
        texts = [_text(path, n, f"turns[{j}]", t) for j, t in enumerate(turns)]
        out.append(Conversation(texts, [None] * len(texts),
                                _text(path, n, "category", e["category"]), f"{path}:{n}"))
    return out


def check_pair(name: str, path: str | None) -> None:
    """UsageError unless ``name`` is one of NAMES and ``path`` is a file given with a file
    format (and only then)."""
    if name not in NAMES:
        raise UsageError(f"--dataset-name={name!r}: allowed {', '.join(NAMES)}")
    if name == "random":
        if path is not None:
            raise UsageError(f"--dataset-path={path!r} goes with --dataset-name custom, "
                             "sharegpt or spec_bench (random generates its prompts)")
        return
    if path is None:
        raise UsageError(f"--dataset-name {name} reads --dataset-path FILE: give one")
    if not Path(path).is_file():
        raise UsageError(f"--dataset-path={path!r} is not a file")


def load(name: str, path: str | None,
         count_tokens: Callable[[str], int] | None = None) -> Dataset | None:
    """``--dataset-name`` / ``--dataset-path`` -> the Dataset; None for ``random`` (the
    generated prompts). UsageError when the pair does not fit or the file holds no prompt."""
    check_pair(name, path)
    if name == "random":
        return None
    file = Path(path)
    skipped: list[str] = []
    if name == "custom":
        convs = read_custom(file)
    elif name == "sharegpt":
        convs = read_sharegpt(file, count_tokens, skipped)
    else:
        convs = read_spec_bench(file)
    if not convs:
        raise UsageError(f"--dataset-path={path!r} ({name}) holds no prompt"
                         + (f" ({len(skipped)} entries left out, e.g. {skipped[0]})"
                            if skipped else ""))
    return Dataset(name, str(path), convs, skipped)


def pick(items: list, n: int, seed: int) -> list:
    """``n`` of ``items``: a seeded shuffle of them, repeated when ``n`` is larger (as vLLM
    oversamples), e.g. ``pick([a, b, c], 4, s)`` -> the 3 in some order, then one again."""
    import random
    order = list(items)
    random.Random(seed).shuffle(order)
    return [order[i % len(order)] for i in range(n)]
