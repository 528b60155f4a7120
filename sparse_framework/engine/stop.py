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
  client never sees text that a stop string later cuts; `marks` record how much was visible
  after each token, for one delta per token.

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
    (with what was held); `flush()` the part of it not yet visible."""

    def __init__(self, decode: Decode, stops: Sequence[str] = (), include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._decode = decode
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self._longest = max(map(len, self.stops), default=0)
        # proper prefixes of the stop strings, by their first character: the tail a stream holds back
        self._prefixes = {s[:k] for s in self.stops for k in range(1, len(s))}
        self._firsts = {s[0] for s in self.stops if len(s) > 1}
        self.ids: list[int] = []
        self._prefix_offset = 0  # ids[_prefix_offset:_read_offset]: the context of the next decode
        self._read_offset = 0  # ids from here on are not committed to `text` yet
        self.text = ""
        self.visible = 0
        self.marks: list[int] = []
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that ended it
        self._sent = 0  # what `add`/`flush` returned so far
        self._finished = False

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

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
        self.visible = len(self.text)
        return self.text

    def flush(self) -> str:
        """At the end: the text not yet returned by `add` (held back, or still incomplete)."""
        self.finish()
        return self._emit(len(self.text))

    def deltas(self, start: int, end: int) -> list[str]:
        """The text each of tokens start..end-1 made visible (`marks`), for one chunk per token."""
        return [self.text[(self.marks[i - 1] if i > 0 else 0) : self.marks[i]] if i < len(self.marks) else ""
                for i in range(start, end)]

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
        old = len(self.text)
        self.text += new
        if not self.stops:
            self.visible = len(self.text)
            return
        hit = self._find(max(0, old - self._longest + 1))
        if hit is not None:
            start, stop = hit
            self.stopped, self.stop_string = True, stop
            self.text = self.text[: start + len(stop)] if self.include_stop else self.text[:start]
            self.visible = len(self.text)
            return
        self.visible = len(self.text) - self._held()

    def _find(self, start: int) -> tuple[int, str] | None:
        """The stop string that completes first in text[start:] (ties: the longer), as (its
        position, it)."""
        best: tuple[int, int, str] | None = None
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
                best = (i + len(s), i, s)
        return None if best is None else (best[1], best[2])

    def _held(self) -> int:
        """The length of the longest tail of the text that is a proper prefix of a stop string."""
        text = self.text
        for k in range(min(len(text), self._longest - 1), 0, -1):
            if text[-k] in self._firsts and text[-k:] in self._prefixes:
                return k
        return 0

    def _emit(self, upto: int) -> str:
        if upto <= self._sent:
            return ""
        delta, self._sent = self.text[self._sent : upto], upto
        return delta
