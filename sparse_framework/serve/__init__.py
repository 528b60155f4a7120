"""`sparse-framework serve`: an OpenAI-compatible HTTP server over one engine (docs/serve.md).

The top floor of the package: it imports the engine, nothing imports it but the CLI. Its
dependencies (starlette, uvicorn, prometheus-client) are the `serve` extra, so importing this
package does not import them; `serve()` and `build_app()` do.
"""

from __future__ import annotations

from typing import Any

__all__ = ["serve"]


def serve(*args: Any, **kwargs: Any) -> int:
    """Serve a model over HTTP until SIGTERM; see `sparse_framework.serve.command.serve`."""
    from .command import serve as run

    return run(*args, **kwargs)
