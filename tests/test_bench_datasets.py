"""specdec.bench.datasets: each format's rows, and its malformed lines named by file:line."""

import json

import pytest

from specdec.bench import datasets
from specdec.bench.datasets import Conversation, DatasetError, Row
from specdec.flags import UsageError


def jsonl(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


# ---- custom ------------------------------------------------------------------------------
def test_custom_rows(tmp_path):
    f = jsonl(tmp_path / "c.jsonl", [{"prompt": "def f(x):"}, "",
                                     {"prompt": "import os", "output_tokens": 7,
                                      "category": "code"}])
    d = datasets.load("custom", str(f))
    assert d.rows() == [Row("def f(x):", None, None), Row("import os", 7, "code")]
    assert [c.where for c in d.conversations] == [f"{f}:1", f"{f}:3"]  # the blank line: none
    assert d.skipped == [] and d.warnings() == []


@pytest.mark.parametrize("line, match", [
    ('{"prompt": "a", "max_tokens": 5}', r":2: unknown keys \['max_tokens'\]; allowed: prompt, "
                                         "output_tokens, category"),
    ('{"output_tokens": 5}', r":2: no 'prompt' \(required"),
    ('{"prompt": ""}', r":2: prompt='': allowed a non-empty string"),
    ('{"prompt": "a", "output_tokens": 0}', r":2: output_tokens=0: allowed an int >= 1"),
    ('{"prompt": "a", "output_tokens": "9"}', r":2: output_tokens='9': allowed an int >= 1"),
    ('{"prompt": "a", "category": 3}', r":2: category=3: allowed a non-empty string"),
    ('["a"]', r":2: expected a JSON object, got list"),
    ('{"prompt": "a",', r":2: not valid JSON"),
])
def test_custom_malformed_line_is_named(tmp_path, line, match):
    f = jsonl(tmp_path / "c.jsonl", [{"prompt": "fine"}, line])
    with pytest.raises(DatasetError, match=match):
        datasets.load("custom", str(f))


# ---- sharegpt ----------------------------------------------------------------------------
SHAREGPT = [
    {"id": "a", "conversations": [{"from": "human", "value": "hi there"},
                                  {"from": "gpt", "value": "one two three"},
                                  {"from": "human", "value": "more"}]},
    {"id": "b", "conversations": [{"from": "system", "value": "be brief"},
                                  {"from": "human", "value": "why"},
                                  {"from": "gpt", "value": "x"}]},
    {"id": "c", "conversations": [{"from": "gpt", "value": "I start"}]},
]


def test_sharegpt_first_human_turn_and_its_reply_length(tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SHAREGPT, indent=1))
    words = lambda s: len(s.split())  # noqa: E731  a stand-in token count
    d = datasets.load("sharegpt", str(f), count_tokens=words)
    assert d.rows() == [Row("hi there", 3, None), Row("why", 1, None)]
    assert d.conversations[0].turns == ["hi there", "more"]
    assert d.conversations[0].max_tokens == [3, None]  # the last turn has no reply
    # entries start on lines 2, 16 and 30 of the indented list; c has no human turn
    starts = [n for n, line in enumerate(f.read_text().splitlines(), 1) if line == " {"]
    assert [c.where for c in d.conversations] == [f"{f}:{starts[0]}", f"{f}:{starts[1]}"]
    assert d.skipped == [f"{f}:{starts[2]}: no human turn"]
    # without a tokenizer the reply lengths are unknown: the bench's output_len applies
    assert datasets.load("sharegpt", str(f)).rows()[0] == Row("hi there", None, None)


def test_sharegpt_jsonl_too(tmp_path):
    f = jsonl(tmp_path / "s.jsonl", SHAREGPT[:2])
    assert [r.prompt for r in datasets.load("sharegpt", str(f)).rows()] == ["hi there", "why"]


@pytest.mark.parametrize("entry, match", [
    ({"id": "x"}, r"conversations=None: allowed a list"),
    ({"conversations": [{"from": "robot", "value": "a"}]}, r"conversations\[0\]=.*robot.*allowed"),
    ({"conversations": [{"from": "human", "value": 3}]}, r"conversations\[0\]=.*allowed"),
    ("just text", r"expected a JSON object, got str"),
])
def test_sharegpt_malformed_entry_is_named_by_its_line(tmp_path, entry, match):
    f = tmp_path / "s.json"
    f.write_text("[\n" + json.dumps(SHAREGPT[0]) + ",\n" + json.dumps(entry) + "\n]\n")
    with pytest.raises(DatasetError, match=rf"s.json:3: {match}"):
        datasets.load("sharegpt", str(f))


def test_sharegpt_broken_json_names_the_line(tmp_path):
    f = tmp_path / "s.json"
    f.write_text('[\n{"conversations": []},\n{"conversations": [}\n]')
    with pytest.raises(DatasetError, match=r"s.json:3: not valid JSON"):
        datasets.load("sharegpt", str(f))
    f.write_text('[\n{"conversations": []}\n{"conversations": []}\n]')
    with pytest.raises(DatasetError, match=r"s.json:3: expected ',' or '\]' after the list "
                                           "element that starts on line 2"):
        datasets.load("sharegpt", str(f))
    for tail, line in (('\n[{"conversations": []}]', 4), (" x", 3)):  # a second list, or text
        f.write_text('[\n{"conversations": [{"from": "human", "value": "hi"}]}\n]' + tail)
        with pytest.raises(DatasetError, match=rf"s.json:{line}: text after the list's closing"):
            datasets.load("sharegpt", str(f))


# ---- the file's text -----------------------------------------------------------------------
def test_any_json_string_and_a_byte_order_mark_are_read(tmp_path):
    """Lines end at "\\n": U+2028, U+2029 and U+0085 stand unescaped in a JSON string (as
    json.dumps(ensure_ascii=False) writes them), CRLF ends a line too, and a leading UTF-8
    byte-order mark (Windows editors write one) is not part of the first line."""
    prompts = ["one\u2028two", "three\u2029four\u0085five", "caf\u00e9"]
    f = tmp_path / "c.jsonl"
    f.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(json.dumps({"prompt": p}, ensure_ascii=False)
                                              for p in prompts).encode())
    d = datasets.load("custom", str(f))
    assert [r.prompt for r in d.rows()] == prompts
    assert [c.where for c in d.conversations] == [f"{f}:{n}" for n in (1, 2, 3)]
    g = tmp_path / "s.json"
    g.write_bytes(b"\xef\xbb\xbf" + json.dumps(SHAREGPT).encode())
    assert len(datasets.load("sharegpt", str(g)).conversations) == 2


def test_a_byte_that_is_not_utf8_is_named_by_its_line(tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_bytes(b'{"prompt": "fine"}\n{"prompt": "caf\xe9"}\n')  # latin-1
    with pytest.raises(DatasetError, match=r"c.jsonl:2: byte 0xe9 is not UTF-8"):
        datasets.load("custom", str(f))


# ---- spec_bench --------------------------------------------------------------------------
def test_spec_bench_turns_and_categories(tmp_path):
    f = jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["Write a haiku.", "In French."],
         "reference": []},
        {"question_id": 82, "category": "qa", "turns": ["Why is the sky blue?"]}])
    d = datasets.load("spec_bench", str(f))
    assert d.rows() == [Row("Write a haiku.", None, "writing"),
                        Row("Why is the sky blue?", None, "qa")]
    assert d.conversations[0] == Conversation(["Write a haiku.", "In French."], [None, None],
                                              "writing", f"{f}:1")


@pytest.mark.parametrize("entry, match", [
    ({"turns": ["a"]}, r":2: no 'category'"),
    ({"category": "qa"}, r":2: no 'turns'"),
    ({"category": "qa", "turns": []}, r":2: turns=\[\]: allowed a non-empty list"),
    ({"category": "qa", "turns": "a"}, r":2: turns='a': allowed a non-empty list"),
    ({"category": "qa", "turns": ["a", 5]}, r":2: turns\[1\]=5: allowed a non-empty string"),
    ({"category": None, "turns": ["a"]}, r":2: category=None: allowed a non-empty string"),
])
def test_spec_bench_malformed_line_is_named(tmp_path, entry, match):
    f = jsonl(tmp_path / "q.jsonl", [{"category": "qa", "turns": ["fine"]}, entry])
    with pytest.raises(DatasetError, match=match):
        datasets.load("spec_bench", str(f))


# ---- the pair of flags -------------------------------------------------------------------
def test_name_and_path_must_fit(tmp_path):
    assert datasets.load("random", None) is None
    with pytest.raises(UsageError, match="--dataset-name='hf': allowed random, custom"):
        datasets.load("hf", "x")
    with pytest.raises(UsageError, match="--dataset-path='x' goes with --dataset-name custom"):
        datasets.load("random", "x")
    with pytest.raises(UsageError, match="--dataset-name custom reads --dataset-path FILE"):
        datasets.load("custom", None)
    with pytest.raises(UsageError, match="is not a file"):
        datasets.load("custom", str(tmp_path / "missing.jsonl"))
    empty = jsonl(tmp_path / "s.jsonl", [SHAREGPT[2]])
    with pytest.raises(UsageError, match=r"holds no prompt \(1 entries left out, e.g. .*no "
                                         "human turn"):
        datasets.load("sharegpt", str(empty))


def test_pick_is_a_seeded_shuffle_that_oversamples():
    items = list("abcde")
    assert sorted(datasets.pick(items, 5, 0)) == items
    assert datasets.pick(items, 5, 0) == datasets.pick(items, 5, 0) != datasets.pick(items, 5, 1)
    seven = datasets.pick(items, 7, 3)
    assert seven[5:] == seven[:2]


# ---- the in-process bench over a dataset -------------------------------------------------
def test_in_process_bench_runs_one_config_per_category(tmp_path):
    """Each category is its own run: its rows only (their output_tokens), so its tok/s and
    acceptance length are its own; a row too long for the model is left out and named."""
    from rich.console import Console

    from specdec.bench import itl, report
    long = "x = 1\n" * 2000  # far over the embedded model's 1024 positions
    f = jsonl(tmp_path / "c.jsonl", [
        {"prompt": "def add(a, b):\n    return", "output_tokens": 3, "category": "short"},
        {"prompt": "import os\nimport sys\n", "output_tokens": 3, "category": "short"},
        {"prompt": "class Stack:\n    def push(self, x):", "output_tokens": 6, "category": "long"},
        {"prompt": long, "category": "huge"},  # no row of "huge" fits: no run of it
        {"prompt": "x = [", "output_tokens": 2}])  # no category: a run of its own
    sweep = itl.check_sweep(dict(methods=["none", "suffix"], modes=["padded"], k=[2],
                                 concurrency=[2], output_len=[4], repeats=1, warmup=0,
                                 dataset_name="custom", dataset_path=str(f)))
    r = itl.run_sweep(sweep, Console(quiet=True))
    got = {(c["method"], c["category"]): c for c in r["configs"]}
    assert sorted(got, key=str) == [("none", "long"), ("none", "short"), ("none", None),
                                    ("suffix", "long"), ("suffix", "short"), ("suffix", None)]
    for (method, category), c in got.items():
        assert c["status"] == "ok" and c["prompt_len"] == 0
        assert c["name"] == (f"{'none' if method == 'none' else 'suffix-padded-k2'}-c2-dataset-"
                             + (f"{category}-" if category else "") + "o4")
        # two requests per run, of its rows only: "short" rows ask 3 tokens each, the one
        # "long" row that fits 6, the row without a category 2
        assert c["repeats"][0]["output_tokens"] == {"short": 6, "long": 12, None: 4}[category]
    assert r["prompt_source"] == f"custom dataset {f}"
    (warning,) = [w for w in r["warnings"] if "left out" in w]
    assert f"1 rows too long left out: {f}:4: " in warning and "> max_model_len 1024" in warning
    console = Console(record=True, width=200)
    console.print(report.results_table(r))
    lines = console.export_text().splitlines()
    assert "category" in lines[2] and sum(" short " in x for x in lines) == 2


def test_in_process_bench_dataset_refusals():
    from specdec.bench import itl
    with pytest.raises(UsageError, match="sweep --dataset-name custom reads --dataset-path"):
        itl.check_sweep(dict(dataset_name="custom"))
    with pytest.raises(UsageError, match="give dp=1 and no synthetic"):
        itl.check_sweep(dict(dataset_name="custom", dataset_path=__file__,
                             synthetic="llama-tiny"))
