"""The agentic trace (specdec/bench/traces/agentic.jsonl) and its generator."""

import json
import sys

import pytest

from specdec.bench import agentic_trace, datasets
from specdec.engine.llm import DEFAULT_MODEL
from specdec.models.checkpoint import load_tokenizer

SHIPPED = [json.loads(line) for line in agentic_trace.TRACE.read_text().splitlines()]


def chars(s: str) -> int:  # a quick stand-in token count
    return len(s) // 3


def repeated_lines(turn: str, earlier: list[str]) -> list[str]:
    """The lines of ``turn`` (stripped, 12+ characters) that an earlier turn holds."""
    seen = "\n".join(earlier)
    return [x.strip() for x in turn.splitlines() if len(x.strip()) >= 12 and x.strip() in seen]


def test_the_generator_is_deterministic_given_its_seed():
    a = agentic_trace.make_trace(seed=1, conversations=3, count_tokens=chars)
    assert a == agentic_trace.make_trace(seed=1, conversations=3, count_tokens=chars)
    assert a != agentic_trace.make_trace(seed=2, conversations=3, count_tokens=chars)
    assert [x["question_id"] for x in a] == [0, 1, 2]


@pytest.mark.parametrize("trace", ["shipped", "generated"])
def test_every_tool_output_repeats_earlier_text(trace):
    """Each turn after the task (test log, diff, the file again, the passing log) quotes
    lines the conversation already holds: the text a suffix drafter and a prefix cache find."""
    convs = SHIPPED if trace == "shipped" else agentic_trace.make_trace(
        seed=3, conversations=4, count_tokens=chars)
    for conv in convs:
        turns = conv["turns"]
        assert turns[0].startswith("Task: ") and len(turns) >= 3
        for t in range(1, min(len(turns), 5)):
            assert repeated_lines(turns[t], turns[:t]), (conv["source"], t)
        # the excerpt after the edit is the excerpt before it, one line added
        if len(turns) >= 4:
            before, after = (x.split("\n", 1)[1] for x in (turns[0].split("\n", 1)[1],
                                                             turns[3]))
            assert len(after.splitlines()) == len(before.splitlines()) + 1


def test_the_shipped_trace_fits_the_embedded_model_and_replays_as_spec_bench():
    tok = load_tokenizer(DEFAULT_MODEL)
    assert agentic_trace.TRACE.stat().st_size < 300_000 and len(SHIPPED) == 16
    for conv in SHIPPED:  # within the 896-token budget, 32 tokens per reply counted
        used = sum(len(tok.encode(t).ids) + 32 + 6 for t in conv["turns"])
        assert used <= 896, conv["source"]
    d = datasets.load("spec_bench", str(agentic_trace.TRACE))
    assert len(d.conversations) == 16 and {c.category for c in d.conversations} == {"agentic"}
    assert d.conversations[0].turns == SHIPPED[0]["turns"]


def test_the_shipped_trace_is_the_generators_output():
    python = SHIPPED[0]["source"].split(" stdlib ")[0]
    if python != f"{sys.implementation.name} {sys.version.split()[0]}":
        pytest.skip(f"the trace was made from {python}'s standard library")
    assert agentic_trace.make_trace() == SHIPPED
