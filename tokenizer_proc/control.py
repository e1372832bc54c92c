"""Control round trips of the front door: server_info, health, flush_cache, the profiler's start and
stop, and weight updates.

Each call becomes one ``SchedControlReq`` with an internal rid, waits for the scheduler's
``SchedControlOut`` (or a timeout: a scheduler that does not answer makes health fail),
and is answered to the client that asked. A client may have at most
``--max-controls-per-client`` of them waiting: these are the requests a client can send
fastest and that cost the scheduler a turn each, so one socket cannot fill the
scheduler's queue with them (issue 17).

A weight update waits for the running requests to finish before the scheduler answers, so it
waits longer (``WEIGHT_UPDATE_TIMEOUT_S``); its ``model_path`` is first resolved here to a local
checkpoint folder (``resolve_weight_update``: a hub id is downloaded, a GGUF file prepared, as
``--model-path`` is at start-up), off the event loop, so the scheduler only ever reads a folder.
A successful update is reported to ``on_weights`` even when its caller stopped waiting, so
/get_model_info always names the weights served.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import msgspec

from runtime.checkpoints.model_source import checkpoint_folder
from runtime.protocol.ipc import PushSocket
from runtime.protocol.messages import (
    ControlReply,
    ErrorReply,
    FlushCacheReq,
    HealthReq,
    LoraAdapterReq,
    ProfileReq,
    SchedControlOut,
    SchedControlReq,
    SchedErrorOut,
    ServerInfoReq,
    UpdateWeightsReq,
)
from tokenizer_proc.request_builder import Rejected

HEALTH_TIMEOUT_S = 20.0
CONTROL_TIMEOUT_S = 120.0
WEIGHT_UPDATE_TIMEOUT_S = 3600.0  # it waits for the running requests to finish, then loads
_KIND = {FlushCacheReq: "flush_cache", ServerInfoReq: "server_info", HealthReq: "health"}

ControlRequest = FlushCacheReq | ServerInfoReq | HealthReq | ProfileReq | UpdateWeightsReq | LoraAdapterReq
SendReply = Callable[[bytes, Any], Awaitable[bool]]  # ClientReplies.send: False when not delivered


@dataclass
class PendingControl:
    identity: bytes
    client_rid: str
    kind: str  # the client's kind: "flush_cache" | "server_info" | "health" | *_profile | "update_weights"
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
        on_weights: Callable[[dict[str, Any]], None] | None = None,
        on_adapters: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.to_scheduler = to_scheduler
        self.reply = reply
        self.max_per_client = max_per_client
        self.compose_server_info = compose_server_info  # the scheduler's payload -> the whole server info
        self.on_weights = on_weights  # told each successful weight update's payload (model_path, weight_version)
        self.on_adapters = on_adapters  # told each LoRA load / unload reply (the adapters loaded afterwards)
        self.pending: dict[str, PendingControl] = {}
        self.per_client: dict[bytes, int] = {}

    def start(self, identity: bytes, req: ControlRequest) -> None:
        waiting = self.per_client.get(identity, 0)
        if waiting >= self.max_per_client:
            raise Rejected(
                "too_many_requests",
                f"this client has {waiting} control requests waiting for the "
                f"scheduler, the most --max-controls-per-client allows",
            )
        kind = client_kind(req)
        internal = uuid.uuid4().hex
        sched_req = scheduler_request(internal, kind, req)
        self.per_client[identity] = waiting + 1
        pending = PendingControl(identity=identity, client_rid=req.rid, kind=kind, sent_at=time.monotonic())
        pending.timer = asyncio.get_running_loop().call_later(
            _timeout_s(kind), lambda: asyncio.ensure_future(self._timed_out(internal))
        )
        self.pending[internal] = pending
        self.to_scheduler.send(sched_req)

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
        if out.kind == "update_weights" and out.payload.get("success") and self.on_weights is not None:
            self.on_weights(out.payload)  # (first: the caller may have stopped waiting)
        if out.kind in ("load_lora", "unload_lora") and self.on_adapters is not None:
            self.on_adapters(out.payload)
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


def client_kind(req: ControlRequest) -> str:
    """The control call's kind, as its ``ControlReply`` names it."""
    if isinstance(req, ProfileReq):
        return "start_profile" if req.start else "stop_profile"
    if isinstance(req, UpdateWeightsReq):
        return "update_weights"
    if isinstance(req, LoraAdapterReq):
        return "load_lora" if req.load else "unload_lora"
    return _KIND[type(req)]


def scheduler_request(internal: str, kind: str, req: ControlRequest) -> SchedControlReq:
    """The scheduler's side of a control call (health is a server_info round trip: it proves the
    scheduler loop is turning)."""
    if isinstance(req, ProfileReq):
        if req.start and req.options is None:
            raise Rejected("invalid_request", "a profile start needs its options")
        return SchedControlReq(rid=internal, kind=kind, profile=req.options if req.start else None)
    if isinstance(req, UpdateWeightsReq):
        return SchedControlReq(rid=internal, kind=kind, weights=req.update)
    if isinstance(req, LoraAdapterReq):
        return SchedControlReq(rid=internal, kind=kind, lora=req.adapter)
    return SchedControlReq(rid=internal, kind="server_info" if kind == "health" else kind)


async def resolve_weight_update(req: UpdateWeightsReq) -> UpdateWeightsReq:
    """``req`` with its ``model_path`` turned into a local checkpoint folder, as ``--model-path`` is
    (``runtime.checkpoints.model_source``; on a worker thread: it may download or prepare); Rejected
    (``invalid_request``) when it names nothing that can be served."""
    path = req.update.model_path
    try:
        folder = await asyncio.get_running_loop().run_in_executor(None, checkpoint_folder, path)
    except Exception as exc:  # ModelSourceError, HubError, GGUFError, OSError: the message says why
        raise Rejected("invalid_request", f"model_path {path!r}: {exc}") from None
    return msgspec.structs.replace(req, update=msgspec.structs.replace(req.update, model_path=str(folder)))


def _timeout_s(kind: str) -> float:
    """How long a control call of ``kind`` waits for the scheduler."""
    if kind in ("update_weights", "unload_lora"):  # (an unload waits for the adapter's requests)
        return WEIGHT_UPDATE_TIMEOUT_S
    return HEALTH_TIMEOUT_S if kind == "health" else CONTROL_TIMEOUT_S
