"""Control round trips of the front door: server_info, health and flush_cache.

Each call becomes one ``SchedControlReq`` with an internal rid, waits for the scheduler's
``SchedControlOut`` (or a timeout: a scheduler that does not answer makes health fail),
and is answered to the client that asked. A client may have at most
``--max-controls-per-client`` of them waiting: these are the requests a client can send
fastest and that cost the scheduler a turn each, so one socket cannot fill the
scheduler's queue with them (issue 17).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from runtime.protocol.ipc import PushSocket
from runtime.protocol.messages import (
    ControlReply,
    ErrorReply,
    FlushCacheReq,
    HealthReq,
    SchedControlOut,
    SchedControlReq,
    SchedErrorOut,
    ServerInfoReq,
)
from tokenizer_proc.request_builder import Rejected

HEALTH_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 120.0
_KIND = {FlushCacheReq: "flush_cache", ServerInfoReq: "server_info", HealthReq: "health"}

SendReply = Callable[[bytes, Any], Awaitable[bool]]  # ClientReplies.send: False when not delivered


@dataclass
class PendingControl:
    identity: bytes
    client_rid: str
    kind: str  # the client's kind: "flush_cache" | "server_info" | "health"
    sent_at: float
    timer: asyncio.TimerHandle | None = None


class ControlCalls:
    """The control calls waiting for the scheduler, by internal rid, and per client."""

    def __init__(
        self,
        to_scheduler: PushSocket[Any],
        reply: SendReply,
        max_per_client: int,
        compose_server_info: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> None:
        self.to_scheduler = to_scheduler
        self.reply = reply
        self.max_per_client = max_per_client
        self.compose_server_info = compose_server_info  # the scheduler's payload -> the whole server info
        self.pending: dict[str, PendingControl] = {}
        self.per_client: dict[bytes, int] = {}

    def start(self, identity: bytes, req: FlushCacheReq | ServerInfoReq | HealthReq) -> None:
        waiting = self.per_client.get(identity, 0)
        if waiting >= self.max_per_client:
            raise Rejected(
                "too_many_requests",
                f"this client has {waiting} control requests waiting for the "
                f"scheduler, the most --max-controls-per-client allows",
            )
        self.per_client[identity] = waiting + 1
        kind = _KIND[type(req)]
        internal = uuid.uuid4().hex
        pending = PendingControl(identity=identity, client_rid=req.rid, kind=kind, sent_at=time.monotonic())
        pending.timer = asyncio.get_running_loop().call_later(
            _timeout_s(kind), lambda: asyncio.ensure_future(self._timed_out(internal))
        )
        self.pending[internal] = pending
        # Health is a server_info round trip: it proves the scheduler loop is turning.
        self.to_scheduler.send(
            SchedControlReq(rid=internal, kind="flush_cache" if kind == "flush_cache" else "server_info")
        )

    def drop(self, internal: str) -> PendingControl | None:
        pending = self.pending.pop(internal, None)
        if pending is None:
            return None
        if pending.timer is not None:
            pending.timer.cancel()
        left = self.per_client.get(pending.identity, 0) - 1
        if left > 0:
            self.per_client[pending.identity] = left
        else:
            self.per_client.pop(pending.identity, None)
        return pending

    def client_gone(self, identity: bytes) -> None:
        for internal, pending in list(self.pending.items()):
            if pending.identity == identity:
                self.drop(internal)

    async def _timed_out(self, internal: str) -> None:
        pending = self.drop(internal)
        if pending is None:
            return
        code = "unhealthy" if pending.kind == "health" else "internal"
        await self.reply(
            pending.identity,
            ErrorReply(
                rid=pending.client_rid,
                code=code,
                message=f"the scheduler did not answer {pending.kind} within {_timeout_s(pending.kind):.0f} s",
            ),
        )

    async def handle_out(self, out: SchedControlOut) -> None:
        pending = self.drop(out.rid)
        if pending is None:
            return
        if pending.kind == "health":
            payload: dict[str, Any] = {"ok": True, "scheduler_round_trip_s": time.monotonic() - pending.sent_at}
        elif pending.kind == "server_info":
            payload = self.compose_server_info(out.payload)
        else:
            payload = dict(out.payload)
        await self.reply(pending.identity, ControlReply(rid=pending.client_rid, kind=pending.kind, payload=payload))

    async def handle_error(self, err: SchedErrorOut) -> bool:
        """Answer a scheduler error for a control call; False when it is not one."""
        pending = self.drop(err.rid)
        if pending is None:
            return False
        await self.reply(pending.identity, ErrorReply(rid=pending.client_rid, code=err.code, message=err.message))
        return True

    async def fail_all(self, code: str, message: str) -> None:
        for internal in list(self.pending):
            pending = self.drop(internal)
            if pending is not None:
                await self.reply(pending.identity, ErrorReply(rid=pending.client_rid, code=code, message=message))


def _timeout_s(kind: str) -> float:
    """How long a control call of ``kind`` waits for the scheduler."""
    return HEALTH_TIMEOUT_S if kind == "health" else CONTROL_TIMEOUT_S
