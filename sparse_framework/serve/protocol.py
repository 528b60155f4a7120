"""The OpenAI request bodies read into the engine's terms, and its outputs written back.

Every refusal is a `RequestError` with the HTTP status and a message that names the field, so
that a client sees why (a 400 with the reason) rather than a stack trace. Sampling values are
checked by `SamplingParams` itself: the server accepts exactly what the offline API accepts.

Stop strings are the engine's (`SamplingParams.stop`, engine/stop.py), as for the offline
`LLM`: the engine decodes each request's tokens as they come, ends the request (finish_reason
"stop", its pages freed) at the token that completes a stop string and cuts the text there; the
text of each streamed token leaves out the tail that could still become one, so a streamed
client never sees text a stop string later cuts. Here the `stop` field is only read and bounded.

Bodies are untrusted: a field of the wrong type (a nested object included) is a 400 naming the
field and what it takes, never an exception out of a handler; a value quoted back in a message
is cut short (`show`); a prompt is bounded before it is tokenized (`Limits`: characters against
max_model_len, prompts per request against what can ever be admitted).
"""

from __future__ import annotations

import json
import re
import reprlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..common.chat import chat_text as templated_chat
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


_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlist, _SHOW.maxdict = 3, 60, 60, 6, 4


def show(value: Any) -> str:
    """A request's value quoted in a message: cut short however long or deeply nested it is."""
    return _SHOW.repr(value)


def _kind(value: Any) -> str:
    """What a wrong value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()}"
    names = {str: "a string", int: "an integer", float: "a number", list: "a list", dict: "an object"}
    return next((f"{name} {show(value)}" for t, name in names.items() if isinstance(value, t)), show(value))


@dataclass(frozen=True)
class Limits:
    """What a request can never exceed, checked before any tokenizing: `max_prompt_chars`
    characters in a text prompt (or a conversation's contents), `max_model_len` token ids in
    a prompt given as ids, `max_prompts` prompts in one request (what can ever be admitted at
    once: --max-waiting plus the engine's running rows)."""

    max_model_len: int
    chars_per_token: int
    max_prompts: int
    admission: str = ""  # how max_prompts follows from the flags, for the message

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * self.chars_per_token

    def check_text(self, length: int, what: str, param: str) -> None:
        if length > self.max_prompt_chars:
            raise bad(f"{what} is {length:,} characters: at most {self.max_prompt_chars:,} can fit in max_model_len "
                      f"{self.max_model_len} tokens ({self.chars_per_token} characters a token at most, the "
                      "tokenizer's longest token with margin); shorten it", param)


MIN_CHARS_PER_TOKEN = 32
# the engine matches stop strings against the text after every token, on its loop: bounded
MAX_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_IDS = 32, 256, 1024


def chars_per_token(tokenizer: Any) -> int:
    """A generous bound on the characters one token covers: twice the tokenizer's longest
    vocabulary entry, at least MIN_CHARS_PER_TOKEN (a text of more than max_model_len times
    this many characters cannot fit the context, whatever it says)."""
    try:
        longest = max(map(len, tokenizer.get_vocab()), default=0)
    except Exception:  # noqa: BLE001 - no vocabulary to read (the toy's IdTokenizer): the floor
        longest = 0
    return max(MIN_CHARS_PER_TOKEN, 2 * longest)


def parse_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400: not JSON, not UTF-8, nested deeper than the parser
    goes (a RecursionError), or an integer beyond Python's 4,300 digits (a ValueError)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad("the body is not valid JSON: it is nested too deeply to parse") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise bad(f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(body, dict):
        raise bad(f"the body must be a JSON object, got {_kind(body)}")
    return body


def check_fields(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """The types of the fields every endpoint reads besides the prompt and sampling: `model`
    and `user` strings, `stream` a boolean, `stream_options` an object whose `include_usage`
    is a boolean. Returns (stream, include_usage)."""
    for name in ("model", "user"):
        value = body.get(name)
        if value is not None and not isinstance(value, str):
            raise bad(f"{name} must be a string, got {_kind(value)}", name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad(f"stream must be true or false, got {_kind(stream)}", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad(f"stream_options must be an object ({{\"include_usage\": true or false}}) or null, got "
                  f"{_kind(options)}", "stream_options")
    include_usage = (options or {}).get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise bad(f"stream_options.include_usage must be true or false, got {_kind(include_usage)}",
                  "stream_options")
    return bool(stream), bool(include_usage)


def check_unsupported(body: Mapping[str, Any]) -> None:
    """400 for a field the engine cannot honour (n > 1, logprobs, penalties ...)."""
    for name, allowed in UNSUPPORTED.items():
        value = body.get(name)
        if value is not None and value not in allowed:
            if name == "n":
                raise bad(f"n={show(value)}: this server returns one choice per prompt; send n requests (with "
                          "different seeds) instead", name)
            raise bad(f"{name}={show(value)} is not supported by this server", name)


def sampling_params(body: Mapping[str, Any], default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams. `stop` takes strings (SamplingParams.stop) and token ids
    (ints, with stop_token_ids); `stop_token_ids`, `ignore_eos` and `include_stop_str_in_output`
    are vLLM's extra fields; `sparse` (true, false, or absent/null for the served config's rule
    by prompt length) is this server's own: SamplingParams.sparse, the request's sparse or dense
    decoding."""
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, (str, int)) and not isinstance(stop, bool):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, (str, int)) and not isinstance(s, bool) for s in stop):
        raise bad(f"stop must be a string or a list of strings (or token ids), got {_kind(stop)}", "stop")
    strings = tuple(s for s in stop if isinstance(s, str))
    if any(s == "" for s in strings):
        raise bad("stop strings must not be empty", "stop")
    if len(strings) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in strings):
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_CHARS} characters each (every "
                  f"token is matched against them), got {len(strings)} of up to {max(map(len, strings))}", "stop")
    ids = [s for s in stop if isinstance(s, int)]
    extra_ids = body.get("stop_token_ids") or []
    if not isinstance(extra_ids, list) or not all(_is_id(t) and t >= 0 for t in extra_ids):
        raise bad(f"stop_token_ids must be a list of token ids (integers >= 0), got {_kind(extra_ids)}",
                  "stop_token_ids")
    if len(ids) + len(extra_ids) > MAX_STOP_IDS:
        raise bad(f"stop and stop_token_ids take at most {MAX_STOP_IDS} token ids together, got "
                  f"{len(ids) + len(extra_ids)}", "stop_token_ids")
    sparse = body.get("sparse")
    if sparse is not None and not isinstance(sparse, bool):
        raise bad(f"sparse must be true (sparse decoding), false (dense) or null (the served config's rule: "
                  f"prompts shorter than its min_sparse_prompt_len decode densely), got {show(sparse)}", "sparse")
    tokens_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    for name, allowed in ((tokens_field, "an integer"), ("temperature", "a number"), ("top_p", "a number"),
                          ("top_k", "an integer"), ("seed", "an integer"), ("ignore_eos", "true or false"),
                          ("include_stop_str_in_output", "true or false")):
        value = body.get(name)
        if value is None:
            continue
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (allowed == "an integer" and not _is_id(value)) or (allowed == "a number" and not number) or (
                allowed == "true or false" and not isinstance(value, bool)):
            raise bad(f"{name} must be {allowed}{_RANGES.get(name, '')}, got {_kind(value)}", name)
    max_tokens = body.get(tokens_field)
    values = {
        "max_tokens": default_max_tokens if max_tokens is None else max_tokens,
        "temperature": _or(body.get("temperature"), 1.0),
        "top_p": _or(body.get("top_p"), 1.0),
        "top_k": _or(body.get("top_k"), 0),
        "seed": body.get("seed"),
        "stop_token_ids": tuple(ids + list(extra_ids)),
        "ignore_eos": _or(body.get("ignore_eos"), False),
        "sparse": sparse,
        "stop": strings,
        "include_stop_str_in_output": _or(body.get("include_stop_str_in_output"), False),
    }
    try:
        return SamplingParams(**values)
    except ConfigError as exc:  # a value out of range: SamplingParams' own message names it
        name = re.match(r"SamplingParams\.(\w+)", str(exc))
        field = name and (tokens_field if name.group(1) == "max_tokens" else name.group(1))
        raise bad(str(exc), field or None) from None


_RANGES = {"max_tokens": " >= 1", "max_completion_tokens": " >= 1", "temperature": " >= 0 (0 = greedy)",
           "top_p": " in (0, 1]", "top_k": " (0 or -1: off)", "seed": " in [0, 2**64)"}


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def completion_prompts(body: Mapping[str, Any], encode: Callable[[str | Sequence[int]], list[int]],
                       limits: Limits, stream: bool = False) -> list[list[int]]:
    """The prompts of /v1/completions as token ids: a string, a list of token ids, or a list of
    either (a batch: one choice each; not with `stream`). Each is bounded by `limits` before
    it is tokenized. Its cost grows with the prompt: the server runs it off the event loop."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        batch = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or isinstance(p, list) for p in prompt):
        batch = prompt
    else:
        raise bad("prompt must be a string, a list of token ids, or a list of those (a batch); got "
                  f"{_kind(prompt)}", "prompt")
    if stream and len(batch) != 1:
        raise bad("stream: true takes one prompt per request", "prompt")
    if len(batch) > limits.max_prompts:
        raise bad(f"{len(batch):,} prompts in one request: at most {limits.max_prompts} can ever be admitted at once"
                  f"{limits.admission}; send fewer per request", "prompt")
    out = []
    for p in batch:
        if isinstance(p, str):
            limits.check_text(len(p), "the prompt", "prompt")
        elif len(p) > limits.max_model_len:
            raise bad(f"the prompt is {len(p):,} token ids: more than max_model_len {limits.max_model_len}", "prompt")
        elif not all(_is_id(t) for t in p):
            raise bad(f"a prompt given as token ids must hold integers only, got {show(p)}", "prompt")
        try:
            out.append(encode(p))
        except (ConfigError, ValueError, TypeError) as exc:
            raise bad(f"cannot tokenize the prompt: {str(exc)[:300]}", "prompt") from None
    return out


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_text(body: Mapping[str, Any], tokenizer: Any, model: str, limits: Limits) -> str:
    """The conversation through the tokenizer's chat template, ready for the assistant's turn
    (the messages checked and bounded by `limits` first; the server runs it off the event loop)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad(f"messages must be a non-empty list of {{role, content}} objects, got {_kind(messages)}", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role', got {_kind(m)}", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise bad(f"messages[{i}].content[{j}] must be a text part ({{\"type\": \"text\", \"text\": "
                              f"...}}; only text is supported), got {_kind(part)}", "messages")
                if not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content[{j}].text must be a string, got {_kind(part.get('text'))}",
                              "messages")
            content = "".join(part["text"] for part in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts, got {_kind(content)}",
                      "messages")
        turns.append({"role": m["role"], "content": content})
    limits.check_text(sum(len(t["content"]) for t in turns), "the conversation", "messages")
    if getattr(tokenizer, "chat_template", None) is None:
        raise bad(f"model {model!r} has no chat template, so /v1/chat/completions cannot format a conversation "
                  "for it; use /v1/completions with a prompt")
    try:
        return templated_chat(tokenizer, turns)
    except Exception as exc:  # noqa: BLE001 - the template's own refusal (roles out of order ...)
        raise bad(f"the chat template refused the messages: {str(exc)[:300]}", "messages") from None


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
