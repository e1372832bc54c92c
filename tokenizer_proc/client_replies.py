"""Delivery of the front door's replies: to ZMQ clients through the ROUTER, to local (HTTP)
clients into their asyncio queues.

HTTP requests take the ZMQ path: each HTTP request is a *local client*, an identity whose
replies go to a queue that the HTTP server reads instead of the socket. ``ClientReplies``
owns those queues, from ``open_local_queue`` to ``close_local_queue``; the ROUTER socket is the
process's (tokenizer_proc/process.py binds and closes it).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Callable

from runtime.protocol.ipc import AsyncRouter, ClientBusy, ClientGone

# Identities of local (HTTP) clients. ZMQ identities never start with a zero byte except the
# 5-byte ones libzmq makes up for peers without one, so these longer ones cannot collide.
LOCAL_PREFIX = b"\x00local-"


def is_local(identity: bytes) -> bool:
    """Whether ``identity`` is a local (HTTP) client's, open or closed."""
    return identity.startswith(LOCAL_PREFIX)


class ClientReplies:
    """Sends replies; a ZMQ client found gone is reported to ``on_client_gone`` (which aborts
    its requests), and one that is not reading loses the reply (counted in ``stats``)."""

    def __init__(self, router: AsyncRouter, stats: dict[str, int], on_client_gone: Callable[[bytes], None]) -> None:
        self.router = router
        self._stats = stats  # the TokenizerManager's counters: this bumps "replies_dropped"
        self._on_client_gone = on_client_gone
        self._local: dict[bytes, asyncio.Queue[Any]] = {}  # open local clients' reply queues

    def open_local_queue(self) -> tuple[bytes, "asyncio.Queue[Any]"]:
        """A new local client: its identity, and the queue its replies go to."""
        identity = LOCAL_PREFIX + uuid.uuid4().bytes
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._local[identity] = queue
        return identity, queue

    def close_local_queue(self, identity: bytes) -> None:
        """The local client's queue takes no more replies (idempotent; aborting what the client
        has in flight is the TokenizerManager's ``close_local``)."""
        self._local.pop(identity, None)

    def is_open_local(self, identity: bytes) -> bool:
        """A local client whose queue still takes replies (one chunk at a time, not batched)."""
        return identity in self._local

    async def send(self, identity: bytes, msg: Any) -> bool:
        """Send to one client; False when it has gone away (its requests are aborted) or
        its send queue is full (the reply is dropped: it is not reading)."""
        queue = self._local.get(identity)
        if queue is not None:
            queue.put_nowait(msg)
            return True
        if is_local(identity):
            return False  # a local client that has closed: its requests were aborted then
        try:
            await self.router.send(identity, msg)
            return True
        except ClientGone:
            self._on_client_gone(identity)
            return False
        except ClientBusy:
            self._stats["replies_dropped"] += 1
            return False

    async def probe(self, identities: list[bytes]) -> None:
        """An empty frame to each ZMQ client: the ROUTER is ``ROUTER_MANDATORY``, so a client
        that has gone away makes the send fail (local clients' disconnects are the HTTP
        server's to notice)."""
        for identity in identities:
            if is_local(identity):
                continue
            try:
                await self.router.send_raw(identity, b"")
            except ClientGone:
                self._on_client_gone(identity)
            except ClientBusy:
                pass  # connected, just not reading
