"""A `sparse-framework serve` subprocess on 127.0.0.1 for the tests that drive real servers
(test_serve, test_serve_bench, test_serve_curve, test_serve_lm_eval, test_serve_metrics): started
ready (GET /health 200) or the test fails with its log. Skips the importing module without the
serve extra and the official client."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from sparse_framework.cli.engine import DEMO_CONFIG  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_MODEL_LEN = 512
# the tests that read the device buffer's hit counters (the `sparse` field's, /metrics') serve
# the demo config over the hierarchical store with the length rule, not the defaults since
# 94f4f92 (the resident store, which has no buffer, and the cost policy)
HIERARCHICAL_CONFIG = {**DEMO_CONFIG, "store": "hierarchical", "sparse_policy": "always"}
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess; started ready (GET /health 200) or the test fails with its log."""

    def __init__(self, argv: list[str], api_key: str | None = None, timeout: float = START_TIMEOUT_S) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(f"/tmp/test_serve_{self.port}.log")
        self.log = self.log_path.open("w")
        argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", headers=headers, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        pytest.fail(f"the server was not ready in {timeout:.0f} s:\n{self.log_path.read_text()[-3000:]}")

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60,
                             **kw)

    def metrics(self) -> dict[str, float]:
        """Unlabelled-by-pool samples by name (pool-labelled ones as name{pool})."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        text = httpx.get(self.url + "/metrics", headers=headers, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = re.match(r'^(\w+)\{([^}]*)\} (\S+)$', line)
            if not m:
                continue
            name, labels, value = m.groups()
            pool = re.search(r'pool="(\w+)"', labels)
            reason = re.search(r'reason="(\w+)"', labels)
            key = name + (f"{{{pool.group(1)}}}" if pool else "") + (f"{{{reason.group(1)}}}" if reason else "")
            out[key] = float(value)
        return out

    def wait_metrics(self, predicate, timeout: float = 30.0) -> dict[str, float]:  # noqa: ANN001
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if predicate(m) or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return -9
        finally:
            self.log.close()


def reference_server(*extra: str, api_key: str | None = None) -> Server:
    argv = ["-m", "sparse_framework.cli.main", "serve", "--model", "reference", "--port", "{port}",
            "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "warning", *extra]
    if api_key:
        argv += ["--api-key", api_key]
    return Server(argv, api_key=api_key)
