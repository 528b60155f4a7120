"""An OpenAI-compatible HTTP server over one engine (docs/serve.md): app.py (the ASGI routes),
loop.py (the thread that steps the engine), protocol.py (the OpenAI request and response shapes),
metrics.py (/metrics).

It imports the engine; above it only the benchmarks' load client (bench/serve_client.py speaks HTTP to
it, importing nothing of it) and the CLI, whose `serve` builds the model and runs uvicorn
(`sparse_framework.cli.serve.serve(model=..., port=...)` from Python). Its dependencies
(starlette, uvicorn, prometheus-client) are the `serve` extra: importing this package does not
import them.
"""
