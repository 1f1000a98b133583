"""A request's output text as its tokens arrive: incremental decoding and stop strings (the
API server's streams, and ``EngineCore`` for a request's ``SamplingParams.stop``)."""

from os.path import commonprefix

REPLACEMENT = "\ufffd"  # what a decoder makes of an incomplete UTF-8 sequence


class TextStream:
    """Decodes the growing output and hands out only text that will not change.

    Incremental: a chunk decodes only the tokens since the text last ended on a complete
    character, with the tokens of the text appended before them as context (a decoder may
    treat a window's first token differently, e.g. strip its leading space), so a token costs
    the same at output position 10 or 10,000; the request's last chunk decodes all its tokens
    once, so the final ``text`` is the tokenizer's decode of the output. (A decoder that
    rewrites earlier text when later tokens arrive, e.g. byte fallback turning a valid byte
    into U+FFFD because the bytes after it are invalid UTF-8, cannot change what was sent;
    a full decode per chunk could not either.)

    Held back until more tokens arrive or the request ends: a trailing incomplete UTF-8
    sequence (decoded as U+FFFD) and the last ``len(longest stop string) - 1`` characters
    (a stop string may be starting). A stop string ends the text just before it (with
    ``include_stop``: just after it), and the tokens at the token that completes it:
    ``token_ids`` keeps none after that one (a speculative step brings several tokens at
    once; they are not the request's): a chunk stops where one token at a time would, at the
    first token that ends a stop string, the earliest-starting one when that token ends
    several (``stop_str``). As vLLM, only stop strings that end after the text of the first
    ``min_tokens`` tokens count (one may start before it). Without a tokenizer the text stays
    empty (token ids only).
    """

    def __init__(self, tokenizer, stop: list[str], include_stop: bool = False,
                 min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self.stop_str: str | None = None  # the stop string found
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once found)
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False  # a stop string was found
        self._complete = ""  # the text of token_ids[:read], ending on a complete character
        self._prefix = 0  # token_ids[prefix:read]: the context the next window decodes with
        self._read = 0

    def add(self, token_ids: list[int], final: bool, stop_token: bool = False) -> str:
        """Append a chunk's tokens; -> the text to send now (all of it once ``final`` or
        stopped). ``stop_token``: the chunk's last token (an eos or ``stop_token_ids`` id)
        ended the request; as vLLM, it stays in ``token_ids`` but its text is not the
        output's unless ``include_stop``."""
        if self.stopped:  # the request ended at its stop string: nothing after it is its
            return ""
        if stop_token and token_ids and not self.include_stop:
            delta = self.add(token_ids[:-1], final=True)
            if not self.stopped:
                self.token_ids.append(token_ids[-1])
            return delta
        self.token_ids += token_ids
        if self.tokenizer is None:
            return ""
        # the last chunk decodes everything once: the text a full decode gives
        text = self.tokenizer.decode(self.token_ids) if final else self._decode()
        start = max(0, self.sent - self.hold)  # a stop string may straddle sent text
        if (len(self.token_ids) > self.min_tokens
                and any(text.find(s, start) >= 0 for s in self.stop)
                and (found := self._first_stop(len(token_ids), final)) is not None):
            n, text, at, self.stop_str = found
            del self.token_ids[n:]
            end = at + len(self.stop_str) if self.include_stop else at
            text, self.stopped, final = text[:end], True, True
        self.text = text
        end = len(text)
        if not final:  # an incomplete character, then what a stop string may start with
            while end > self.sent and text[end - 1] == REPLACEMENT:
                end -= 1
            end -= self.hold
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def _first_stop(self, new: int, final: bool) -> tuple[int, str, int, str] | None:
        """The chunk's stop, as one token at a time would find it: the first of the last
        ``new`` tokens (and past the first ``min_tokens``) whose text ends a stop string
        within the characters that token added (an incomplete character at the end, U+FFFD,
        is not text yet but on the request's last token); the earliest-starting one when
        several do. -> (tokens kept, their text, where the stop string starts, the string),
        or None."""
        last = len(self.token_ids)
        first = max(last - new, self.min_tokens) + 1
        before = self.tokenizer.decode(self.token_ids[:first - 1]).rstrip(REPLACEMENT)
        for n in range(first, last + 1):
            text = self.tokenizer.decode(self.token_ids[:n])
            if not (final and n == last):
                text = text.rstrip(REPLACEMENT)
            added = len(commonprefix((before, text)))  # a decoder may rewrite earlier text
            cuts = [(at, s) for s in self.stop
                    if (at := text.find(s, max(0, added - len(s) + 1))) >= 0]
            if cuts:
                at, s = min(cuts, key=lambda c: c[0])
                return n, text, at, s
            before = text
        return None

    def _decode(self) -> str:
        """The text of all output tokens: the complete part plus the tokens after it."""
        ids = self.token_ids
        if self._read == len(ids):
            return self._complete
        before = self.tokenizer.decode(ids[self._prefix:self._read])
        tail = self.tokenizer.decode(ids[self._prefix:])[len(before):]
        if not tail or tail.endswith(REPLACEMENT):  # wait for the rest of the character
            return self._complete + tail
        self._complete += tail
        self._prefix, self._read = self._read, len(ids)
        return self._complete
