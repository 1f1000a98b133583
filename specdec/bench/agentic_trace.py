"""The agentic trace: coding-agent conversations built from the embedded model's own corpus
(the held-out standard-library files of ``specdec.train.data``), no download.

    python -m specdec.bench.agentic_trace --out specdec/bench/traces/agentic.jsonl
    specdec bench serve --launch --multi-turn 12 --concurrency 4 --num-prompts 8 \\
        --dataset-name spec_bench --dataset-path specdec/bench/traces/agentic.jsonl

A conversation is an agent fixing a function: the task with the file's excerpt (``sed -n``),
then tool outputs that repeat earlier text, as an agent's context does: a failing test log
quoting a line of the excerpt, the fix as a unified diff (its context lines the excerpt's),
the excerpt again after the edit, the passing log, then the same cycle on the next function
of the file. Turns are added while the conversation, with ``reply_tokens`` for each reply
and the plain chat template's words, stays within ``budget`` tokens of the embedded
tokenizer (default 896 of the embedded model's 1024 positions: contexts grow up to most of
max_model_len, leaving room for the last reply and K + 1 draft slots).

Written in SpecBench's question format (``category``, ``turns``; plus ``source``: the file and
the Python whose stdlib it is), so ``--dataset-name spec_bench`` replays it. Deterministic
given the seed and that Python's standard library.
"""

import argparse
import difflib
import json
import random
import re
import sys
from pathlib import Path

from specdec.train import data

TRACE = Path(__file__).parent / "traces" / "agentic.jsonl"
ERRORS = ("AssertionError", "TypeError: unsupported operand type(s)", "KeyError: 'name'",
          "ValueError: invalid literal", "AttributeError: 'NoneType' object has no attribute")


def functions(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, end line exclusive, name) of each top-level or method ``def`` of 6-18
    lines, e.g. ``["def f(x):", "    return x", ""]`` -> none (too short)."""
    starts = [(i, m.group(2), len(m.group(1))) for i, line in enumerate(lines)
              if (m := re.match(r"( *)def (\w+)\(", line))]
    out = []
    for i, name, indent in starts:
        end = i + 1
        while end < len(lines) and (not lines[end].strip()
                                    or len(lines[end]) - len(lines[end].lstrip()) > indent):
            end += 1
        while end > i + 1 and not lines[end - 1].strip():
            end -= 1
        if 6 <= end - i <= 18:
            out.append((i, end, name))
    return out


def edit(body: list[str], rng: random.Random) -> tuple[list[str], int]:
    """The agent's fix: a comment added before one code line of ``body`` (not the ``def``, 12+
    characters: the failing log quotes it); -> (new body, index of that line)."""
    candidates = [j for j, line in enumerate(body[1:], 1) if len(line.strip()) >= 12
                  and not line.strip().startswith(("#", '"""', "'''"))] or [len(body) - 1]
    j = rng.choice(candidates)
    indent = body[j][:len(body[j]) - len(body[j].lstrip())]
    return body[:j] + [f"{indent}# fixed: checked before use"] + body[j:], j


def cycle(path: str, lines: list[str], fn: tuple[int, int, str], rng: random.Random,
          passed: int) -> list[str]:
    """The five tool turns of one fix: excerpt, failing log, diff, excerpt after, passing log."""
    start, end, name = fn
    body = lines[start:end]
    fixed, j = edit(body, rng)
    stem = Path(path).stem
    sed = f"$ sed -n '{start + 1},{end}p' Lib/{path}\n"
    test = f"$ python -m pytest tests/test_{stem}.py -x -q\n"
    error = rng.choice(ERRORS)
    failing = (test + "F\n=================================== FAILURES ===================================\n"
               f"___________________________ test_{name} ___________________________\n"
               "Traceback (most recent call last):\n"
               f'  File "Lib/{path}", line {start + j + 1}, in {name}\n'
               f"    {body[j].strip()}\n{error}\n"
               f"FAILED tests/test_{stem}.py::test_{name} - {error.split(':')[0]}\n"
               f"1 failed, {passed} passed in 0.{rng.randint(10, 99)}s")
    diff = "".join(difflib.unified_diff([x + "\n" for x in body], [x + "\n" for x in fixed],
                                        f"a/Lib/{path}", f"b/Lib/{path}", n=3))
    return [sed + "\n".join(body),
            failing,
            f"$ git diff\n{diff.rstrip()}",
            sed.replace(f",{end}p", f",{end + 1}p") + "\n".join(fixed),
            test + f"{passed + 1} passed in 0.{rng.randint(10, 99)}s"]


def conversation(path: str, text: str, rng: random.Random, count_tokens, budget: int,
                 reply_tokens: int) -> list[str] | None:
    """One conversation's user turns, within ``budget`` (None: the file has no function to
    fix that fits)."""
    lines = text.splitlines()
    fns = functions(lines)
    if not fns:
        return None
    first = rng.randrange(len(fns))
    turns, used = [], 0
    for k, fn in enumerate(fns[first:] + fns[:first]):
        cyc = cycle(path, lines, fn, rng, rng.randint(3, 40))
        if k == 0:
            cyc[0] = (f"Task: a test of Lib/{path} fails. Find the bug in {fn[2]}() and fix "
                      f"it. Run the tests after the fix.\n{cyc[0]}")
        else:
            cyc[0] = f"Next: {fn[2]}() has the same bug.\n{cyc[0]}"
        for turn in cyc:
            # "user: ...\nassistant:" and the reply with its newline: about 6 tokens of frame
            cost = count_tokens(turn) + reply_tokens + 6
            if used + cost > budget:
                return turns if len(turns) >= 3 else None
            turns.append(turn)
            used += cost
    return turns if len(turns) >= 3 else None


def make_trace(seed: int = 0, conversations: int = 16, budget: int = 896,
               reply_tokens: int = 32, count_tokens=None) -> list[dict]:
    """The trace's lines: ``conversations`` conversations, each from a held-out stdlib file
    drawn with ``seed`` (a file more than once when there are fewer)."""
    if count_tokens is None:
        from specdec.engine.llm import DEFAULT_MODEL
        from specdec.models.checkpoint import load_tokenizer
        tok = load_tokenizer(DEFAULT_MODEL)
        count_tokens = lambda s: len(tok.encode(s).ids)  # noqa: E731
    rng = random.Random(seed)
    _, held = data.list_files()
    texts = dict(zip(held, data.read_texts(held)))
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    out = []
    while len(out) < conversations:
        path = rng.choice(held)
        turns = conversation(path, texts[path], rng, count_tokens, budget, reply_tokens)
        if turns is not None:
            out.append(dict(question_id=len(out), category="agentic", turns=turns,
                            source=f"{python} stdlib {path}"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specdec.bench.agentic_trace",
                                description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(TRACE), help=f"the JSONL file (default {TRACE})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--budget", type=int, default=896, help="tokens a conversation may reach, "
                   "its replies counted (default 896 of the embedded model's 1024)")
    p.add_argument("--reply-tokens", type=int, default=32, help="tokens allowed per reply "
                   "(the bench's --output-len; default 32)")
    args = p.parse_args(argv)
    lines = make_trace(args.seed, args.conversations, args.budget, args.reply_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in lines))
    turns = [len(x["turns"]) for x in lines]
    print(f"wrote {args.out}: {len(lines)} conversations, {min(turns)}-{max(turns)} turns, "
          f"{Path(args.out).stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
