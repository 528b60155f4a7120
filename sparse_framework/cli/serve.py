"""`sparse-framework serve` and `serve()`: build the model and engine, then run uvicorn.

The model and engine flags are generate's own (`engine.command.engine_arguments`), so a
configuration tried with `generate` serves unchanged. Shutdown (SIGTERM, Ctrl-C) is uvicorn's
graceful one: it stops accepting connections and lets the responses in flight finish for up to
--drain-timeout seconds (the engine keeps stepping meanwhile); then the engine loop aborts what
is left (`EngineLoop.close`), so that each such response still ends properly (a 503 in the
OpenAI error shape, or a stream's error event and [DONE]) within SHUTDOWN_GRACE_S more, before
uvicorn would cancel its handler (a bare 500 or a cut stream); the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
from pathlib import Path
from typing import Any

from ..common.errors import ConfigError
from . import engine as engine_command
from ..engine.llm import LLM, IdTokenizer

SERVE_HELP = """\
An OpenAI-compatible HTTP server over one engine (docs/serve.md): POST /v1/completions and
/v1/chat/completions (stream: true for server-sent events, one chunk per token), GET /v1/models,
/health (200 once warmed up: on CUDA with --cuda-graphs or --decode-graphs every batch size's
decode step is compiled and captured first, --no-warm-up skips that) and /metrics (Prometheus).

  sparse-framework serve                                  # smollm2-135m-instruct if installed
  sparse-framework serve --model reference --port 8000    # the toy model: prompts are token ids
  sparse-framework serve --model DIR --device cuda --api-key secret --max-waiting 256

Then, with the official client:

  from openai import OpenAI
  client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret")
  client.completions.create(model="reference", prompt="1 17 300", max_tokens=8)

Requests take max_tokens, temperature, top_p, top_k, seed, stop (strings or token ids; the
request ends at the token that completes a stop string, its text cut before that string, or
after it with include_stop_str_in_output: true), stop_token_ids, ignore_eos,
include_stop_str_in_output and sparse; n > 1, logprobs and penalties are refused with a 400. A
request the engine can never run (prompt + max_tokens beyond --max-model-len, larger than the
pools) is a 400 with the engine's reason; a full waiting queue (--max-waiting) a 429 with
Retry-After.
"""

REFERENCE_NAME = "reference"
SHUTDOWN_GRACE_S = 5.0  # after the drain: the aborted responses' time to be written


def make_server(app: Any, loop: Any, *, host: str, port: int, drain_timeout: float, log_level: str | None = "info",
                **config: Any) -> Any:
    """The uvicorn server of `app`, whose shutdown aborts the requests of `loop` (an
    EngineLoop) still running --drain-timeout seconds after it began (module docstring)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            aio = asyncio.get_running_loop()
            timer = aio.call_later(drain_timeout, loop.close, "the server is shutting down")
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    return DrainingServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                         timeout_graceful_shutdown=drain_timeout + SHUTDOWN_GRACE_S, **config))


def add_parser(sub: Any) -> None:
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the engine (completions, chat, "
                       "streaming, metrics)", description=SERVE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    engine_command.engine_arguments(s, engine_command.DEFAULT_MODEL_TEXT)
    engine_command.random_argument(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name in the API (default: --model as given, 'reference' for the toy)")
    s.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every endpoint (401 "
                   "otherwise); also read from SPARSE_FRAMEWORK_API_KEY")
    s.add_argument("--max-waiting", type=int, default=256,
                   help="requests waiting for a running row at most (those the free rows take at once do not "
                   "count); more are answered 429 with Retry-After, and a request of more prompts than "
                   "--max-waiting + --max-num-seqs 400 (default 256)")
    s.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds SIGTERM waits for responses in flight before aborting them: a 503, or a stream's "
                   "error event and [DONE] (default 30)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info)")


def run(args: argparse.Namespace) -> int:
    """The `serve` subcommand."""
    import os

    engine_command.check_positive(args, "max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_waiting")
    engine_command.check_device(args.device)
    if args.model and args.random:
        raise ConfigError("give --model or --random, not both")
    return serve(model=args.model, random=args.random, config=args.config, device=args.device, dtype=args.dtype,
                 host=args.host,
                 port=args.port, served_model_name=args.served_model_name,
                 api_key=args.api_key or os.environ.get("SPARSE_FRAMEWORK_API_KEY"), max_waiting=args.max_waiting,
                 drain_timeout=args.drain_timeout, log_level=args.log_level,
                 **engine_command.engine_options(args, args.max_model_len))


def build_llm(model: str | None, config: Any = None, *, device: str = "cpu", dtype: str | None = None,
              random: str | None = None, **engine_options: Any) -> tuple[LLM, str]:
    """The LLM `generate` would build for --model (None: its default; "reference": the toy), or
    `bench --random SHAPE`'s random-weight model (its prompts and outputs are token ids, as text
    "1 17 300" or id lists), and its name in the API. Its engine is not warmed up yet: the
    server's loop does that on its own thread (/health answers 503 meanwhile)."""
    if random is not None:
        loaded, sparse = engine_command.random_setup(random, config, device, dtype,
                                                     engine_options.get("kv_cache_dtype", "auto"))
        tokenizer = IdTokenizer(loaded.config.vocab_size, f"--random {random} (random weights)")
        llm = LLM.from_model(loaded, sparse, tokenizer=tokenizer, defer_warm_up=True, **engine_options)
        return llm, random
    name, checkpoint, sparse, max_model_len = engine_command.model_setup(model, config, engine_options.pop("max_model_len", None))
    llm = LLM(checkpoint, sparse, dtype=dtype, device=device, max_model_len=max_model_len, defer_warm_up=True,
              **engine_options)
    served = REFERENCE_NAME if name is None else (name if not Path(name).exists() else Path(name).name)
    return llm, served


def serve(model: str | None = None, config: Any = None, *, llm: LLM | None = None, host: str = "127.0.0.1",
          port: int = 8000, served_model_name: str | None = None, api_key: str | None = None,
          max_waiting: int = 256, drain_timeout: float = 30.0, log_level: str = "info", device: str = "cpu",
          dtype: str | None = None, random: str | None = None, **engine_options: Any) -> int:
    """Serve `llm` (or the model `generate --model` would load, or random weights of shape
    `random`, with `config` and the EngineConfig `engine_options`) until SIGTERM or Ctrl-C; 0
    after a clean shutdown."""
    try:
        import uvicorn  # noqa: F401 - make_server's, checked here

        from ..serve.app import ServerState, build_app
        from ..serve.metrics import ServerMetrics
    except ImportError as exc:
        raise ConfigError(f"serve needs the server's libraries ({exc.name} is missing): pip install starlette "
                          "uvicorn prometheus-client (the package's `serve` extra)") from None
    from ..serve.loop import EngineLoop

    if max_waiting < 1:
        raise ConfigError(f"--max-waiting must be >= 1, got {max_waiting}")
    if llm is None:
        llm, name = build_llm(model, config, device=device, dtype=dtype, random=random, **engine_options)
    else:
        name = model or REFERENCE_NAME
    name = served_model_name or name
    engine = llm.engine
    metrics = ServerMetrics(name)
    loop = EngineLoop(engine, on_finished=metrics.observe, warm_up_bar=True)
    metrics.attach(loop)
    max_model_len = engine.scheduler.max_model_len or engine.model_config.max_position_embeddings
    state = ServerState(llm, name, loop, metrics, max_waiting, max_model_len)
    app = build_app(state, api_key)
    server = make_server(app, loop, host=host, port=port, drain_timeout=drain_timeout, log_level=log_level)
    # uvicorn re-raises the signal it caught once it has shut down; with the default SIGTERM
    # action that would kill the process (exit -15) after a clean drain, so SIGTERM is made a no-op
    # here first (uvicorn restores this handler before re-raising).
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None) if main else None
    logging.getLogger(__name__).info("serving %s on http://%s:%d", name, host, port)
    try:
        server.run()
    except KeyboardInterrupt:  # the re-raised SIGINT
        pass
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return 0 if server.started else 1
