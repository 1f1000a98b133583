"""``specdec bench serve`` over datasets and ``--multi-turn`` against a live ``specdec serve
--stub-engine`` (its step echoes the prompt's ids: a reply shows what the server rendered)."""

import asyncio
import json
import pytest

from specdec.bench import multiturn
from specdec.bench import serve as bench_serve
from specdec.bench.datasets import Conversation
from specdec.engine.chat_template import load_chat_template
from specdec.engine.llm import DEFAULT_MODEL
from specdec.models.checkpoint import load_tokenizer

pytest.importorskip("uvicorn")
pytest.importorskip("aiohttp")

MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def stub_url():
    proc, url = bench_serve.launch(["--stub-engine", "4", "--max-num-seqs", "4",
                                    "--max-model-len", str(MAX_MODEL_LEN)])
    yield url
    bench_serve.stop(proc)


def replay(url, convs, concurrency=2, output_len=7, pacing="rounds"):
    body = dict(model=bench_serve.served_model(url), temperature=0.0, stream=True,
                ignore_eos=True, stream_options=dict(include_usage=True,
                                                     continuous_usage_stats=True))
    points = []
    rounds = asyncio.run(multiturn.replay(url, body, convs, concurrency, output_len,
                                          points.append, pacing))
    return rounds, points


def check_histories(convs, recs, output_len=7):
    """Each record's messages = user 1, reply 1, ..., user t, the replies being what the
    server streamed to the conversation's earlier records; the server saw exactly those
    (usage.prompt_tokens = the rendered template's tokens, and the stub's reply echoes that
    prompt's first ids)."""
    tok, render = load_tokenizer(DEFAULT_MODEL), load_chat_template(DEFAULT_MODEL)
    replies = {}  # (conversation, turn) -> the reply streamed
    for rec in sorted(recs, key=lambda r: r["turn"]):
        i, t = rec["conversation"], rec["turn"]
        assert "error" not in rec
        expected = []
        for j in range(1, t):
            expected += [{"role": "user", "content": convs[i].turns[j - 1]},
                         {"role": "assistant", "content": replies[i, j]}]
        expected.append({"role": "user", "content": convs[i].turns[t - 1]})
        assert rec["messages"] == expected
        ids = tok.encode(render(expected), add_special_tokens=False).ids
        n = convs[i].max_tokens[t - 1] or output_len
        assert rec["prompt_tokens"] == len(ids) and rec["output_tokens"] == n
        assert rec["text"] == tok.decode(ids[:n])
        replies[i, t] = rec["text"]
    assert sorted(replies) == [(i, t + 1) for i, c in enumerate(convs)
                               for t in range(len(c.turns))]


CONVS = [Conversation(["def add(a, b):", "now type it", "and test it"], [6, 5, None], None, "a"),
         Conversation(["import os", "list a folder"], [None, 9], None, "b"),
         Conversation(["class Stack:"], [3], None, "c")]


def test_turn_n_sends_the_earlier_turns_with_their_replies(stub_url):
    """Rounds pacing: round t holds turn t of every conversation that has one; each request's
    messages are its conversation's earlier turns with the replies streamed to them."""
    rounds, points = replay(stub_url, CONVS)
    assert [[r["conversation"] for r in recs] for recs in rounds] == [[0, 1, 2], [0, 1], [0]]
    assert [{r["turn"] for r in recs} for recs in rounds] == [{1}, {2}, {3}]
    assert points == [0, 1, 2, 3]  # a /metrics scrape before each round and after the last
    for t, recs in enumerate(rounds[1:], start=1):  # round t+1 starts after round t ends
        assert min(r["send"] for r in recs) >= max(r["chunks"][-1][0] for r in rounds[t - 1])
    check_histories(CONVS, [r for recs in rounds for r in recs])


def test_free_pacing_sends_each_turn_when_its_reply_ends(stub_url):
    """Free pacing (vLLM's): one round; a conversation's turn t+1 is sent after its turn t's
    reply ended, a client takes the next conversation when its own ends (conversation c waits
    for a free client, not for the others' turns), at most ``concurrency`` in flight, and the
    messages are as in rounds pacing."""
    (recs,), points = replay(stub_url, CONVS, pacing="free")
    assert points == [0, 1]
    check_histories(CONVS, recs)
    end = {(r["conversation"], r["turn"]): r["chunks"][-1][0] for r in recs}
    for r in recs:
        if r["turn"] > 1:
            assert r["send"] >= end[r["conversation"], r["turn"] - 1]
    (third,) = [r for r in recs if r["conversation"] == 2]
    first_done = min(end[0, 3], end[1, 2])  # a client frees when its conversation ends
    assert third["send"] >= first_done
    events = sorted([(r["send"], 1) for r in recs] + [(e, -1) for e in end.values()],
                    key=lambda x: (x[0], x[1]))
    in_flight = [sum(d for _, d in events[:j + 1]) for j in range(len(events))]
    assert max(in_flight) == 2


def test_a_conversation_that_outgrows_the_server_ends_there(stub_url):
    big = "x = 1\n" * 400  # over 512 tokens with its reply
    convs = [Conversation(["hi", big, "after"], [4, 4, 4], None, "a"),
             Conversation(["ok", "fine", "good"], [4, 4, 4], None, "b")]
    rounds, _ = replay(stub_url, convs)
    assert [[r["conversation"] for r in recs] for recs in rounds] == [[0, 1], [0, 1], [1]]
    failed = rounds[1][0]
    assert "HTTP 400" in failed["error"]
    s = multiturn.turn_summary(2, [multiturn.round_figures(rounds[1], {}, {})])
    assert (s["requests"], s["failed"]) == (1, 1) and "HTTP 400" in s["errors"][0]
    assert s["prefix_cache_hit_rate"] is None  # the stub exports no prefix-cache counters


def test_prefix_cache_hit_rate_from_the_counters():
    """Counters in /metrics (vLLM's names, ``_total`` samples) -> hits / queries per round;
    a server without them: None (shown as n/a)."""
    def scrape(q, h):
        return {("vllm:prefix_cache_queries_total", None): q,
                ("vllm:prefix_cache_hits_total", None): h}

    assert multiturn.prefix_cache_counts(scrape(10, 4)) == (10, 4)
    assert multiturn.prefix_cache_counts({("specdec:step_seconds_count", None): 3}) is None
    rec = dict(conversation=0, turn=1, messages=[], send=0.0, chunks=[(0.01, 1), (0.02, 3)],
               output_tokens=4, prompt_tokens=20, text="abcd")
    rounds = [multiturn.round_figures([rec], scrape(100, 0), scrape(160, 45)),
              multiturn.round_figures([rec], scrape(160, 45), scrape(200, 75))]
    s = multiturn.turn_summary(2, rounds)
    assert s["prefix_cache_hit_rate"] == pytest.approx((45 + 30) / (60 + 40))
    assert s["output_tokens_per_s"] == pytest.approx(4 / 0.02)
    assert s["ttft_ms"]["p50"] == pytest.approx(10.0) and s["prompt_tokens_mean"] == 20


def run_cli(url, tmp_path, capsys, *flags):
    from specdec.commands.cli import main
    code = main(["bench", "serve", "--base-url", url, "--repeats", "1", "--warmup", "1",
                 "--output-len", "5", "--out", str(tmp_path), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err[-2000:]
    return out, json.loads((tmp_path / "results.json").read_text())


def test_multi_turn_command_reports_per_turn(stub_url, tmp_path, capsys):
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"category": "a", "turns": ["one", "two", "three"]},
        {"category": "b", "turns": ["alpha", "beta"]}]) + "\n")
    out, r = run_cli(stub_url, tmp_path, capsys, "--multi-turn", "2", "--concurrency", "2",
                     "--dataset-name", "spec_bench", "--dataset-path", str(f))
    assert r["kind"] == "multi_turn" and r["plots"] == ["turns.png"]
    (c,) = r["configs"]
    # --multi-turn 2: the first conversation's third turn is never sent
    assert [(t["turn"], t["requests"], t["failed"]) for t in c["turns"]] == [(1, 2, 0), (2, 2, 0)]
    assert all(t["output_tokens"] == 2 * 5 for t in c["turns"])
    assert c["turns"][1]["prompt_tokens_mean"] > c["turns"][0]["prompt_tokens_mean"]
    assert [x["messages"] for x in c["repeats"][0][1]["requests_sent"]] == [3, 3]
    assert "turn" in out and "n/a" in out and (tmp_path / "turns.png").stat().st_size > 0
    assert c["pacing"] == "rounds" and c["overall"]["output_tokens"] == 4 * 5
    span = sum(x["span_s"] for x in c["repeats"][0])
    assert c["overall"]["output_tokens_per_s"] == pytest.approx(4 * 5 / span)


def test_free_pacing_command_reports_the_whole_replay(stub_url, tmp_path, capsys):
    """--multi-turn-pacing free: per turn TTFT and prompt tokens only (turns overlap); tokens/s
    over the replay's span, in the "all" row."""
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps({"category": "agent",
                                       "turns": [f"turn {j} of {i}" for j in range(3)]})
                           for i in range(3)) + "\n")
    out, r = run_cli(stub_url, tmp_path, capsys, "--multi-turn", "3", "--concurrency", "2",
                     "--num-prompts", "3", "--multi-turn-pacing", "free", "--dataset-name",
                     "spec_bench", "--dataset-path", str(f))
    (c,) = r["configs"]
    assert c["pacing"] == "free" and r["sweep"]["multi_turn_pacing"] == "free"
    assert [(t["turn"], t["requests"]) for t in c["turns"]] == [(1, 3), (2, 3), (3, 3)]
    assert all(t["output_tokens_per_s"] is None and t["ttft_ms"]["p50"] > 0 for t in c["turns"])
    (whole,) = c["repeats"][0]  # one round: the replay
    assert len(whole["requests_sent"]) == 9 and c["overall"]["output_tokens"] == 9 * 5
    assert c["overall"]["output_tokens_per_s"] == pytest.approx(9 * 5 / whole["span_s"])
    assert "free pacing" in out and "all" in out


# one of these runs records no inter-token latency: its ITL box plots without NumPy's all-NaN
# warning
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_dataset_categories_are_one_run_each(stub_url, tmp_path, capsys):
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "def f(x):", "output_tokens": 3, "category": "code"},
        {"prompt": "The sky is", "output_tokens": 6, "category": "prose"},
        {"prompt": "y = " * 600, "category": "prose"},  # too long for 512
        {"prompt": "y = " * 600, "category": "huge"},  # no row of "huge" fits: no run of it
        {"prompt": "x = [", "output_tokens": 2}]) + "\n")  # no category: a run of its own
    out, r = run_cli(stub_url, tmp_path, capsys, "--concurrency", "2", "--dataset-name",
                     "custom", "--dataset-path", str(f))
    got = {c["category"]: c for c in r["configs"]}
    assert list(got) == ["code", "prose", None]
    for cat, n in (("code", 3), ("prose", 6), (None, 2)):  # each run: its category's rows only
        assert [q["output_tokens"] for q in got[cat]["repeats"][0]["requests"]] == [n, n]
    warnings = " ".join(r["warnings"])
    assert "category" in out and f"{f}:3: " in warnings and f"{f}:4: " in warnings


def test_multi_turn_refusals(tmp_path, capsys):
    from specdec.commands.cli import main
    for flags, match in ((["--multi-turn", "0"], "--multi-turn=0: allowed an int >= 1"),
                         (["--multi-turn", "2", "--request-rate", "5"], "no arrival rate"),
                         (["--multi-turn-pacing", "free"], "--multi-turn-pacing=free without "
                                                           "--multi-turn"),
                         (["--dataset-name", "sharegpt"], "reads --dataset-path FILE")):
        code = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--out",
                     str(tmp_path), *flags])
        err = capsys.readouterr().err
        assert code == 2 and match in err, err
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--multi-turn", "2",
              "--multi-turn-pacing", "fast"])
    assert "invalid choice: 'fast' (choose from 'rounds', 'free')" in capsys.readouterr().err


def test_no_run_replays_a_conversation_an_earlier_run_sent(stub_url, tmp_path, capsys,
                                                          monkeypatch):
    """A run that replayed an earlier run's conversation would find its prefixes in the
    prefix cache and its replies in a suffix drafter's cache: every repeat at every
    concurrency takes the next conversations of one seeded shuffle, which recur only once
    the file has no unsent one left (generated ones: each run its own)."""
    f = tmp_path / "q.jsonl"
    f.write_text("\n".join(json.dumps({"category": "c", "turns": [f"task {i}", "more"]})
                           for i in range(7)) + "\n")
    replay, sent = multiturn.replay, []

    async def recorded(url, body, convs, *args):
        sent.append([c.turns[0] for c in convs])
        return await replay(url, body, convs, *args)
    monkeypatch.setattr(multiturn, "replay", recorded)
    run_cli(stub_url, tmp_path, capsys, "--multi-turn", "2", "--concurrency", "1,2",
            "--repeats", "2", "--dataset-name", "spec_bench", "--dataset-path", str(f))
    assert [len(s) for s in sent] == [1, 1, 2, 2]
    flat = [x for s in sent for x in s]
    assert len(set(flat)) == 6
    sent.clear()
    run_cli(stub_url, tmp_path, capsys, "--multi-turn", "2", "--concurrency", "1,2",
            "--repeats", "2", "--dataset-name", "spec_bench", "--dataset-path", str(f),
            "--num-prompts", "3")  # 12 conversations of 7: they recur once all were sent
    flat = [x for s in sent for x in s]
    assert len(set(flat[:7])) == 7 and flat[7:] == flat[:5]
    sent.clear()
    run_cli(stub_url, tmp_path, capsys, "--multi-turn", "1", "--concurrency", "1,2",
            "--prompt-len", "8")
    flat = [x for s in sent for x in s]
    assert len(flat) == 3 and len(set(flat)) == 3  # generated: every run its own


def test_a_malformed_dataset_fails_before_a_server_starts_or_a_request_is_sent(
        tmp_path, capsys, monkeypatch):
    from specdec.commands.cli import main

    def launch(*_):
        raise AssertionError("a server was launched before the dataset was read")
    monkeypatch.setattr(bench_serve, "launch", launch)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"category": "c", "turns": ["a"]}\n{"category": "c", "turn": ["b"]}\n')
    custom = tmp_path / "custom.jsonl"
    custom.write_text('{"prompt": "a", "output_token": 5}\n')
    for flags in (["--launch", "--multi-turn", "2", "--dataset-name", "spec_bench",
                   "--dataset-path", str(bad)],
                  ["--launch", "--dataset-name", "custom", "--dataset-path", str(custom)],
                  # port 9: nothing listens, so any request would fail before the file
                  ["--base-url", "http://127.0.0.1:9", "--multi-turn", "2", "--dataset-name",
                   "spec_bench", "--dataset-path", str(bad)]):
        code = main(["bench", "serve", "--out", str(tmp_path / "out"), *flags])
        err = capsys.readouterr().err
        assert code == 2 and ("bad.jsonl:2: no 'turns'" in err
                              or "custom.jsonl:1: unknown keys ['output_token']" in err), err


def test_multi_turn_names_the_entries_it_left_out(stub_url, tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "I start"}]},
                             {"conversations": [{"from": "human", "value": "hi"},
                                                {"from": "gpt", "value": "a b"},
                                                {"from": "human", "value": "more"}]}], indent=1))
    out, r = run_cli(stub_url, tmp_path, capsys, "--multi-turn", "2", "--concurrency", "1",
                     "--dataset-name", "sharegpt", "--dataset-path", str(f))
    (warning,) = r["warnings"]
    assert f"1 entries without a prompt left out: {f}:2: no human turn" in warning
    assert "no human turn" in out
