"""What the engine keeps of a request beside the scheduler's `Sequence`, and what it returns.

`LiveRequest` owns a queued or running request's own state: its sampling values and generator,
its arrival and first-token times, and its text when the engine keeps it (stop strings,
`detokenize=True`). `RequestOutput` is what a finished request becomes (`output_of`): tokens,
reason, error, text and timings. They sit apart from engine.py because the serving layer, the
offline API and the benchmarks read outputs without the step loop that makes them.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .sampling import SamplingParams
from .scheduler import FinishReason, Sequence
from .stop import RequestText


@dataclass
class RequestOutput:
    """A finished request: its tokens, why it ended, and its timings (seconds, perf_counter).

    `request_id` is vLLM's name for the id given to `add_request`; `rid`, its old name here,
    is kept as a read-only alias that warns (DeprecationWarning)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    error: str | None = None
    text: str | None = None  # the engine's when it kept the text (stop strings), else `LLM`'s when it has a tokenizer
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float = 0.0
    num_preemptions: int = 0

    @property
    def rid(self) -> str:
        """Deprecated alias of `request_id` (read-only)."""
        warnings.warn("RequestOutput.rid is deprecated: use RequestOutput.request_id", DeprecationWarning, stacklevel=2)
        return self.request_id

    @property
    def ttft(self) -> float | None:
        """Time to the first token (queueing and prefill included)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or len(self.token_ids) < 2:
            return None
        return (self.finish_time - self.first_token_time) / (len(self.token_ids) - 1)

    def as_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_tokens": len(self.prompt_token_ids), "token_ids": self.token_ids,
                "text": self.text, "finish_reason": self.finish_reason, "error": self.error, "ttft_s": self.ttft,
                "tpot_s": self.tpot, "num_preemptions": self.num_preemptions}


@dataclass
class LiveRequest:
    """A queued or running request: its sequence (the scheduler's) and what the engine adds."""

    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float
    first_token: float | None = None
    text: RequestText | None = None  # kept with stop strings or detokenize=True

    def take(self, token: int) -> bool:
        """The token into the text, if kept; True when it completed a stop string."""
        if self.text is None:
            return False
        self.text.add(token)
        return self.text.stopped


def output_of(live: LiveRequest, reason: str, error: str | None = None) -> RequestOutput:
    """A request's output as it ends now (`reason` "length" becomes "stop" where the text kept to
    the end found a stop string)."""
    seq = live.seq
    text = None
    if live.text is not None:
        text = live.text.finish()
        if live.text.stopped and reason == FinishReason.LENGTH.value:  # found in the text held to the end
            reason = FinishReason.STOP.value
    return RequestOutput(
        seq.rid, list(seq.prompt_ids), list(seq.output_ids), reason, error, text=text, arrival_time=live.arrival,
        first_token_time=live.first_token, finish_time=time.perf_counter(), num_preemptions=seq.num_preemptions,
    )
