"""Typed ZeroMQ sockets: every frame is one msgspec-msgpack message of a known union.

Why typed: a process decodes with ``msgspec.msgpack.Decoder(Union)`` so a frame that
is not a well-formed message of that union (a bug, a stray peer, a hostile client)
is rejected at the boundary with a logged error, never turned into an exception
inside a process's main loop, and never unpickled.

Internal sockets (between our own processes) have no high-water mark: a send never
blocks, so a busy scheduler cannot stall the tokenizer's event loop. Every socket
closes with linger 0: at shutdown nothing waits for undelivered frames.
"""

from __future__ import annotations

import logging
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _configure(sock: zmq.Socket[Any], endpoint: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


class PushSocket(Generic[T]):
    """The sending end of a pipeline: ``send(msg)`` never blocks (no high-water mark)."""

    def __init__(
        self, endpoint: str, msg_type: Any, *, bind: bool = False, ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.endpoint = endpoint
        self.msg_type = msg_type  # kept for symmetry and error messages; encoding needs no type
        self._sock: zmq.Socket[bytes] = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        _configure(self._sock, endpoint, bind)
        self._encoder = msgspec.msgpack.Encoder()

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._sock

    def send(self, msg: T) -> None:
        self._sock.send(self._encoder.encode(msg), copy=False)

    def close(self) -> None:
        self._sock.close(linger=0)


class PullSocket(Generic[T]):
    """The receiving end: decodes into ``msg_type``; malformed frames are logged and skipped."""

    def __init__(
        self, endpoint: str, msg_type: Any, *, bind: bool = True, ctx: zmq.Context[zmq.Socket[bytes]] | None = None
    ) -> None:
        self.endpoint = endpoint
        self._sock: zmq.Socket[bytes] = (ctx or zmq.Context.instance()).socket(zmq.PULL)
        _configure(self._sock, endpoint, bind)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The zmq socket, e.g. to register with a ``zmq.Poller`` over several sockets."""
        return self._sock

    def poll(self, timeout_ms: int | None = None) -> bool:
        """Wait up to ``timeout_ms`` (None: forever) for a frame; True when one is ready."""
        return bool(self._sock.poll(timeout_ms, zmq.POLLIN))

    def recv_nowait(self) -> T | None:
        """The next well-formed message, or None when no frame is waiting."""
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            msg = decode_or_log(self._decoder, frame.buffer, self.endpoint)
            if msg is not None:
                return msg

    def recv(self, timeout_ms: int | None = None) -> T | None:
        """Block up to ``timeout_ms`` for the next well-formed message (None on timeout)."""
        if not self.poll(timeout_ms):
            return None
        return self.recv_nowait()

    def recv_all_nowait(self) -> list[T]:
        """Every well-formed message already waiting, in arrival order."""
        out: list[T] = []
        while (msg := self.recv_nowait()) is not None:
            out.append(msg)
        return out

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncPullSocket(Generic[T]):
    """``PullSocket`` for an asyncio loop: ``await recv()`` returns the next well-formed message."""

    def __init__(self, endpoint: str, msg_type: Any, ctx: zmq.asyncio.Context, *, bind: bool = True) -> None:
        self.endpoint = endpoint
        self._sock: zmq.asyncio.Socket = ctx.socket(zmq.PULL)
        _configure(self._sock, endpoint, bind)
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(msg_type)

    async def recv(self) -> T:
        while True:
            frame = await self._sock.recv(copy=False)
            msg = decode_or_log(self._decoder, frame.buffer, self.endpoint)
            if msg is not None:
                return msg

    def close(self) -> None:
        self._sock.close(linger=0)


class AsyncRouter:
    """The client-facing ROUTER socket of the tokenizer (one DEALER per client).

    * ``ROUTER_MANDATORY``: a send to a client that has gone away raises
      ``ClientGone`` instead of being silently dropped, so the tokenizer can abort
      that client's requests.
    * Bounded queues per client: at most ``sndhwm`` replies wait for a client (past it
      ``send`` raises ``ClientBusy``: a client that does not read loses its own replies and
      holds no more memory), at most ``rcvhwm`` of its requests wait to be read (a flood
      is pushed back to its sender), and a frame over ``maxmsgsize`` bytes closes that
      client's connection before it is read (0: no limit, for tests).
    * ZMQ heartbeats, so a peer that vanished without closing is noticed.

    Frames are ``[identity, payload]``; the payload decoding is the caller's
    (it must answer a malformed payload with an error reply, not just drop it).
    """

    def __init__(
        self, ctx: zmq.asyncio.Context, endpoint: str, *, sndhwm: int = 0, rcvhwm: int = 0, maxmsgsize: int = 0
    ) -> None:
        sock: zmq.asyncio.Socket = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        if maxmsgsize > 0:
            sock.setsockopt(zmq.MAXMSGSIZE, maxmsgsize)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15000)
        self._sock = sock
        self.endpoint = self._bind(endpoint)
        self._encoder = msgspec.msgpack.Encoder()

    def _bind(self, endpoint: str) -> str:
        """Bind; ``tcp://host:0`` picks a free port. Returns the bound endpoint."""
        self._sock.bind(endpoint)
        return self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    async def recv(self) -> tuple[bytes, list[bytes]]:
        """(identity, payload frames) of the next client message."""
        frames = await self._sock.recv_multipart()
        return frames[0], frames[1:]

    async def send(self, identity: bytes, msg: Any) -> None:
        """Send one reply; ``ClientGone`` when the client is no longer connected,
        ``ClientBusy`` when its send queue is full (the reply is dropped)."""
        await self.send_raw(identity, self._encoder.encode(msg))

    async def send_raw(self, identity: bytes, payload: bytes) -> None:
        try:
            await self._sock.send_multipart([identity, payload], flags=zmq.DONTWAIT)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise ClientGone(identity) from None
            if exc.errno == zmq.EAGAIN:
                raise ClientBusy(identity) from None
            raise

    def close(self, linger_ms: int = 0) -> None:
        """Close; ``linger_ms`` lets replies already queued leave first (at shutdown)."""
        self._sock.close(linger=linger_ms)


class ClientGone(Exception):
    """The client with this identity is no longer connected to the ROUTER."""

    def __init__(self, identity: bytes) -> None:
        super().__init__(f"client {identity.hex()} is gone")
        self.identity = identity


class ClientBusy(Exception):
    """The client's send queue is full (it is not reading its replies): this one was dropped."""

    def __init__(self, identity: bytes) -> None:
        super().__init__(f"client {identity.hex()} is not reading; reply dropped")
        self.identity = identity


def decode_or_log(decoder: msgspec.msgpack.Decoder[T], payload: bytes | memoryview, where: str) -> T | None:
    """Decode one frame; on a malformed frame log an error and return None."""
    try:
        return decoder.decode(payload)
    except Exception as exc:  # DecodeError, ValidationError, or anything a hostile frame provokes
        logger.error("dropping malformed frame on %s (%d bytes): %s", where, len(payload), exc)
        return None
