"""The OpenAI request bodies read into the engine's terms, and its outputs written back.

Every refusal is a `RequestError` with the HTTP status and a message that names the field, so
that a client sees why (a 400 with the reason) rather than a stack trace. Sampling values are
checked by `SamplingParams` itself: the server accepts exactly what the offline API accepts.

Stop strings are not an engine feature (the engine stops on token ids): `TextStream` decodes
the tokens as they come, ends the text before the first stop string and holds back the tail
that could still become one, so a streamed client never sees text a stop string later cuts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..common.errors import ConfigError
from ..engine.sampling import SamplingParams

# fields of the OpenAI API the engine does not implement: refused when set to anything but
# their no-op value, so that a client never silently gets something other than what it asked
UNSUPPORTED = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "suffix": (None, ""), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


class RequestError(Exception):
    """A request refused before or while it runs: HTTP status, message, OpenAI error type."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             429: "rate_limit_error", 503: "service_unavailable"}.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.status, self.param)


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape (the official client reads `error.message`)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> RequestError:
    return RequestError(400, message, param=param)


def check_unsupported(body: Mapping[str, Any]) -> None:
    """400 for a field the engine cannot honour (n > 1, logprobs, penalties ...)."""
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in allowed:
            if name == "n":
                raise bad(f"n={value!r}: this server returns one choice per prompt; send n requests (with "
                          "different seeds) instead", name)
            raise bad(f"{name}={value!r} is not supported by this server", name)


def sampling_params(body: Mapping[str, Any], default_max_tokens: int) -> tuple[SamplingParams, tuple[str, ...]]:
    """The request's SamplingParams and stop strings. `stop` takes strings and token ids
    (ints); `stop_token_ids` and `ignore_eos` are vLLM's extra fields; `sparse` (true, false,
    or absent/null for the served config's rule by prompt length) is this server's own:
    SamplingParams.sparse, the request's sparse or dense decoding."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, (str, int)) and not isinstance(stop, bool):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop):
        raise bad(f"stop must be a string or a list of strings (or token ids), got {stop!r}", "stop")
    strings = tuple(s for s in stop if isinstance(s, str))
    if any(s == "" for s in strings):
        raise bad("stop strings must not be empty", "stop")
    ids = [s for s in stop if isinstance(s, int)]
    extra_ids = body.get("stop_token_ids") or []
    if not isinstance(extra_ids, list):
        raise bad(f"stop_token_ids must be a list of token ids, got {extra_ids!r}", "stop_token_ids")
    sparse = body.get("sparse")
    if sparse is not None and not isinstance(sparse, bool):
        raise bad(f"sparse must be true (sparse decoding), false (dense) or null (the served config's rule: "
                  f"prompts shorter than its min_sparse_prompt_len decode densely), got {sparse!r}", "sparse")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    values = {
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "temperature": _or(body.get("temperature"), 1.0),
        "top_p": _or(body.get("top_p"), 1.0),
        "top_k": _or(body.get("top_k"), 0),
        "seed": body.get("seed"),
        "stop_token_ids": tuple(ids + list(extra_ids)),
        "ignore_eos": _or(body.get("ignore_eos"), False),
        "sparse": sparse,
    }
    try:
        return SamplingParams(**values), strings
    except ConfigError as exc:
        raise bad(str(exc)) from None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def completion_prompts(body: Mapping[str, Any], encode: Callable[[str | Sequence[int]], list[int]]) -> list[list[int]]:
    """The prompts of /v1/completions as token ids: a string, a list of token ids, or a list of
    either (a batch: one choice each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or isinstance(p, list) for p in prompt):
        batch = prompt
    else:
        raise bad("prompt must be a string, a list of token ids, or a list of those (a batch); got "
                  f"{str(prompt)[:60]!r}", "prompt")
    out = []
    for p in batch:
        if isinstance(p, list) and not all(_is_id(t) for t in p):
            raise bad(f"a prompt given as token ids must hold integers only, got {str(p)[:60]}", "prompt")
        try:
            out.append(encode(p))
        except (ConfigError, ValueError, TypeError) as exc:
            raise bad(f"cannot tokenize the prompt: {exc}", "prompt") from None
    return out


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_text(body: Mapping[str, Any], tokenizer: Any, model: str) -> str:
    """The conversation through the tokenizer's chat template, ready for the assistant's turn."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad(f"model {model!r} has no chat template, so /v1/chat/completions cannot format a conversation "
                  "for it; use /v1/completions with a prompt")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
        turns.append({"role": m["role"], "content": content})
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - the template's own refusal (roles out of order ...)
        raise bad(f"the chat template refused the messages: {exc}", "messages") from None


class TextStream:
    """Incremental text of one request's tokens, cut at the first stop string.

    `add(token)` returns the text that may be shown now (possibly ""), holding back an
    incomplete UTF-8 character and any tail that could grow into a stop string; `stopped`
    turns True at a stop string (text ends before it); `flush()` releases what was held at
    the end. `num_tokens` counts the tokens taken, up to the one that completed a stop."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()) -> None:
        self._decode, self._stops = decode, stops
        self._ids: list[int] = []
        self._sent = ""
        self.text = ""
        self.stopped = False

    @property
    def num_tokens(self) -> int:
        return len(self._ids)

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token)
        full = self._decode(self._ids)
        cut = min((i for i in (full.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.text = full[:cut]
            return self._emit(self.text)
        self.text = full
        hold = len(full) - len(full.rstrip("\ufffd"))  # a character still incomplete
        for k in range(min(len(full), max((len(s) for s in self._stops), default=1) - 1), 0, -1):
            if any(s.startswith(full[len(full) - k :]) for s in self._stops):
                hold = max(hold, k)
                break
        return self._emit(full[: len(full) - hold])

    def flush(self) -> str:
        return self._emit(self.text)

    def _emit(self, text: str) -> str:
        delta = text[len(self._sent) :] if len(text) > len(self._sent) else ""
        self._sent = text if len(text) > len(self._sent) else self._sent
        return delta


def finish_reason(engine_reason: str, stream: TextStream) -> str:
    return "stop" if stream.stopped else engine_reason


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, choices: list[dict[str, Any]], use: dict[str, int] | None,
                    chat: bool, chunk: bool = False) -> dict[str, Any]:
    """One response object (or stream chunk) of /v1/completions or /v1/chat/completions."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    body: dict[str, Any] = {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def choice(index: int, text: str, reason: str | None, chat: bool, chunk: bool, first: bool = False) -> dict[str, Any]:
    if not chat:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    if chunk:
        delta: dict[str, Any] = {"content": text} if text or reason is None else {}
        if first:
            delta["role"] = "assistant"
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": reason}
