"""The client's connection to a server: one DEALER socket, its liveness, and reply routing.

``ClientConnection`` owns what every call of ``runtime.client.AsyncClient`` shares: the
socket (with ZMQ heartbeats and a monitor that reports handshakes and drops), one reader
task that routes each reply to the queue of the call waiting on its rid, and the failure
of every waiting call with ``ServerGone`` when the server vanishes or no connection comes
up within ``CONNECT_TIMEOUT_S``. The request API lives in ``runtime.client``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from runtime.client.errors import RequestError, RequestTimeout, ServerGone
from runtime.protocol.messages import ClientReply, ControlReply, GenerateChunk, GenerateChunks

logger = logging.getLogger(__name__)

# Liveness: libzmq pings the server every HEARTBEAT_IVL_S and drops the connection when
# nothing came back for HEARTBEAT_TIMEOUT_S (the server's I/O thread answers pings even
# while its Python code is busy); the socket monitor reports the drop.
HEARTBEAT_IVL_S = 1.0
HEARTBEAT_TIMEOUT_S = 4.0
CONNECT_TIMEOUT_S = 5.0  # how long a request waits for a connection that is down
_WATCHDOG_S = 0.5  # how often the reader checks that deadline while idle


async def _get_within(queue: "asyncio.Queue[Any]", wait: float | None) -> Any:
    """``queue.get()`` with a timeout; asyncio.timeout (3.11+) makes no task per call, as wait_for does."""
    if wait is None:
        return await queue.get()
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(wait):
            return await queue.get()
    return await asyncio.wait_for(queue.get(), wait)


class ClientConnection:
    """The socket, its liveness and the reply routing of one client (one per event loop)."""

    def __init__(
        self, address: str = "tcp://127.0.0.1:30000", api_key: str | None = None, timeout: float | None = None
    ) -> None:
        self.address = address
        self.api_key = api_key
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(HEARTBEAT_IVL_S * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(HEARTBEAT_TIMEOUT_S * 1000))
        # Before connect, so that the first handshake is seen.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(address)
        self._sock = sock
        # Non-blocking reads of both sockets from the reader (one wake drains everything).
        self._raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        self._raw_monitor: zmq.Socket[bytes] = zmq.Socket.shadow(self._monitor.underlying)
        self._connected = False
        self._down_since = time.monotonic()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ClientReply)
        # (kind, rid) -> queue of replies; kind is "gen", "ctl" or "abort".
        self._queues: dict[tuple[str, str], asyncio.Queue[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._closed = False

    def _ensure_open(self) -> None:
        if self._closed:
            raise ConnectionError("the client is closed")
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    def _encode(self, msg: Any) -> bytes:
        """The frame of ``msg``; a value msgpack cannot carry is that request's RequestError
        (``invalid_request``), so nothing half-encoded is ever sent."""
        try:
            return self._encoder.encode(msg)
        except (TypeError, ValueError, OverflowError, msgspec.EncodeError) as exc:
            # UnicodeEncodeError (a lone surrogate) is a ValueError; an unknown type a TypeError.
            raise RequestError(
                "invalid_request",
                f"the request cannot be encoded: {type(exc).__name__}: {exc}",
                getattr(msg, "rid", ""),
            ) from None

    def _send_frame(self, frame: bytes) -> None:
        # No high-water mark: never blocks; the returned future is already resolved.
        self._sock.send(frame, flags=zmq.DONTWAIT)

    def _send_nowait(self, msg: Any) -> None:
        self._send_frame(self._encode(msg))

    def _register(self, kind: str, rid: str) -> asyncio.Queue[Any]:
        key = (kind, rid)
        if key in self._queues:
            raise ValueError(f"rid {rid!r} is already in flight on this client")
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._queues[key] = queue
        return queue

    async def _next(self, queue: asyncio.Queue[Any], timeout: float | None = None) -> Any:
        wait = self.timeout if timeout is None else timeout
        try:
            item = queue.get_nowait()  # a stream's chunks arrive in bursts: no await when one is queued
        except asyncio.QueueEmpty:
            try:
                item = await _get_within(queue, wait)
            except (TimeoutError, asyncio.TimeoutError):
                raise RequestTimeout(f"no reply from {self.address} within {wait} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    async def _read_loop(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while True:
            await poller.poll(_WATCHDOG_S * 1000)
            # Replies first: what arrived before a disconnect is delivered before it fails the rest.
            while True:
                try:
                    frame = self._raw.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._deliver(frame)
            while True:
                try:
                    event = parse_monitor_message(self._raw_monitor.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                self._on_event(event["event"])
            if not self._connected and self._queues and time.monotonic() - self._down_since > CONNECT_TIMEOUT_S:
                self._fail_all(f"no connection to {self.address} for {CONNECT_TIMEOUT_S:.0f} s")

    def _on_event(self, event: int) -> None:
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self._connected = True
        elif event == zmq.EVENT_DISCONNECTED and self._connected:
            self._connected = False
            self._down_since = time.monotonic()
            # The server forgets a client whose connection dropped: nothing in flight will be answered.
            self._fail_all(
                f"lost the connection to {self.address} (closed, or no heartbeat answered "
                f"within {HEARTBEAT_TIMEOUT_S:.0f} s)"
            )

    def _fail_all(self, message: str) -> None:
        """Every call waiting now raises ServerGone (each removes its own queue as it ends)."""
        for (_, rid), queue in list(self._queues.items()):
            queue.put_nowait(ServerGone(message, rid))
        self._queues.clear()

    def _deliver(self, frame: bytes) -> None:
        if not frame:
            return  # the server's keepalive probe
        try:
            msg = self._decoder.decode(frame)
        except Exception as exc:
            logger.error("dropping a malformed reply (%d bytes): %s", len(frame), exc)
            return
        for one in msg.chunks if isinstance(msg, GenerateChunks) else (msg,):
            self._deliver_one(one)

    def _deliver_one(self, msg: Any) -> None:
        if isinstance(msg, (GenerateChunk, ControlReply)):
            # Every streamed token comes this way: one lookup; a reply nobody waits for
            # (its call ended, e.g. a stream left early) is dropped.
            kind = "gen" if isinstance(msg, GenerateChunk) else "abort" if msg.kind == "abort" else "ctl"
            queue = self._queues.get((kind, msg.rid))
            if queue is not None:
                queue.put_nowait(msg)
            return
        delivered = False
        for kind in ("gen", "ctl", "abort"):  # an ErrorReply: whichever call waits on this rid
            queue = self._queues.get((kind, msg.rid))
            if queue is not None:
                queue.put_nowait(msg)
                delivered = True
        if not delivered:
            logger.warning("server error for no pending request (rid %r): [%s] %s", msg.rid, msg.code, msg.message)

    async def _disconnect(self, linger_ms: int) -> None:
        """Stop the reader, fail whatever still waits, close the sockets and the context."""
        if self._reader is not None:
            self._reader.cancel()
            try:
                await self._reader
            except (asyncio.CancelledError, Exception):
                pass
        for queue in self._queues.values():
            queue.put_nowait(ConnectionError("client closed"))
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=linger_ms)
        self._ctx.term()
