"""A request's output text as its tokens arrive: incremental decoding and stop strings."""


class TextStream:
    """Decodes the growing output and hands out only text that will not change.

    Held back until more tokens arrive or the request ends: a trailing incomplete UTF-8
    sequence (decoded as U+FFFD) and the last ``len(longest stop string) - 1`` characters
    (a stop string may be starting). A stop string ends the text just before it.
    Without a tokenizer the text stays empty (token ids only).
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop string once found)
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False  # a stop string was found

    def add(self, token_ids: list[int], final: bool) -> str:
        """Append a chunk's tokens; -> the text to send now (all of it once ``final`` or stopped)."""
        self.token_ids += token_ids
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.token_ids)
        start = max(0, self.sent - self.hold)  # a stop string may straddle sent text
        cuts = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            text, self.stopped, final = text[:min(cuts)], True, True
        self.text = text
        end = len(text)
        if not final:
            end -= self.hold
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta
