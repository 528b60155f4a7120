"""Stop strings: a request's output text, detokenized as its tokens arrive and cut at the first
stop string (vLLM's `SamplingParams.stop` and `include_stop_str_in_output`).

`RequestText` is the one implementation: the engine keeps one per request that has stop strings
(or that a streaming server asked text of) and ends the request with finish_reason "stop" the
moment a stop string is complete, like a stop token (its KV freed then); `LLM.generate` and the
server both read the text from it.

Per token the work is bounded by the new text, not the output so far:

- detokenization is incremental (vLLM's offsets): the tokens since the last committed boundary
  are decoded with the previous few as context, and what the context alone decodes to is taken
  off. Text ending in U+FFFD (an incomplete UTF-8 character split across tokens) is held until
  a later token completes it, so the committed text never shows half a character. Committed
  text plus what is held equals `decode(all ids)` for the tokenizers of this project (SmolLM2's
  byte-level BPE, the toy model's ids; tests/test_stop_strings.py checks random id sequences);
- a stop string is searched for in the new text plus the last len(longest stop) - 1 characters
  before it, the only place a stop string that was not complete before can be now (one that
  spans several tokens included);
- the stop string that completes first in the text wins (of two complete at the same character,
  the longer one): the text ends before it, or after it with `include_stop_str_in_output`. The
  token that completed it is the request's last (it stays in the token ids, as a stop token
  does);
- for streaming, `visible` leaves out the tail that could still grow into a stop string, so a
  client never sees text that a stop string later cuts (with `include_stop_str_in_output` there
  is nothing to hold back: a stop string then cuts only text after it, which is new); `marks`
  record how much was visible after each token, for one delta per token.

At the request's end (`finish`), the text still held (a character never completed) is added and
searched for a stop string too, so a stop string found only there still cuts the text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Decode = Callable[[Sequence[int]], str]


def decode_text(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """Text of generated ids without special tokens (the stop token "<|im_end|>" ...), as
    vLLM's default `skip_special_tokens=True` does; the ids keep them."""
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    except TypeError:  # a tokenizer without the option (the reference model's IdTokenizer)
        return tokenizer.decode(token_ids)


def decoder(tokenizer: Any) -> Decode:
    """`decode(ids) -> str` over `tokenizer` (special tokens skipped: `decode_text`)."""
    return lambda ids: decode_text(tokenizer, ids)


class RequestText:
    """One request's output text as its tokens arrive, cut at the first stop string.

    decode: ids -> text (`decoder(tokenizer)`); stops: the stop strings (none empty);
    include_stop: keep the stop string in the text (`include_stop_str_in_output`).

    `add(token)` takes the next token and returns the text that became visible with it
    (possibly ""); `stopped` turns True when a stop string is complete (later tokens are
    ignored); `text` is the committed text (after a stop: the final, cut text); `visible` how
    much of it may be shown now; `marks[i]` that length after token i; `num_tokens` the tokens
    taken, up to the one that completed a stop string; `finish()` the whole text at the end
    (with what was held); `flush()` the part of it not yet visible.

    The text is kept as the pieces committed (joined only when `text` is read), so a token
    costs its own text, never a copy of the whole output."""

    def __init__(self, decode: Decode, stops: Sequence[str] = (), include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._decode = decode
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self._longest = max(map(len, self.stops), default=0)
        # proper prefixes of the stop strings (and their first characters): the tails held back
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self._firsts = {s[0] for s in self.stops if len(s) > 1}
        self.ids: list[int] = []
        self._prefix_offset = 0  # ids[_prefix_offset:_read_offset]: the context of the next decode
        self._read_offset = 0  # ids from here on are not committed to the text yet
        self._pieces: list[str] = []  # the committed text, in pieces
        self._joined: str | None = ""  # "".join(_pieces), once asked for (None: not yet)
        self._length = 0  # of the committed text
        self._tail = ""  # its last len(longest stop) - 1 characters: where a stop string may begin
        self.visible = 0
        self.marks: list[int] = []
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended it
        self._sent = 0  # what `add`/`flush` returned so far
        self._finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def text(self) -> str:
        if self._joined is None:
            self._joined = "".join(self._pieces)
            self._pieces = [self._joined]
        return self._joined

    def add(self, token: int) -> str:
        if self.stopped or self._finished:
            return ""
        self.ids.append(token)
        new = self._pending()
        if new:  # a boundary: commit it
            self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
            self._commit(new)
        self.marks.append(self.visible)
        return self._emit(self.visible)

    def finish(self) -> str:
        """The request's whole text: the committed text, plus, unless it stopped, what was still
        held (an incomplete character), searched for a stop string as well. Idempotent."""
        if not self._finished and not self.stopped and self._read_offset < len(self.ids):
            full = self._decode(self.ids[self._prefix_offset :])
            context = self._decode(self.ids[self._prefix_offset : self._read_offset])
            self._read_offset = len(self.ids)
            self._commit(full[len(context) :])
        self._finished = True
        self.visible = self._length
        return self.text

    def flush(self) -> str:
        """At the end: the text not yet returned by `add` (held back, or still incomplete)."""
        self.finish()
        return self._emit(self._length)

    def deltas(self, start: int, end: int) -> list[str]:
        """The text each of tokens start..end-1 made visible (`marks`), for one chunk per token."""
        def mark(i: int) -> int:
            return 0 if i < 0 else self.marks[min(i, len(self.marks) - 1)] if self.marks else 0

        first = mark(start - 1)
        text = self._since(first)
        return [text[mark(i - 1) - first : mark(i) - first] if i < len(self.marks) else "" for i in range(start, end)]

    # -- inside ----------------------------------------------------------------------------------
    def _pending(self) -> str:
        """The new text of the uncommitted ids, or "" while it is empty or ends in an incomplete
        character (vLLM's rule: decode with the context, take the context's text off)."""
        full = self._decode(self.ids[self._prefix_offset :])
        context = ""
        if self._read_offset > self._prefix_offset:
            context = self._decode(self.ids[self._prefix_offset : self._read_offset])
        if len(full) <= len(context) or full.endswith("\ufffd"):
            return ""
        return full[len(context) :]

    def _commit(self, new: str) -> None:
        base = self._length - len(self._tail)  # where `window` begins in the text
        window = self._tail + new
        self._pieces.append(new)
        self._joined = None
        self._length += len(new)
        if not self.stops:
            self.visible = self._length
            return
        hit = self._find(window)
        if hit is not None:
            at, stop = hit
            cut = base + at + (len(stop) if self.include_stop else 0)
            self.stopped, self.stop_string = True, stop
            self._joined = self.text[:cut]  # once, at the stop
            self._pieces, self._length = [self._joined], cut
            self.visible = cut
            return
        self._tail = window[len(window) - min(len(window), self._longest - 1) :]
        # kept in the text, a stop string cuts only what follows it: nothing shown is ever cut
        self.visible = self._length - (0 if self.include_stop else self._held(window))

    def _find(self, window: str) -> tuple[int, str] | None:
        """The stop string that completes first in `window` (ties: the longer), as (its
        position in the window, it). None was complete before the new text, so any found ends
        in it."""
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = window.find(s)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held(self, window: str) -> int:
        """The length of the longest tail of the text (its last characters are the window's)
        that is a proper prefix of a stop string."""
        for k in range(min(len(window), self._longest - 1), 0, -1):
            if window[-k] in self._firsts and window[-k:] in self._prefixes:
                return k
        return 0

    def _since(self, start: int) -> str:
        """text[start:], from the last pieces only (`start` is near the end: O(what it returns))."""
        if self._joined is not None:
            return self._joined[start:]
        need, parts, got = self._length - start, [], 0
        for piece in reversed(self._pieces):
            if got >= need:
                break
            parts.append(piece)
            got += len(piece)
        return "".join(reversed(parts))[got - need :]

    def _emit(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta = self._since(self._sent)[: upto - self._sent]
        self._sent = upto
        return delta
