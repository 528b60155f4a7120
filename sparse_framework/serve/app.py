"""The ASGI app (Starlette): OpenAI's completions and chat endpoints over one `EngineLoop`.

Handlers only parse, enqueue, stream and abort (docs/serve.md lists the endpoints):

- a request is refused before it is queued when the body is wrong (400: `protocol`, which also
  bounds a prompt's length and a request's prompts before anything is tokenized), more requests
  wait for a running row than --max-waiting (429 with Retry-After) or the engine is not
  serving (503); the engine's own refusal (prompt + max_tokens beyond max_model_len, larger than
  the pools, a stop token outside the vocabulary) comes back as a 400 with the engine's reason;
- nothing that grows with the request runs on the event loop: a large body is parsed, and
  every prompt checked and tokenized, on a worker thread, so /health and the other clients
  never wait on someone's 5 MB prompt;
- a streamed response starts only once the first token (or the refusal) is there, so a
  refused request is a 400 and never a stream that ends in an error;
- the text, stop strings included, is the engine's (engine/stop.py): each token's chunk carries
  the text the engine made visible with it (`Event.texts`), the last chunk the rest of the
  output's text; a stop string ends the request in the engine, like a stop token;
- a client that goes away (a closed stream, or a dropped connection while waiting for a whole
  response) aborts its request, which frees its pages, and is logged as a 499;
- a request still running when the shutdown's drain ends is aborted by the engine loop
  (command.py): a 503 in OpenAI's error shape, or a stream's error event and [DONE];
- an unexpected exception in a handler is a JSON 500 that keeps the connection open.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine.llm import LLM, IdTokenizer
from . import protocol as P
from .loop import EngineLoop, Event
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger(__name__)
access_log = logging.getLogger("uvicorn.access")  # uvicorn's request log: where the 499s go too
T = TypeVar("T")
INLINE_BODY_BYTES = 64 * 1024  # a larger body is parsed on a worker thread


class ClientGone(Exception):
    """The client closed the connection while its request ran."""


@dataclass
class ServerState:
    """What the handlers share: the model, its tokenizer, the loop and the limits."""

    llm: LLM
    model_name: str
    loop: EngineLoop
    metrics: ServerMetrics
    max_waiting: int
    max_model_len: int
    limits: P.Limits = field(init=False)
    max_running: int = field(init=False)  # the engine's running rows (max_num_seqs as planned)

    def __post_init__(self) -> None:
        self.max_running = self.llm.engine.max_running
        if self.llm.engine.tokenizer is None:  # a checkpoint of token ids only: its text is the ids, "1 17 300"
            self.llm.engine.tokenizer = IdTokenizer(self.llm.model.config.vocab_size)
        admitted = self.max_waiting + self.max_running
        self.limits = P.Limits(self.max_model_len, P.chars_per_token(self.llm.tokenizer), admitted,
                               f" (--max-waiting {self.max_waiting} + {self.max_running} running rows)")

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.llm.encode(prompt)


class _Pending:
    """One queued request as its handler sees it: events from the loop through an asyncio queue."""

    def __init__(self, state: ServerState, prompt_ids: list[int]) -> None:
        self.rid = f"cmpl-{uuid.uuid4().hex}"
        self.loop = state.loop
        self.prompt_ids = prompt_ids
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False
        self.reason: str | None = None
        self.num_tokens = 0  # the tokens received
        self.sent = 0  # the characters of text streamed so far
        self.text = ""  # the whole text, once ended
        aio = asyncio.get_running_loop()

        def sink(event: Event) -> None:  # called on the engine loop's thread
            with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody is listening
                aio.call_soon_threadsafe(self.queue.put_nowait, event)

        self.sink: Callable[[Event], None] = sink

    def end(self, event: Event) -> None:
        """The engine ended the request: an error becomes a RequestError (400 when the engine
        refused it before any token, 500/503 when it failed or the server stops)."""
        out = event.output
        assert out is not None
        self.done = True
        if out.finish_reason == "abort":  # the loop's stop (shutdown) or a broken engine ends it this way
            cause = " by shutdown" if self.loop.stopping else ""
            raise P.RequestError(503, f"request aborted{cause}: {out.error or 'the server is shutting down'}")
        if out.finish_reason == "error":
            refused = not event.server_error and self.num_tokens == 0
            raise P.RequestError(400 if refused else 500, out.error or "the engine could not run the request")
        self.reason = out.finish_reason
        self.text = out.text or ""

    def take(self, event: Event) -> list[str]:
        """Count the event's tokens; the text each made visible, one per token."""
        self.num_tokens += len(event.tokens)
        texts = event.texts + [""] * (len(event.tokens) - len(event.texts))
        self.sent += sum(map(len, texts))
        return texts


def build_app(state: ServerState, api_key: str | None = None) -> Starlette:
    """The app over a started-or-not loop: the lifespan starts the loop and, at shutdown, ends
    what is still running (after uvicorn's graceful drain) and joins it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.loop.stop, "the server is shutting down")

    app = Starlette(routes=[
        Route("/health", _guarded(health), methods=["GET"]),
        Route("/metrics", _guarded(metrics), methods=["GET"]),
        Route("/v1/models", _guarded(models), methods=["GET"]),
        Route("/v1/completions", _guarded(completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(chat_completions), methods=["POST"]),
    ], exception_handlers={HTTPException: _http_error, P.RequestError: _request_error, Exception: _server_error},
        lifespan=lifespan)
    app.state.serve = state
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


class BearerAuth:
    """401 for every request without `Authorization: Bearer <api_key>` (pure ASGI, so that
    streaming and disconnects pass through untouched). The scheme is case-insensitive (RFC
    7235: "bearer" is "Bearer"); the key is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, api_key.encode()

    def _allowed(self, scope: Scope) -> bool:
        scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self._allowed(scope):
            body = P.error_body("missing or wrong API key: send 'Authorization: Bearer <key>'",
                                "authentication_error", 401)
            await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    what = f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else str(exc.detail)
    return JSONResponse(P.error_body(what, "not_found_error" if exc.status_code == 404 else "invalid_request_error",
                                     exc.status_code), exc.status_code)


async def _request_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, P.RequestError)
    return JSONResponse(exc.body(), exc.status, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path)
    return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}: {str(exc)[:300]}", "server_error", 500),
                        500)


def _guarded(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """`handler`, with an unexpected exception answered as a JSON 500 here: Starlette's own
    handler for Exception answers, then re-raises, and uvicorn closes the connection."""

    @functools.wraps(handler)
    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except (P.RequestError, HTTPException):
            raise
        except Exception as exc:  # noqa: BLE001
            return await _server_error(request, exc)

    return guarded


def _state(request: Request) -> ServerState:
    return request.app.state.serve


async def health(request: Request) -> Response:
    loop = _state(request).loop
    if loop.broken is not None:
        return JSONResponse({"status": "broken", "reason": loop.broken}, 503)
    if not loop.ready.is_set():
        body: dict[str, Any] = {"status": "starting"}
        if loop.warm_up_progress is not None:  # the engine warm-up's bucket, while it runs
            done, total, label = loop.warm_up_progress
            body["warm_up"] = {"done": done, "total": total, "label": label}
        return JSONResponse(body, 503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def models(request: Request) -> Response:
    state = _state(request)
    card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "sparse-framework",
            "max_model_len": state.max_model_len}
    return JSONResponse({"object": "list", "data": [card]})


async def _body(request: Request, state: ServerState) -> tuple[dict[str, Any], bool, bool]:
    """The body (parsed on a worker thread when large), its common fields checked: (body,
    stream, include_usage)."""
    raw = await request.body()
    body = P.parse_body(raw) if len(raw) <= INLINE_BODY_BYTES else await run_in_threadpool(P.parse_body, raw)
    stream, include_usage = P.check_fields(body)
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise P.RequestError(404, f"the model {P.show(model)} does not exist; this server serves "
                                  f"{state.model_name!r} (GET /v1/models)", param="model")
    P.check_unsupported(body)
    return body, stream, include_usage


def _admit(state: ServerState, count: int) -> None:
    """503 while not serving, 429 (Retry-After) when admitting `count` more requests would
    leave more than --max-waiting of them waiting for a running row. The requests the free
    rows take at the next step do not wait, so they do not count (a burst of 6 with 8 free
    rows and --max-waiting 4 all run)."""
    loop = state.loop
    if loop.broken is not None:
        raise P.RequestError(503, f"the engine is not serving: {loop.broken}")
    if loop.stopping:
        raise P.RequestError(503, "the server is shutting down")
    if not loop.ready.is_set():
        raise P.RequestError(503, "the engine is warming up; retry when GET /health answers 200",
                             headers={"Retry-After": "1"})
    snap = loop.snapshot()
    free = max(0, state.max_running - snap.running - snap.preempted)  # preempted requests resume first
    waiting = max(0, snap.waiting - free)
    if max(0, snap.waiting + count - free) > state.max_waiting:
        raise P.RequestError(429, f"the waiting queue is full ({waiting} waiting for a running row, --max-waiting "
                                  f"{state.max_waiting}); retry later", headers={"Retry-After": "1"})


async def completions(request: Request) -> Response:
    state = _state(request)
    body, stream, include_usage = await _body(request, state)
    params = P.sampling_params(body, default_max_tokens=16)
    prompts = await run_in_threadpool(P.completion_prompts, body, state.encode, state.limits, stream)
    return await _serve(request, state, prompts, params, False, stream, include_usage)


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body, stream, include_usage = await _body(request, state)
    P.sampling_params(body, default_max_tokens=1)  # the fields' own errors before the template runs

    def conversation() -> list[int]:
        text = P.chat_text(body, state.llm.tokenizer, state.model_name, state.limits)
        try:
            return state.encode(text)
        except Exception as exc:  # noqa: BLE001
            raise P.bad(f"cannot tokenize the conversation: {str(exc)[:300]}", "messages") from None

    ids = await run_in_threadpool(conversation)
    # OpenAI's default for chat: as many tokens as the context leaves (at least 1, so that an
    # over-long conversation is the engine's refusal, with its reason)
    params = P.sampling_params(body, default_max_tokens=max(1, state.max_model_len - len(ids)))
    return await _serve(request, state, [ids], params, True, stream, include_usage)


async def _serve(request: Request, state: ServerState, prompts: list[list[int]], params: Any, chat: bool, stream: bool,
                 include_usage: bool) -> Response:
    _admit(state, len(prompts))  # then submitted with no await between: admissions see each other
    pending = [_Pending(state, ids) for ids in prompts]
    for p in pending:
        state.loop.submit(p.rid, p.prompt_ids, params, p.sink)
    try:
        if stream:
            # the first token (or the refusal: a 400, not a broken stream) before the headers
            first = await _unless_disconnected(pending[0].queue.get(), request)
            if first.output is not None:
                pending[0].end(first)
            return StreamingResponse(_stream(state, pending[0], first, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = await _unless_disconnected(asyncio.gather(*(_collect(state, p) for p in pending)), request)
    except BaseException as exc:
        for p in pending:
            if not p.done:
                state.loop.abort(p.rid)
                p.done = True
        if isinstance(exc, ClientGone):  # nobody reads this answer (nginx's "client closed request")
            _log_gone(request)
            return Response(status_code=499)
        raise
    choices = [P.choice(i, p.text, reason, chat, chunk=False) for i, (p, reason) in enumerate(results)]
    use = P.usage(sum(len(p.prompt_ids) for p in pending), sum(p.num_tokens for p in pending))
    return JSONResponse(P.completion_body(pending[0].rid, state.model_name, choices, use, chat))


def _log_gone(request: Request) -> None:
    """uvicorn logs no request whose client has gone (its `send` drops the response): the 499
    in its access log's own format, so that it is counted like the others."""
    scope = request.scope
    client = scope.get("client")
    path = scope.get("path", "") + (f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else "")
    access_log.info('%s - "%s %s HTTP/%s" %d', "%s:%d" % tuple(client) if client else "", scope.get("method", ""),
                    path, scope.get("http_version", "1.1"), 499)


async def _unless_disconnected(awaitable: Awaitable[T], request: Request) -> T:
    """`awaitable`'s result, or ClientGone (the awaitable cancelled) when the client goes away
    first. The request's body has been read, so the next ASGI message is the disconnect."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)


async def _collect(state: ServerState, p: _Pending) -> tuple[_Pending, str]:
    """Wait for a whole response (a stop string ends it in the engine, "stop")."""
    while True:
        event = await p.queue.get()
        p.take(event)
        if event.output is not None:
            p.end(event)
            return p, p.reason or "stop"


async def _stream(state: ServerState, p: _Pending, first: Event, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """SSE: one chunk per token, a last chunk with the finish reason (and usage when asked),
    then [DONE]. Closing the stream early (client gone) aborts the request."""
    model, event, sent_first = state.model_name, first, False
    try:
        while True:
            for delta in p.take(event):  # one chunk per token, with the text it made visible
                choice = P.choice(0, delta, None, chat, chunk=True, first=not sent_first)
                sent_first = True
                yield _sse(P.completion_body(p.rid, model, [choice], None, chat, chunk=True))
            if event.output is not None:
                try:
                    p.end(event)
                except P.RequestError as exc:  # failed after tokens were sent: an error event
                    yield _sse(exc.body())
                    yield "data: [DONE]\n\n"
                    return
                reason = p.reason or "stop"
                break
            event = await p.queue.get()
        rest = p.text[p.sent :]  # held back while it could become a stop string, or never completed
        yield _sse(P.completion_body(p.rid, model, [P.choice(0, rest, reason, chat, chunk=True)], None, chat,
                                     chunk=True))
        if include_usage:
            yield _sse(P.completion_body(p.rid, model, [], P.usage(len(p.prompt_ids), p.num_tokens), chat,
                                         chunk=True))
        yield "data: [DONE]\n\n"
    finally:
        if not p.done:
            state.loop.abort(p.rid)
            p.done = True


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
