"""TextStream decodes incrementally and hands out what decoding everything each time would."""

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from specdec.engine.inputs import DEFAULT_MODEL
from specdec.engine.text_stream import TextStream

BYTE_LEVEL = Tokenizer.from_file(f"{DEFAULT_MODEL}/tokenizer.json")


def sentencepiece_like() -> Tokenizer:
    """A Llama-2-style vocabulary: "▁" for spaces, <0xNN> byte tokens for the rest."""
    pieces = ["<unk>", "▁the", "▁cat", "s", "▁", "é", "ing", "▁a", "b"]
    pieces += [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[],
                               unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return tok


SENTENCEPIECE = sentencepiece_like()


class FullDecodeStream:
    """The reference: decode every output token on each chunk, send what is stable."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.ids, self.sent, self.text = [], 0, ""

    def add(self, ids, final):
        self.ids += ids
        text = self.tokenizer.decode(self.ids)
        start = max(0, self.sent - self.hold)
        searched = text if final else text.rstrip("\ufffd")  # an incomplete character: not yet
        cuts = [i for i in (searched.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            text, final = text[:min(cuts)], True
        self.text = text
        end = len(text)
        if not final:
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            end -= self.hold
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta, bool(cuts)


def rewrites_nothing_complete(texts: list[str]) -> bool:
    """Each token's text (``texts[n]``: the first n tokens decoded) keeps the text before it,
    but for a trailing incomplete character (U+FFFD) it completes. Invalid UTF-8 can make a
    decoder rewrite earlier, complete text, which what was sent cannot follow (the class
    doc); the properties hold elsewhere."""
    return all(b.startswith(a.rstrip("\ufffd")) for a, b in zip(texts, texts[1:]))


@settings(max_examples=150, deadline=None)
@given(data=st.data(), which=st.sampled_from(["byte-level", "sentencepiece"]))
def test_incremental_equals_full_decode(data, which):
    tok = BYTE_LEVEL if which == "byte-level" else SENTENCEPIECE
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), min_size=1, max_size=40))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=8))) \
        if len(ids) > 1 else []
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    texts = [tok.decode(ids[:n]) for n in range(len(ids) + 1)]
    assume(rewrites_nothing_complete(texts))
    full = texts[-1]
    stop = []
    if full and data.draw(st.booleans()):  # stop strings taken from the text itself
        i = data.draw(st.integers(0, len(full) - 1))
        stop = [full[i:i + data.draw(st.integers(1, 4))]]
    got, want = TextStream(tok, stop), FullDecodeStream(tok, stop)
    sent = ""
    for n, chunk in enumerate(chunks):
        final = n == len(chunks) - 1
        want_delta, stopped = want.add(chunk, final)
        delta = got.add(chunk, final)
        assert (delta, got.stopped) == (want_delta, stopped)  # same text at the same time
        sent += delta
        if stopped:
            break
    if not got.stopped:
        assert got.text == want.text == full


@settings(max_examples=200, deadline=None)
@given(data=st.data(), which=st.sampled_from(["byte-level", "sentencepiece"]),
       include_stop=st.booleans())
def test_chunks_stop_where_one_token_at_a_time_does(data, which, include_stop):
    """A speculative step hands several tokens at once: the request must stop where the same
    tokens one at a time stop it (token ids, text, which stop string), with several stop
    strings and ``min_tokens`` (a stop string must end after the first min_tokens tokens'
    text, as vLLM's stop_check_offset), and keep more than min_tokens tokens."""
    tok = BYTE_LEVEL if which == "byte-level" else SENTENCEPIECE
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), min_size=1, max_size=30))
    texts = [tok.decode(ids[:n]) for n in range(len(ids) + 1)]
    assume(rewrites_nothing_complete(texts))
    full = texts[-1]
    stop = data.draw(st.lists(st.sampled_from(sorted({full[i:i + k] for i in range(len(full))
                                                      for k in (1, 2, 3, 5)} - {""}))
                              if full else st.just("x"), min_size=1, max_size=3))
    min_tokens = data.draw(st.integers(0, len(ids)))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=6))) \
        if len(ids) > 1 else []

    def run(chunks):
        stream = TextStream(tok, stop, include_stop, min_tokens)
        sent = "".join(stream.add(c, n == len(chunks) - 1) for n, c in enumerate(chunks))
        return stream.token_ids, stream.text, stream.stop_str, sent

    got = run([ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])])
    assert got == run([[i] for i in ids])
    assert got[2] is None or len(got[0]) > min_tokens


def test_a_stop_string_within_the_first_min_tokens_is_not_one():
    """min_tokens=3 and one chunk of 5 tokens whose first two spell the stop string: it is
    not a stop (vLLM searches only past the min_tokens-th token's text), its later
    occurrence is."""
    the, cat = BYTE_LEVEL.encode(" the").ids, BYTE_LEVEL.encode(" cat").ids
    ids = the + cat + cat + the + cat
    stream = TextStream(BYTE_LEVEL, [" the"], min_tokens=len(the + cat))
    stream.add(ids, final=False)
    assert stream.stop_str == " the" and stream.token_ids == the + cat + cat + the
    assert stream.text == BYTE_LEVEL.decode(the + cat + cat)


@pytest.mark.parametrize("tok", [BYTE_LEVEL, SENTENCEPIECE], ids=["byte-level", "sentencepiece"])
def test_long_output_decodes_a_bounded_window(tok):
    """A chunk decodes the tokens since the text last ended on a complete character and the
    window before them, whatever the output length; the last chunk decodes all once."""
    calls = []

    class Counting:
        def decode(self, ids):
            calls.append(len(ids))
            return tok.decode(ids)

    stream = TextStream(Counting(), [])
    ids = [tok.token_to_id("▁the") or 300, tok.token_to_id("s") or 301] * 500
    text = "".join(stream.add([i], final=False) for i in ids) + stream.add([], final=True)
    assert text == tok.decode(ids)
    assert max(calls[:-1]) <= 4 and calls[-1] == len(ids)


def test_speculative_steps_stop_where_plain_decoding_does():
    """Greedy: a drafter's several tokens a step end the request where plain decoding's one
    token a step does, with several stop strings and min_tokens (stop strings drawn from
    plain's own text: one in its first tokens, two that end in one step)."""
    from specdec import LLM, SamplingParams
    prompts = ["The quick brown fox", "def add(a, b):\n    return", "import os\nimport sys\n"]
    engines = {m: LLM(max_model_len=128, speculative_config=None if m is None else
                      {"method": m, "num_speculative_tokens": 3})
               for m in (None, "mtp", "eagle3", "suffix")}
    plain = engines[None].generate(prompts, SamplingParams(max_tokens=24, temperature=0.0,
                                                           ignore_eos=True))
    cases = []
    for out in plain:
        text = out.outputs[0].text
        for at in (2, len(text) // 3, len(text) // 2):
            cases.append((out.prompt, [text[at:at + 4], text[at + 2:at + 3], "never"], 0))
            cases.append((out.prompt, [text[:3], text[at:at + 2]], 5))
    for prompt, stop, min_tokens in cases:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop,
                                min_tokens=min_tokens)
        got = {}
        for method, llm in engines.items():
            runs = 2 if method == "suffix" else 1  # the second drafts from the first's output
            for _ in range(runs):
                o = llm.generate([prompt], params)[0].outputs[0]
            got[method] = (o.token_ids, o.text, o.finish_reason, o.stop_reason)
        assert all(g == got[None] for g in got.values()), (stop, min_tokens, got)
        assert got[None][2] != "stop" or len(got[None][0]) > min_tokens
