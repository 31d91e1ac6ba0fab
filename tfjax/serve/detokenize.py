"""A sample's text as its tokens arrive: pieces of whole UTF-8 characters only, and no
text that may be the start of a stop string until it is known not to be one.

`Detokenizer` decodes a window of the latest tokens (vLLM's incremental detokenizer:
the prompt's last tokens first, so a leading space survives tokenizers that drop one at
the start); `SampleText` adds the stop strings: it holds back the longest end of the
text that begins one, and cuts the answer before the stop string that ended it, as
OpenAI's answers do. Sent pieces concatenate to the whole answer. See docs/serving.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["CONTEXT", "Detokenizer", "SampleText"]

CONTEXT = 5  # prompt tokens decoded before the first generated one
_PARTIAL = "\ufffd"  # what decoding makes of an incomplete UTF-8 character


class Detokenizer:
    """`add(token)` -> the new complete text (maybe ""); `flush()` -> what is left."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int] = ()):
        self.decode = decode
        self.tokens = [int(t) for t in list(prompt)[-CONTEXT:]]
        self.prefix = 0  # the window's first token: text before it was sent
        self.read = len(self.tokens)  # tokens whose text was sent

    def add(self, token: int) -> str:
        self.tokens.append(int(token))
        return self._advance(final=False)

    def flush(self) -> str:
        """The text of tokens held back (an incomplete character at the end stays a
        replacement character: no byte will complete it)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self.read == len(self.tokens):
            return ""
        before = self.decode(self.tokens[self.prefix:self.read])
        after = self.decode(self.tokens[self.prefix:])
        if not final and (len(after) <= len(before) or after.endswith(_PARTIAL)):
            return ""  # no new text yet, or its last character is not complete
        self.prefix, self.read = self.read, len(self.tokens)
        return after[len(before):]


class SampleText:
    """One sample's answer: `add(token, ...)` -> the text that may be sent now.

    `text` is everything decoded, `sent` how much of it went out; after the final
    `add` (`final=True`), `answer` is the whole answer."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int] = (),
                 stop: Sequence[str] = ()):
        self.detokenizer = Detokenizer(decode, prompt)
        self.stop = [s for s in stop if s]
        self.text = ""
        self.sent = 0

    @property
    def answer(self) -> str:
        return self.text[:self.sent]

    def add(self, token: int | None, *, final: bool = False, stopped: bool = False) -> str:
        """`token` (None: none, e.g. an aborted sample); `final`: the sample ended, so
        everything goes out; `stopped`: it ended on a stop string, which is cut off
        with what follows it."""
        if token is not None:
            self.text += self.detokenizer.add(token)
        if not final:
            end = len(self.text) - self._held()
        else:
            self.text += self.detokenizer.flush()
            end = len(self.text)
            if stopped:
                found = [i for i in (self.text.find(s, self.sent) for s in self.stop) if i >= 0]
                end = min(found, default=end)
        end = max(end, self.sent)
        piece, self.sent = self.text[self.sent:end], end
        if final:
            self.text = self.text[:end]
        return piece

    def _held(self) -> int:
        """Characters at the end of the unsent text that begin some stop string."""
        unsent = len(self.text) - self.sent
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, unsent), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
