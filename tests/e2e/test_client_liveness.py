"""The client notices a server that is gone (issue 17): killed, hung (SIGSTOP: it stops
answering ZMQ heartbeats) or never there. Every request in flight raises ``ServerGone``
within 10 s although the client has no timeout. The server here is a small ROUTER in a
subprocess that starts a stream and then sends nothing more, so only liveness can end it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import pytest

from runtime.client import CONNECT_TIMEOUT_S, HEARTBEAT_IVL_S, HEARTBEAT_TIMEOUT_S, Client, ServerGone
from tests.support import REPO_ROOT

# Answers a generate with one chunk and never finishes it; answers server_info.
FAKE_SERVER = r"""
import msgspec, sys, zmq
from runtime.protocol.messages import ClientRequest, ControlReply, GenerateChunk, GenerateReq
ctx = zmq.Context()
sock = ctx.socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
dec, enc = msgspec.msgpack.Decoder(ClientRequest), msgspec.msgpack.Encoder()
while True:
    identity, payload = sock.recv_multipart()
    req = dec.decode(payload)
    if isinstance(req, GenerateReq):
        reply = GenerateChunk(rid=req.rid, text="a", output_ids=[1], finished=False)
    else:
        reply = ControlReply(rid=req.rid, kind="server_info", payload={"ok": True})
    sock.send_multipart([identity, enc.encode(reply)])
"""


@pytest.fixture()
def fake_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    repo = str(REPO_ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-c", FAKE_SERVER],
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo,
        env={**os.environ, "PYTHONPATH": repo},
    )
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    yield proc, f"tcp://127.0.0.1:{port}"
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
    proc.wait(10)


def _stream_until_gone(client: Client, stop_server: Callable[[], Any]) -> float:
    """Start a stream, take its first chunk, stop the server; seconds until ServerGone."""
    stream = client.generate("hi", {"max_new_tokens": 100}, stream=True)
    assert next(stream)["text"] == "a"
    stop_server()
    t0 = time.monotonic()
    with pytest.raises(ServerGone) as exc:
        next(stream)
    assert exc.value.code == "server_gone" and isinstance(exc.value, ConnectionError)
    return time.monotonic() - t0


def test_a_killed_server_fails_the_stream_at_once(fake_server: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = fake_server
    with Client(address, timeout=None) as c:
        assert c.server_info() == {"ok": True}
        elapsed = _stream_until_gone(c, proc.kill)
    assert elapsed < 3, elapsed


def test_a_hung_server_fails_the_stream_when_heartbeats_stop(fake_server: tuple[subprocess.Popen[str], str]) -> None:
    proc, address = fake_server
    with Client(address, timeout=None) as c:
        elapsed = _stream_until_gone(c, lambda: proc.send_signal(signal.SIGSTOP))
        # Still down: a new request fails once it has waited CONNECT_TIMEOUT_S for a connection.
        t0 = time.monotonic()
        with pytest.raises(ServerGone):
            c.server_info()
        waited = time.monotonic() - t0
    assert elapsed < HEARTBEAT_IVL_S + HEARTBEAT_TIMEOUT_S + 2 < 10, elapsed
    assert waited < CONNECT_TIMEOUT_S + 2, waited


def test_no_server_at_the_address_fails_the_request() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"tcp://127.0.0.1:{port}", timeout=None) as c:
        t0 = time.monotonic()
        with pytest.raises(ServerGone) as exc:
            c.generate("hi")
    assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 2
    assert "no connection" in exc.value.message
