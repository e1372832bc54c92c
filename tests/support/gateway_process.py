"""SGLang's Model Gateway (PyPI ``sglang-router``, a Rust binary in a wheel) in a subprocess, in front of
tinyserve servers: for tests/e2e/test_gateway_e2e.py and bench/gateway_prefix.py.

``GatewayProcess(worker_urls, policy)`` starts ``python -m sglang_router.launch_router`` (the gateway's
own command line, from this interpreter's venv) on free ports of 127.0.0.1 and returns once the
gateway's ``/readiness`` counts every worker healthy; ``workers()`` is its own view of each worker,
``stop()`` ends it. One difference from the command a user types: the launcher imports its Python
debugging balancer (``sglang_router.mini_lb``), which imports SGLang's tracing from the ``sglang``
package when that is installed, and the project's venv has it (the frontend language's tests): 5 s of
CPU per start on a 2-core box, for nothing the Rust gateway uses. The child hides ``sglang`` from that
optional import (it then starts as it does where only ``sglang-router`` is installed) and runs the
same module as ``-m`` would.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

GATEWAY_MODULE = "sglang_router.launch_router"
# `python -m sglang_router.launch_router ARGS`, with the optional `sglang` import of its mini_lb made to fail
# at once (None in sys.modules: an ImportError, which mini_lb catches).
_MAIN = (
    "import runpy, sys\n"
    "sys.modules['sglang'] = None\n"
    f"runpy.run_module({GATEWAY_MODULE!r}, run_name='__main__', alter_sys=True)\n"
)
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


class GatewayStartError(RuntimeError):
    pass


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(url: str, method: str = "GET", body: Any = None, timeout: float = 30.0) -> tuple[int, Any]:
    """One HTTP request: (status, the body parsed as JSON, or its text when it is not JSON)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class GatewayProcess:
    """The gateway on ``127.0.0.1:<free port>`` routing to ``worker_urls`` (``http://HOST:PORT`` of
    tinyserve HTTP servers) by ``policy``; ``flags`` are more of the gateway's own flags
    (``--health-check-interval-secs 1`` ...). Its log (stdout and stderr) goes to a temporary file,
    read back by ``log_tail`` and removed at ``stop``."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        policy: str,
        flags: Sequence[str] = (),
        *,
        ready_timeout: float = READY_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> None:
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *self.worker_urls,
            "--policy",
            policy,
            # its Prometheus exporter binds 0.0.0.0:29000 by default: two gateways would collide
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
            *flags,
        ]
        fd, self.log_path = tempfile.mkstemp(prefix="sglang-gateway-", suffix=".log")
        self._log = os.fdopen(fd, "wb")
        self._log_text: str | None = None
        self.process = subprocess.Popen(
            [sys.executable, "-c", _MAIN, *self.argv], stdout=self._log, stderr=subprocess.STDOUT, env=env
        )
        try:
            self.wait_ready(ready_timeout)
        except BaseException:
            self.stop()
            raise

    def get(self, path: str) -> tuple[int, Any]:
        return http_json(self.url + path)

    def readiness(self) -> dict[str, Any] | None:
        """The gateway's ``/readiness`` body (healthy and total workers), None while it does not answer."""
        try:
            _, body = self.get("/readiness")
        except OSError:  # not listening yet
            return None
        return body if isinstance(body, dict) else None

    def workers(self) -> dict[str, bool]:
        """The gateway's own view: worker URL -> whether it counts it healthy."""
        status, body = self.get("/workers")
        assert status == 200, body
        return {w["url"]: bool(w["is_healthy"]) for w in body["workers"]}

    def wait_ready(self, timeout: float) -> None:
        """Until every worker is registered and healthy (the gateway registers them in the background,
        after it already listens)."""
        deadline = time.monotonic() + timeout
        want = len(self.worker_urls)
        while True:
            if self.process.poll() is not None:
                raise GatewayStartError(f"the gateway exited with {self.process.returncode}\n{self.log_tail()}")
            ready = self.readiness()
            if ready and ready.get("healthy_workers") == want and ready.get("total_workers") == want:
                return
            if time.monotonic() > deadline:
                raise GatewayStartError(f"the gateway not ready in {timeout:.0f} s: {ready}\n{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self, chars: int = 4000) -> str:
        if self._log_text is not None:
            return self._log_text[-chars:]
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()
            self._log_text = self.log_tail(1 << 20)
            os.remove(self.log_path)
        return self.process.returncode

    def __enter__(self) -> GatewayProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
