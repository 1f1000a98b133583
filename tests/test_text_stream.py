"""TextStream decodes incrementally and hands out what decoding everything each time would."""

import pytest
from hypothesis import given, settings
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
        cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            text, final = text[:min(cuts)], True
        self.text = text
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta, bool(cuts)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), which=st.sampled_from(["byte-level", "sentencepiece"]))
def test_incremental_equals_full_decode(data, which):
    tok = BYTE_LEVEL if which == "byte-level" else SENTENCEPIECE
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), min_size=1, max_size=40))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(ids) - 1), max_size=8))) \
        if len(ids) > 1 else []
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    full = tok.decode(ids)
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
