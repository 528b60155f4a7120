"""The ASGI app (Starlette): OpenAI's completions and chat endpoints over one `EngineLoop`.

Handlers only parse, enqueue, stream and abort (docs/serve.md lists the endpoints):

- a request is refused before it is queued when the body is wrong (400: `protocol`), the
  waiting queue is full (429 with Retry-After: `max_waiting`) or the engine is not serving
  (503); the engine's own refusal (prompt + max_tokens beyond max_model_len, larger than the
  pools, a stop token outside the vocabulary) comes back as a 400 with the engine's reason;
- a streamed response starts only once the first token (or the refusal) is there, so a
  refused request is a 400 and never a stream that ends in an error;
- a client that goes away (a closed stream, or a dropped connection while waiting for a whole
  response) aborts its request, which frees its pages.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from ..engine.llm import LLM, decode_text
from . import protocol as P
from .loop import EngineLoop, Event
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger(__name__)
T = TypeVar("T")

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

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.llm.encode(prompt)

    def decode(self, ids: list[int]) -> str:
        tokenizer = self.llm.tokenizer
        return " ".join(map(str, ids)) if tokenizer is None else decode_text(tokenizer, ids)


class _Pending:
    """One queued request as its handler sees it: events from the loop through an asyncio queue."""

    def __init__(self, state: ServerState, prompt_ids: list[int], params: Any, stops: tuple[str, ...]) -> None:
        self.rid = f"cmpl-{uuid.uuid4().hex}"
        self.prompt_ids = prompt_ids
        self.text = P.TextStream(state.decode, stops)
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.done = False
        self.reason: str | None = None
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
        if out.finish_reason == "abort":
            raise P.RequestError(503, f"request aborted: {out.error or 'the server is shutting down'}")
        if out.finish_reason == "error":
            refused = not event.server_error and self.text.num_tokens == 0
            raise P.RequestError(400 if refused else 500, out.error or "the engine could not run the request")
        self.reason = out.finish_reason


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
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], exception_handlers={HTTPException: _http_error, P.RequestError: _request_error, Exception: _server_error},
        lifespan=lifespan)
    app.state.serve = state
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    return app


class BearerAuth:
    """401 for every request without `Authorization: Bearer <api_key>` (pure ASGI, so that
    streaming and disconnects pass through untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and dict(scope["headers"]).get(b"authorization") != self.expected:
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
    return JSONResponse(P.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", 500), 500)


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


async def _body(request: Request, state: ServerState) -> dict[str, Any]:
    try:
        body = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise P.bad(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise P.bad("the body must be a JSON object")
    model = body.get("model")
    if model is not None and model != state.model_name:
        raise P.RequestError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r} "
                                  "(GET /v1/models)", param="model")
    P.check_unsupported(body)
    return body


def _admit(state: ServerState, count: int) -> None:
    """503 while not serving, 429 (Retry-After) when the waiting queue is full."""
    loop = state.loop
    if loop.broken is not None:
        raise P.RequestError(503, f"the engine is not serving: {loop.broken}")
    if not loop.ready.is_set():
        raise P.RequestError(503, "the engine is warming up; retry when GET /health answers 200",
                             headers={"Retry-After": "1"})
    waiting = loop.snapshot().waiting
    if waiting + count > state.max_waiting:
        raise P.RequestError(429, f"the waiting queue is full ({waiting} of --max-waiting {state.max_waiting}); "
                                  "retry later", headers={"Retry-After": "1"})


async def completions(request: Request) -> Response:
    state = _state(request)
    body = await _body(request, state)
    params, stops = P.sampling_params(body, default_max_tokens=16)
    prompts = P.completion_prompts(body, state.encode)
    return await _serve(request, state, body, prompts, params, stops, chat=False)


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await _body(request, state)
    text = P.chat_text(body, state.llm.tokenizer, state.model_name)
    try:
        ids = state.encode(text)
    except Exception as exc:  # noqa: BLE001
        raise P.bad(f"cannot tokenize the conversation: {exc}") from None
    # OpenAI's default for chat: as many tokens as the context leaves (at least 1, so that an
    # over-long conversation is the engine's refusal, with its reason)
    params, stops = P.sampling_params(body, default_max_tokens=max(1, state.max_model_len - len(ids)))
    return await _serve(request, state, body, [ids], params, stops, chat=True)


async def _serve(request: Request, state: ServerState, body: dict[str, Any], prompts: list[list[int]], params: Any,
                 stops: tuple[str, ...], chat: bool) -> Response:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise P.bad(f"stream must be true or false, got {stream!r}", "stream")
    if stream and len(prompts) != 1:
        raise P.bad("stream: true takes one prompt per request", "prompt")
    _admit(state, len(prompts))
    pending = [_Pending(state, ids, params, stops) for ids in prompts]
    for p in pending:
        state.loop.submit(p.rid, p.prompt_ids, params, p.sink)
    try:
        if stream:
            # the first token (or the refusal: a 400, not a broken stream) before the headers
            first = await _unless_disconnected(pending[0].queue.get(), request)
            if first.output is not None:
                pending[0].end(first)
            options = body.get("stream_options") or {}
            return StreamingResponse(_stream(state, pending[0], first, chat, bool(options.get("include_usage"))),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        results = await _unless_disconnected(asyncio.gather(*(_collect(state, p) for p in pending)), request)
    except BaseException as exc:
        for p in pending:
            if not p.done:
                state.loop.abort(p.rid)
                p.done = True
        if isinstance(exc, ClientGone):  # nobody reads this answer (nginx's "client closed request")
            return Response(status_code=499)
        raise
    choices = [P.choice(i, p.text.text, reason, chat, chunk=False) for i, (p, reason) in enumerate(results)]
    use = P.usage(sum(len(p.prompt_ids) for p in pending), sum(p.text.num_tokens for p in pending))
    return JSONResponse(P.completion_body(pending[0].rid, state.model_name, choices, use, chat))


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
    """Wait for a whole response; a stop string ends (and aborts) the request early."""
    while True:
        event = await p.queue.get()
        for token in event.tokens:
            p.text.add(token)
            if p.text.stopped:
                state.loop.abort(p.rid)
                p.done = True
                return p, "stop"
        if event.output is not None:
            p.end(event)
            return p, P.finish_reason(p.reason or "stop", p.text)


async def _stream(state: ServerState, p: _Pending, first: Event, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    """SSE: one chunk per token, a last chunk with the finish reason (and usage when asked),
    then [DONE]. Closing the stream early (client gone) aborts the request."""
    model, event, sent_first = state.model_name, first, False
    try:
        while True:
            for token in event.tokens:
                delta = p.text.add(token)
                choice = P.choice(0, delta, None, chat, chunk=True, first=not sent_first)
                sent_first = True
                yield _sse(P.completion_body(p.rid, model, [choice], None, chat, chunk=True))
                if p.text.stopped:
                    break
            if p.text.stopped:
                state.loop.abort(p.rid)
                p.done, reason = True, "stop"
                break
            if event.output is not None:
                try:
                    p.end(event)
                except P.RequestError as exc:  # failed after tokens were sent: an error event
                    yield _sse(exc.body())
                    yield "data: [DONE]\n\n"
                    return
                reason = P.finish_reason(p.reason or "stop", p.text)
                break
            event = await p.queue.get()
        rest = p.text.flush()
        yield _sse(P.completion_body(p.rid, model, [P.choice(0, rest, reason, chat, chunk=True)], None, chat,
                                     chunk=True))
        if include_usage:
            yield _sse(P.completion_body(p.rid, model, [], P.usage(len(p.prompt_ids), p.text.num_tokens), chat,
                                         chunk=True))
        yield "data: [DONE]\n\n"
    finally:
        if not p.done:
            state.loop.abort(p.rid)
            p.done = True


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"
