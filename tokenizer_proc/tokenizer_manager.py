"""The TokenizerManager process: the server's front door.

One asyncio loop (uvloop) runs three tasks, and the HTTP server (tokenizer_proc/http_server.py):
  * clients: a ROUTER socket (one DEALER per client). Each request is checked,
    tokenized and pushed to the scheduler; control requests become a round trip to
    the scheduler.
  * outputs: text deltas from the detokenizer, routed back to the client that asked,
    by its ZMQ identity (a chunk per stream step, one reply for a non-stream request;
    tokenizer_proc/output_routing.py).
  * probe: every PROBE_INTERVAL_S an empty frame to each client with requests in
    flight; the ROUTER is ``ROUTER_MANDATORY``, so a client that has gone away makes
    the send fail, and its requests are aborted in the scheduler (their KV is freed).
    A streaming client is noticed at its next chunk already. (libzmq's
    ROUTER_NOTIFY would say it directly, but it is a draft option that the bundled
    libzmq does not enable.)

Limits (tokenizer_proc/limits.py): per client, requests in flight and control round trips
(``too_many_requests`` past them), and replies queued (a client that does not read loses
its own replies: a stream whose chunk is dropped is aborted). Big prompts are tokenized
on a worker thread, from a task of their own, so the client loop keeps reading.

Shutdown (SIGTERM, which the launcher also sends when another process died): every
request in flight, ZMQ or HTTP, gets an ``ErrorReply`` with code ``server_shutdown``, and
so does anything that arrives afterwards, before the process exits
(``tokenizer_proc/process.py``).

HTTP requests take the same path as ZMQ ones: each HTTP request is a *local client*
(``open_local``), an identity whose replies go to an asyncio queue instead of the
socket; it is validated by the same RequestBuilder, its rids live in the same maps,
and closing it (the HTTP client went away) aborts what it still has in flight.

This process owns the per-request routing state (``ReqGroup``); an entry lives
from the accepted request until its last output, an error, or an abort.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from runtime.args import ServerArgs
from runtime.ipc import AsyncRouter, ClientBusy, ClientGone, PushSocket
from runtime.messages import (
    AbortReq,
    ClientRequest,
    ControlReply,
    ErrorReply,
    FlushCacheReq,
    GenerateReq,
    HealthReq,
    SchedAbortReq,
    ServerInfoReq,
)
from tokenizer_proc.control import ControlCalls
from tokenizer_proc.limits import OFFLOAD_BYTES, prompt_chars
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.output_routing import OutputRouting
from tokenizer_proc.req_state import ReqGroup, SampleState
from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder, check_api_key

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.1
# Identities of local (HTTP) clients. ZMQ identities never start with a zero byte except the
# 5-byte ones libzmq makes up for peers without one, so these longer ones cannot collide.
LOCAL_PREFIX = b"\x00local-"
SHUTDOWN_MESSAGE = "the server is shutting down"
YIELD_EVERY = 16  # client messages handled between turns of the other tasks


class TokenizerManager(OutputRouting):
    """The front door: request intake here, reply routing in ``OutputRouting``."""

    def __init__(self, server_args: ServerArgs, tokenizer: Any, limits: ModelLimits,
                 router: AsyncRouter, to_scheduler: PushSocket[Any]) -> None:
        self.server_args = server_args
        self.limits = limits
        self.builder = RequestBuilder(tokenizer, limits)
        self.router = router
        self.to_scheduler = to_scheduler
        self.client_decoder = msgspec.msgpack.Decoder(ClientRequest)
        self.groups: dict[tuple[bytes, str], ReqGroup] = {}
        self.by_internal: dict[str, tuple[ReqGroup, SampleState]] = {}
        self.by_identity: dict[bytes, set[str]] = {}
        self.processes: dict[str, int] = {}  # name -> pid, from the launcher (server info)
        self.control = ControlCalls(to_scheduler, self.reply, server_args.max_controls_per_client, self.server_info)
        self.stats = {"requests_accepted": 0, "requests_rejected": 0, "requests_aborted": 0,
                      "clients_gone": 0, "malformed_frames": 0, "replies_dropped": 0}
        # Per client: scheduler requests of its groups in flight, control round trips
        # waiting, and rids being tokenized on the worker thread (issue 17's fairness).
        self.client_samples: dict[bytes, int] = {}
        self.building: dict[bytes, set[str]] = {}
        self.abandoned: set[tuple[bytes, str]] = set()  # aborted while being tokenized
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # one: big texts queue up
        self.tasks: set[asyncio.Task[None]] = set()  # offloaded requests (a reference keeps them alive)
        self.stopping = False
        self.local: dict[bytes, asyncio.Queue[Any]] = {}  # local (HTTP) clients' reply queues
        self.metrics: Metrics | None = None  # set when --enable-metrics
        self.log_requests = server_args.log_requests

    # ================================================================== client side

    async def client_loop(self) -> None:
        handled = 0
        while True:
            identity, frames = await self.router.recv()
            try:
                await self.handle_client_frames(identity, frames)
            except Exception:  # one bad request must never stop the server
                logger.exception("failed to handle a client message")
            handled += 1
            if handled % YIELD_EVERY == 0:
                # An await on a socket with a message waiting does not yield: without this a
                # flood of requests would starve the outputs (and the HTTP server) until drained.
                await asyncio.sleep(0)

    async def handle_client_frames(self, identity: bytes, frames: list[bytes]) -> None:
        if len(frames) == 1 and not frames[0]:
            return  # an empty frame is a keepalive; nothing to answer
        if len(frames) != 1:
            self.stats["malformed_frames"] += 1
            await self.reply(identity, ErrorReply(rid="", code="invalid_request",
                                                  message=f"expected one frame per message, got {len(frames)}"))
            return
        try:
            req = self.client_decoder.decode(frames[0])
        except Exception as exc:  # DecodeError / ValidationError: name the problem
            self.stats["malformed_frames"] += 1
            rid = _loose_rid(frames[0])
            logger.warning("rejecting a malformed request from %s: %s", identity.hex(), exc)
            await self.reply(identity, ErrorReply(rid=rid, code="invalid_request",
                                                  message=f"malformed request: {exc}"))
            return
        if isinstance(req, GenerateReq) and prompt_chars(req) >= OFFLOAD_BYTES:
            # Tokenized on the worker thread: this loop goes on reading the other clients.
            task = asyncio.ensure_future(self.handle_request(identity, req))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        await self.handle_request(identity, req)

    async def handle_request(self, identity: bytes, req: ClientRequest) -> None:
        """Answer one decoded request; every failure is an ErrorReply to its client."""
        try:
            check_api_key(self.server_args.api_key, req.api_key)
            if isinstance(req, GenerateReq):
                await self.handle_generate(identity, req)
            elif isinstance(req, AbortReq):
                await self.handle_abort(identity, req)
            elif isinstance(req, (FlushCacheReq, ServerInfoReq, HealthReq)):
                self.start_control(identity, req)
        except Rejected as exc:
            self.note_rejected(exc)
            await self.reply(identity, ErrorReply(rid=req.rid, code=exc.code, message=exc.message))
        except Exception as exc:  # a bug here must not leave the client waiting forever
            logger.exception("failed to handle request %s", req.rid)
            await self.reply(identity, ErrorReply(rid=req.rid, code="internal",
                                                  message=f"{type(exc).__name__}: {exc}"))

    def note_rejected(self, exc: Rejected) -> None:
        self.stats["requests_rejected"] += 1
        if self.metrics is not None:
            self.metrics.rejected_request(exc.code)

    async def handle_generate(self, identity: bytes, req: GenerateReq) -> None:
        if self.stopping:
            raise Rejected("server_shutdown", SHUTDOWN_MESSAGE)
        key = (identity, req.rid)
        building = self.building.get(identity, set())
        if key in self.groups or req.rid in building:
            raise Rejected("invalid_request", f"rid {req.rid!r} is already in flight")
        limit = self.server_args.max_requests_per_client
        if self.client_samples.get(identity, 0) + len(building) >= limit:
            raise Rejected("too_many_requests", f"this client has {limit} requests in flight, the most "
                                                f"--max-requests-per-client allows; wait for some to finish")
        abandoned = False  # aborted while it was tokenized: accepted, then aborted at once
        if prompt_chars(req) >= OFFLOAD_BYTES:
            subs, abandoned = await self._build_off_loop(identity, req)
        else:
            subs = self.builder.build(req)
        held = self.client_samples.get(identity, 0)
        if held + len(subs) > limit:
            raise Rejected("too_many_requests", f"{len(subs)} more requests would put this client past "
                                                f"--max-requests-per-client ({limit}; {held} in flight)")
        group = ReqGroup(identity=identity, client_rid=req.rid, stream=req.stream,
                         samples=[SampleState(index=i, internal_rid=s.rid) for i, s in enumerate(subs)])
        self.groups[key] = group
        self.client_samples[identity] = held + group.n
        self.by_identity.setdefault(identity, set()).add(req.rid)
        for sample in group.samples:
            self.by_internal[sample.internal_rid] = (group, sample)
        for sub in subs:
            self.to_scheduler.send(sub)
        self.stats["requests_accepted"] += 1
        logger.debug("accepted %s from %s as %s", req.rid, identity.hex(), [s.rid for s in subs])
        if self.log_requests:
            sp = subs[0].sampling_params
            logger.info("request %s: %d prompt tokens, n=%d, max_new_tokens=%d, temperature=%g, stream=%s, "
                        "from %s", req.rid, len(subs[0].input_ids), len(subs), sp.max_new_tokens, sp.temperature,
                        req.stream, "http" if identity.startswith(LOCAL_PREFIX) else "zmq")
        if abandoned:
            await self.abort_groups([group])

    async def _build_off_loop(self, identity: bytes, req: GenerateReq) -> tuple[list[Any], bool]:
        """``builder.build`` on the worker thread, and whether the client aborted the request
        meanwhile (the rid counts as in flight while it is tokenized)."""
        building = self.building.setdefault(identity, set())
        building.add(req.rid)
        try:
            subs = await asyncio.get_running_loop().run_in_executor(self.executor, self.builder.build, req)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            subs = []  # shutdown cancelled the queued work: answered below
        finally:
            building.discard(req.rid)
            if not building:
                self.building.pop(identity, None)
            abandoned = (identity, req.rid) in self.abandoned
            self.abandoned.discard((identity, req.rid))
        if self.stopping:
            raise Rejected("server_shutdown", SHUTDOWN_MESSAGE)
        if identity.startswith(LOCAL_PREFIX) and identity not in self.local:
            raise Rejected("aborted", "the client went away while its prompt was tokenized")
        return subs, abandoned

    async def handle_abort(self, identity: bytes, req: AbortReq) -> None:
        if req.all and self.server_args.api_key is not None:
            groups = list(self.groups.values())  # the key holder may stop everyone's requests
        elif req.all:  # without --api-key nobody proves to be the operator: only the caller's own
            groups = [self.groups[(identity, rid)] for rid in self.by_identity.get(identity, ())]
        else:
            group = self.groups.get((identity, req.rid))
            groups = [group] if group is not None else []
            if req.rid in self.building.get(identity, ()):  # still being tokenized: aborted once accepted
                self.abandoned.add((identity, req.rid))
                await self.reply(identity, ControlReply(rid=req.rid, kind="abort", payload={"aborted": True}))
                return
        await self.abort_groups(groups)
        payload: dict[str, Any] = {"aborted": len(groups) if req.all else bool(groups)}
        await self.reply(identity, ControlReply(rid=req.rid, kind="abort", payload=payload))

    async def abort_groups(self, groups: list[ReqGroup]) -> None:
        """Abort each group; its client gets each unfinished sample's last chunk (reason abort)."""
        for group in groups:
            self.stats["requests_aborted"] += 1
            for sample in self.drop_group(group, abort_in_scheduler=True):
                await self.reply(group.identity, self.final_chunk(
                    group, sample, finish_reason={"type": "abort", "message": "aborted by the client"}))

    def drop_group(self, group: ReqGroup, abort_in_scheduler: bool) -> list[SampleState]:
        """Forget a group; abort its unfinished samples in the scheduler. Returns those samples."""
        unfinished = group.unfinished()
        for sample in group.samples:
            self.by_internal.pop(sample.internal_rid, None)
            if abort_in_scheduler and not sample.finished:
                self.to_scheduler.send(SchedAbortReq(rid=sample.internal_rid))
                self.note_finished(group, sample, "abort", {})
        if self.groups.pop((group.identity, group.client_rid), None) is not None:
            left = self.client_samples.get(group.identity, 0) - group.n
            if left > 0:
                self.client_samples[group.identity] = left
            else:
                self.client_samples.pop(group.identity, None)
        rids = self.by_identity.get(group.identity)
        if rids is not None:
            rids.discard(group.client_rid)
            if not rids:
                del self.by_identity[group.identity]
        return unfinished

    def client_gone(self, identity: bytes) -> None:
        """The client disconnected: abort everything it had in flight (frees its KV)."""
        rids = list(self.by_identity.get(identity, ()))
        if rids:
            self.stats["clients_gone"] += 1
            logger.info("client %s went away; aborting %d request(s)", identity.hex(), len(rids))
        for rid in rids:
            group = self.groups.get((identity, rid))
            if group is not None:
                self.drop_group(group, abort_in_scheduler=True)
        self.control.client_gone(identity)

    async def reply(self, identity: bytes, msg: Any) -> bool:
        """Send to one client; False when it has gone away (its requests are aborted) or
        its send queue is full (the reply is dropped: it is not reading)."""
        queue = self.local.get(identity)
        if queue is not None:
            queue.put_nowait(msg)
            return True
        if identity.startswith(LOCAL_PREFIX):
            return False  # a local client that has closed: its requests were aborted then
        try:
            await self.router.send(identity, msg)
            return True
        except ClientGone:
            self.client_gone(identity)
            return False
        except ClientBusy:
            self.stats["replies_dropped"] += 1
            return False

    async def probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for identity in list(self.by_identity):
                if identity.startswith(LOCAL_PREFIX):
                    continue  # the HTTP server notices its own disconnects
                try:
                    await self.router.send_raw(identity, b"")
                except ClientGone:
                    self.client_gone(identity)
                except ClientBusy:
                    pass  # connected, just not reading

    # ================================================================== local (HTTP) clients

    def open_local(self) -> tuple[bytes, "asyncio.Queue[Any]"]:
        """A new local client: its identity, and the queue its replies go to."""
        identity = LOCAL_PREFIX + uuid.uuid4().bytes
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.local[identity] = queue
        return identity, queue

    def close_local(self, identity: bytes) -> None:
        """The local client is done or went away: abort whatever it still has in flight."""
        self.local.pop(identity, None)
        self.client_gone(identity)

    async def local_control(self, req: FlushCacheReq | ServerInfoReq | HealthReq) -> ControlReply | ErrorReply:
        """A control round trip for the HTTP server (server info, flush, health)."""
        identity, queue = self.open_local()
        try:
            self.start_control(identity, req)
            reply: ControlReply | ErrorReply = await queue.get()
            return reply
        finally:
            self.close_local(identity)

    def start_control(self, identity: bytes, req: FlushCacheReq | ServerInfoReq | HealthReq) -> None:
        if self.stopping:
            raise Rejected("server_shutdown", SHUTDOWN_MESSAGE)
        self.control.start(identity, req)

    def server_info(self, scheduler_payload: dict[str, Any]) -> dict[str, Any]:
        info = dict(scheduler_payload)
        info["tokenizer"] = {
            "active_requests": len(self.groups),
            "active_samples": len(self.by_internal),
            "active_clients": len(self.by_identity),
            "pending_controls": len(self.control.pending),
            "max_requests_per_client": self.server_args.max_requests_per_client,
            "max_controls_per_client": self.server_args.max_controls_per_client,
            **self.stats,
        }
        info["model"] = {
            "model_path": self.server_args.model_path,
            "tokenizer_path": self.server_args.resolved_tokenizer_path(),
            "vocab_size": self.limits.vocab_size,
            "context_len": self.limits.context_len,
            "max_req_input_len": self.limits.max_req_input_len,
            "max_total_tokens": self.limits.max_total_tokens,
        }
        info["server_args"] = self.server_args.redacted()
        info["processes"] = self.processes
        return info

    async def shutdown(self) -> None:
        """Tell every request in flight, and every control call waiting, that the server is
        going away; refuse whatever arrives afterwards (``stopping``)."""
        self.stopping = True
        for group in list(self.groups.values()):
            self.drop_group(group, abort_in_scheduler=True)
            await self.reply(group.identity, ErrorReply(rid=group.client_rid, code="server_shutdown",
                                                        message=SHUTDOWN_MESSAGE))
        await self.control.fail_all("server_shutdown", SHUTDOWN_MESSAGE)
        self.executor.shutdown(wait=False, cancel_futures=True)


def _loose_rid(frame: bytes) -> str:
    """The rid of a frame that failed typed decoding, when it has one (so the error
    reaches the right request); "" for garbage."""
    try:
        obj = msgspec.msgpack.decode(frame)
    except Exception:
        return ""
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else ""
