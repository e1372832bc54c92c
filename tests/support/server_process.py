"""A tinyserve server in a subprocess, for tests, benchmarks and notebooks in a source checkout.

``launch_server(flags)`` runs ``launch.py`` in a subprocess, waits for its ``ready:`` line and
yields a connected ``Client`` whose ``server`` is the ``ServerProcess`` handle (its address, pid,
log and ``stop``). ``server_argv`` turns a ``ServerArgs`` back into the flags that make it.
This lives with the tests, not in the product: a deployment starts ``launch.py`` (or the
``tinyserve`` command) itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Iterator, Sequence

from launch import HTTP_PREFIX, parse_ready_line
from runtime.client import Client
from runtime.config.args import FALSE_FLAGS, ServerArgs
from tests.support import REPO_ROOT

LAUNCH_SCRIPT = REPO_ROOT / "launch.py"


class ServerStartError(RuntimeError):
    pass


class ServerProcess:
    """A server running ``launch.py`` in a subprocess; its stderr goes to ``log_path``
    (by default a temporary file, read back and removed at ``stop``). ``env`` is the server's whole
    environment (None: this process's), so a caller can also leave variables out of it."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready_timeout: float = 300.0,
        log_path: str | None = None,
        wait: bool = True,
    ) -> None:
        self.argv = list(argv)
        self._own_log = log_path is None  # a temporary log is read back and removed at stop
        self._log_text: str | None = None
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="tinyserve-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, str(LAUNCH_SCRIPT), *self.argv],
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            text=True,
        )
        self.address: str | None = None
        self.http_address: str | None = None  # http://HOST:PORT of the HTTP server
        self.ready_line: str | None = None  # the whole ready line: the address, then what the KV pools reserved
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_stdout, daemon=True)
        self._reader.start()
        if wait:
            self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the ready line (the constructor does unless ``wait=False``); on a
        timeout or an early exit, stop the server and raise ServerStartError."""
        if not self._ready.wait(timeout):
            self.stop()
            raise ServerStartError(f"server not ready within {timeout:.0f} s\n{self.log_tail()}")
        if self.address is None:
            code = self.stop()
            raise ServerStartError(f"server exited with code {code} before it was ready\n{self.log_tail()}")

    def _read_stdout(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:  # keeps draining after ready so the pipe never fills
            if self.http_address is None and line.startswith(HTTP_PREFIX):
                self.http_address = line[len(HTTP_PREFIX) :].strip()
            address = parse_ready_line(line) if self.address is None else None
            if address is not None:
                self.address, self.ready_line = address, line.rstrip("\n")
                self._ready.set()
        self._ready.set()  # EOF: the server exited

    @property
    def pid(self) -> int:
        return self.process.pid

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's stderr (still available after ``stop``)."""
        if self._log_text is not None:
            return self._log_text[-chars:]
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")[-chars:]

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, wait, SIGKILL after ``timeout``; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._reader.join(5)
        if self.process.stdout is not None:
            self.process.stdout.close()
        if not self._log.closed:
            self._log.close()
            if self._own_log:
                self._log_text = self.log_tail(1 << 20)
                os.remove(self.log_path)
        return self.process.returncode


class ServedClient(Client):
    """A ``Client`` of a server this process started: ``server`` is its ``ServerProcess``."""

    def __init__(self, server: ServerProcess, *, api_key: str | None, timeout: float | None) -> None:
        assert server.address is not None
        super().__init__(server.address, api_key=api_key, timeout=timeout)
        self.server = server


def server_argv(args: Sequence[str] | ServerArgs) -> list[str]:
    """CLI flags for ``args`` (a ServerArgs becomes the flags of its non-default fields)."""
    if not isinstance(args, ServerArgs):
        return list(args)
    default = ServerArgs()
    argv: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            # Only True differs from a False default; a None default (auto) may be forced off.
            argv.append(flag if value else FALSE_FLAGS[f.name])
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]  # nargs="+" flags such as --cuda-graph-bs
        else:
            argv += [flag, str(value)]
    return argv


@contextlib.contextmanager
def launch_server(
    args: Sequence[str] | ServerArgs = (),
    *,
    env: dict[str, str] | None = None,
    extra_env: dict[str, str] | None = None,
    ready_timeout: float = 300.0,
    client_timeout: float | None = None,
) -> Iterator[ServedClient]:
    """Start a server and yield a connected ``Client``; stop both on exit.

    Without ``--port`` the server picks a free port. The client carries the
    server's api key, and ``client.server`` is the ``ServerProcess``. ``env``: the server's whole
    environment (None: this process's); ``extra_env``: variables set on top of it (a server given
    only them would have no PATH: its kernels' build finds no linker, and it serves without them
    after a long failed compile).
    """
    argv = server_argv(args)
    if "--port" not in argv and not any(a.startswith("--port=") for a in argv):
        argv += ["--port", "0"]
    parsed = ServerArgs.from_cli(argv)
    if extra_env:
        env = {**(os.environ if env is None else env), **extra_env}
    server = ServerProcess(argv, env=env, ready_timeout=ready_timeout)
    client = None
    try:
        assert server.address is not None
        client = ServedClient(server, api_key=parsed.api_key, timeout=client_timeout)
        yield client
    finally:
        if client is not None:
            client.close()
        server.stop()
