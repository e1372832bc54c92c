"""The TokenizerManager process: the server's front door.

One asyncio loop (uvloop) runs three tasks, and the HTTP server (tokenizer_proc/http/server.py):
  * clients: a ROUTER socket (one DEALER per client). Each request is checked,
    tokenized and pushed to the scheduler; control requests become a round trip to
    the scheduler.
  * outputs: text deltas from the detokenizer, routed back to the client that asked,
    by its ZMQ identity (a chunk per stream step, one reply for a non-stream request;
    tokenizer_proc/output_routing.py, replies sent by tokenizer_proc/client_replies.py).
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
socket; it is validated by the same RequestBuilder, its rids live in the same table,
and closing it (the HTTP client went away) aborts what it still has in flight. The HTTP
server sees the manager only through ``FrontDoor`` (tokenizer_proc/front_door.py).

Who owns what: the per-request routing state (``ReqGroup``, tokenizer_proc/routing_state.py)
is the ``RequestTable``'s (tokenizer_proc/request_table.py), from the accepted request (or
the start of its tokenizing) until its last output, an error or an abort; this intake adds
entries, ``OutputRouter`` ends them, both through the table's methods. ``ClientReplies``
owns the local clients' reply queues, ``ControlCalls`` the control round trips waiting.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from runtime.config.args import ServerArgs
from runtime.config.lora_args import lora_enabled, lora_refs
from runtime.protocol.ipc import AsyncRouter, PushSocket
from runtime.protocol.messages import (
    AbortReq,
    ClientRequest,
    ControlReply,
    DetokenizeReq,
    ErrorReply,
    FlushCacheReq,
    GenerateReq,
    HealthReq,
    LoraAdapterReq,
    ProfileReq,
    ServerInfoReq,
    TokenizedGenerateReq,
    TokenizeReq,
    UpdateWeightsReq,
)
from tokenizer_proc.client_replies import ClientReplies, is_local
from tokenizer_proc.control import ControlCalls, ControlRequest, resolve_weight_update
from tokenizer_proc.drain import DRAINING_MESSAGE, Drain
from tokenizer_proc.embedding_model import EmbeddingModel, load_embedding_model
from tokenizer_proc.limits import OFFLOAD_BYTES, prompt_chars
from tokenizer_proc.lora_names import LoraNames
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.output_routing import OutputRouter
from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder, check_api_key
from tokenizer_proc.request_table import RequestTable
from tokenizer_proc.routing_state import ReqGroup, SampleState
from tokenizer_proc.sampling_defaults import SamplingDefaults

logger = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.1
SHUTDOWN_MESSAGE = "the server is shutting down"
YIELD_EVERY = 16  # client messages handled between turns of the other tasks


class TokenizerManager:
    """The front door: request intake, aborts, control calls and shutdown here; reply routing
    in ``OutputRouter``; the requests in flight in ``RequestTable``."""

    def __init__(
        self,
        server_args: ServerArgs,
        tokenizer: Any,
        limits: ModelLimits,
        router: AsyncRouter,
        to_scheduler: PushSocket[Any],
        metrics: Metrics | None = None,
        sampling_defaults: SamplingDefaults | None = None,
        embedding: EmbeddingModel | None = None,
    ) -> None:
        self.server_args = server_args
        self.limits = limits
        # An embedding server's model (its pooling rule, its size), read once here; None: a generation server.
        self.embedding = embedding
        if embedding is None and server_args.is_embedding:
            self.embedding = load_embedding_model(server_args.resolved_model_path(), server_args.pooling)
        # Where unset sampling fields come from (--sampling-defaults); none given: the built-in ones.
        self.sampling_defaults = sampling_defaults or SamplingDefaults(server_args.sampling_defaults)
        # The LoRA adapters requests may name (tokenizer_proc/lora_names.py); None without --enable-lora.
        self.lora = LoraNames(lora_refs(server_args)) if lora_enabled(server_args) else None
        self.builder = RequestBuilder(
            tokenizer,
            limits,
            grammar_backend=server_args.grammar_backend,
            request_timeout=server_args.request_timeout,
            sampling_defaults=self.sampling_defaults.values,
            is_embedding=server_args.is_embedding,
            lora=self.lora,
        )
        self.router = router  # read here; ClientReplies sends on it (the process binds and closes it)
        self.to_scheduler = to_scheduler
        self.client_decoder = msgspec.msgpack.Decoder(ClientRequest)
        self.processes: dict[str, int] = {}  # name -> pid, from the launcher (server info)
        # Counters for server info, owned here; the replies and the routing bump theirs.
        self.stats: dict[str, int] = {
            "requests_accepted": 0,
            "requests_rejected": 0,
            "requests_aborted": 0,
            "clients_gone": 0,
            "malformed_frames": 0,
            "replies_dropped": 0,
            "requests_refused_overloaded": 0,
        }
        self.metrics = metrics  # None unless --enable-metrics
        self.table = RequestTable()
        self.replies = ClientReplies(router, self.stats, self.client_gone)
        # Control round trips waiting, per client (issue 17's fairness), are ControlCalls'.
        self.control = ControlCalls(
            to_scheduler,
            self.replies.send,
            server_args.max_controls_per_client,
            self.compose_server_info,
            self.weights_updated,
            self.lora.update if self.lora is not None else None,
        )
        # The checkpoint served and its version (SGLang's weight_version): moved by weight updates.
        self.served_weights: dict[str, Any] = {"model_path": server_args.model_path, "weight_version": "default"}
        self.outputs = OutputRouter(
            self.table, self.replies, to_scheduler, self.control, self.stats, metrics, server_args.log_requests
        )
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tokenize")  # one: big texts queue up
        self.tasks: set[asyncio.Task[None]] = set()  # offloaded requests (a reference keeps them alive)
        self.stopping = False
        self.draining = False  # set by the drain (tokenizer_proc/drain.py): new requests are refused
        self.drain: Drain | None = None  # the process gives it one (SIGTERM / POST /drain start it)

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
            await self.replies.send(
                identity,
                ErrorReply(
                    rid="", code="invalid_request", message=f"expected one frame per message, got {len(frames)}"
                ),
            )
            return
        try:
            req = self.client_decoder.decode(frames[0])
        except Exception as exc:  # DecodeError / ValidationError: name the problem
            self.stats["malformed_frames"] += 1
            rid = _loose_rid(frames[0])
            logger.warning("rejecting a malformed request from %s: %s", identity.hex(), exc)
            await self.replies.send(
                identity, ErrorReply(rid=rid, code="invalid_request", message=f"malformed request: {exc}")
            )
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
            elif isinstance(
                req, (FlushCacheReq, ServerInfoReq, HealthReq, ProfileReq, UpdateWeightsReq, LoraAdapterReq)
            ):
                await self.begin_control(identity, req)
            elif isinstance(req, (TokenizeReq, DetokenizeReq)):
                payload = await self.tokenize(req)
                await self.replies.send(
                    identity,
                    ControlReply(
                        rid=req.rid, kind="tokenize" if isinstance(req, TokenizeReq) else "detokenize", payload=payload
                    ),
                )
        except Rejected as exc:
            self.note_rejected(exc)
            await self.replies.send(identity, ErrorReply(rid=req.rid, code=exc.code, message=exc.message))
        except Exception as exc:  # a bug here must not leave the client waiting forever
            logger.exception("failed to handle request %s", req.rid)
            await self.replies.send(
                identity, ErrorReply(rid=req.rid, code="internal", message=f"{type(exc).__name__}: {exc}")
            )

    def note_rejected(self, exc: Rejected) -> None:
        self.stats["requests_rejected"] += 1
        if self.metrics is not None:
            self.metrics.rejected_request(exc.code)

    async def handle_generate(self, identity: bytes, req: GenerateReq) -> int:
        """Validate, tokenize and send one generate request to the scheduler; the number of
        samples accepted (``n``). Rejected when it is refused."""
        if self.stopping:
            raise Rejected("server_shutdown", SHUTDOWN_MESSAGE)
        if self.draining:
            raise Rejected("draining", DRAINING_MESSAGE)
        arrived = time.monotonic()  # a deadline counts from here (tokenizing included)
        table = self.table
        if table.contains(identity, req.rid) or table.is_building(identity, req.rid):
            raise Rejected("invalid_request", f"rid {req.rid!r} is already in flight")
        limit = self.server_args.max_requests_per_client
        if table.samples_in_flight(identity) + table.num_building(identity) >= limit:
            raise Rejected(
                "too_many_requests",
                f"this client has {limit} requests in flight, the most "
                f"--max-requests-per-client allows; wait for some to finish",
            )
        abandoned = False  # aborted while it was tokenized: accepted, then aborted at once
        if prompt_chars(req) >= OFFLOAD_BYTES:
            subs, abandoned = await self._build_off_loop(identity, req, arrived)
        else:
            subs = self.builder.build(req, arrived)
        held = table.samples_in_flight(identity)
        if held + len(subs) > limit:
            raise Rejected(
                "too_many_requests",
                f"{len(subs)} more requests would put this client past "
                f"--max-requests-per-client ({limit}; {held} in flight)",
            )
        group = ReqGroup(
            identity=identity,
            client_rid=req.rid,
            stream=req.stream,
            samples=[SampleState(index=i, internal_rid=s.rid) for i, s in enumerate(subs)],
        )
        table.add(group)
        for sub in subs:
            self.to_scheduler.send(sub)
        self.stats["requests_accepted"] += 1
        logger.debug("accepted %s from %s as %s", req.rid, identity.hex(), [s.rid for s in subs])
        if self.server_args.log_requests:
            sp = subs[0].sampling_params
            logger.info(
                "request %s: %d prompt tokens, n=%d, max_new_tokens=%d, temperature=%g, stream=%s, from %s",
                req.rid,
                len(subs[0].input_ids),
                len(subs),
                sp.max_new_tokens,
                sp.temperature,
                req.stream,
                "http" if is_local(identity) else "zmq",
            )
        if abandoned:
            await self.outputs.abort_groups([group])
        return group.n

    async def _build_off_loop(
        self, identity: bytes, req: GenerateReq, arrived: float
    ) -> tuple[list[TokenizedGenerateReq], bool]:
        """``builder.build`` on the worker thread, and whether the client aborted the request
        meanwhile (the rid counts as in flight while it is tokenized)."""
        self.table.begin_build(identity, req.rid)
        try:
            subs = await asyncio.get_running_loop().run_in_executor(self.executor, self.builder.build, req, arrived)
        except asyncio.CancelledError:
            if not self.stopping:
                raise
            subs = []  # shutdown cancelled the queued work: answered below
        finally:
            abandoned = self.table.end_build(identity, req.rid)
        if self.stopping:
            raise Rejected("server_shutdown", SHUTDOWN_MESSAGE)
        if is_local(identity) and not self.replies.is_open_local(identity):
            raise Rejected("aborted", "the client went away while its prompt was tokenized")
        return subs, abandoned

    async def handle_abort(self, identity: bytes, req: AbortReq) -> None:
        if req.all and self.server_args.api_key is not None:
            groups = self.table.all_groups()  # the key holder may stop everyone's requests
        elif req.all:  # without --api-key nobody proves to be the operator: only the caller's own
            groups = self.table.groups_of(identity)
        else:
            group = self.table.group(identity, req.rid)
            groups = [group] if group is not None else []
            if self.table.abandon(identity, req.rid):  # still being tokenized: aborted once accepted
                await self.replies.send(identity, ControlReply(rid=req.rid, kind="abort", payload={"aborted": True}))
                return
        await self.outputs.abort_groups(groups)
        payload: dict[str, Any] = {"aborted": len(groups) if req.all else bool(groups)}
        await self.replies.send(identity, ControlReply(rid=req.rid, kind="abort", payload=payload))

    def client_gone(self, identity: bytes) -> None:
        """The client disconnected: abort everything it had in flight (frees its KV)."""
        groups = self.table.groups_of(identity)
        if groups:
            self.stats["clients_gone"] += 1
            logger.info("client %s went away; aborting %d request(s)", identity.hex(), len(groups))
        for group in groups:
            self.outputs.drop_group(group, abort_in_scheduler=True)
        self.control.client_gone(identity)

    async def probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await self.replies.probe(self.table.clients())

    # ================================================================== local (HTTP) clients: front_door.FrontDoor

    @property
    def tokenizer(self) -> Any:
        """The HF tokenizer (the HTTP server turns logprob token ids into text with it)."""
        return self.builder.tokenizer

    @property
    def context_len(self) -> int:
        return self.limits.context_len

    @property
    def weight_version(self) -> str:
        return str(self.served_weights["weight_version"])

    def model_info(self) -> dict[str, Any]:
        """GET /get_model_info (SGLang's route): the model (the checkpoint and version served, once
        a weight update moved them), and the sampling defaults in force."""
        return {
            **self.served_weights,
            "tokenizer_path": self.server_args.resolved_tokenizer_path(),
            "is_generation": self.embedding is None,
            "context_len": self.limits.context_len,
            **self.sampling_defaults.info(),
        }

    def open_local(self) -> tuple[bytes, "asyncio.Queue[Any]"]:
        """A new local client: its identity, and the queue its replies go to."""
        return self.replies.open_local_queue()

    def close_local(self, identity: bytes) -> None:
        """The local client is done or went away: abort whatever it still has in flight."""
        self.replies.close_local_queue(identity)
        self.client_gone(identity)

    async def submit_local(self, identity: bytes, req: GenerateReq) -> int:
        """``handle_generate`` for a local client: the number of samples; a refusal is counted
        (as the ZMQ path's ``handle_request`` does) and raised as Rejected."""
        try:
            return await self.handle_generate(identity, req)
        except Rejected as exc:
            self.note_rejected(exc)
            raise

    async def tokenize(self, req: TokenizeReq | DetokenizeReq) -> dict[str, Any]:
        """A ``/tokenize`` (``tokens``, ``count``, ``max_model_len``) or ``/detokenize`` (``text``)
        answer, computed on the tokenize thread (a long text must not hold this loop); Rejected
        when the request is malformed. Nothing of it reaches the scheduler."""
        loop = asyncio.get_running_loop()
        if isinstance(req, DetokenizeReq):
            return {"text": await loop.run_in_executor(self.executor, self.builder.detokenize, req)}
        ids = await loop.run_in_executor(self.executor, self.builder.tokenize, req)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.limits.context_len}

    async def local_control(self, req: ControlRequest) -> ControlReply | ErrorReply:
        """A control round trip for the HTTP server (server info, flush, health, profiling, weights);
        Rejected when it is refused before it reaches the scheduler."""
        identity, queue = self.open_local()
        try:
            await self.begin_control(identity, req)
            reply: ControlReply | ErrorReply = await queue.get()
            return reply
        finally:
            self.close_local(identity)

    async def abort_requests(self, rid: str, abort_all: bool, why: str) -> int:
        """POST /abort_request (SGLang's): abort every request in flight whose client rid is ``rid``,
        whichever client sent it, or with ``abort_all`` every request; how many. Each ends with a last
        reply of finish reason abort, and the scheduler frees its KV."""
        groups = self.table.all_groups()
        if not abort_all:
            groups = [g for g in groups if g.client_rid == rid]
        await self.outputs.abort_groups(groups, why)
        return len(groups)

    # ================================================================== control, server info, shutdown

    async def begin_control(self, identity: bytes, req: ControlRequest) -> None:
        """``start_control``, a weight update's model path resolved first (off the loop)."""
        if isinstance(req, UpdateWeightsReq) and not self.stopping:
            req = await resolve_weight_update(req)
        self.start_control(identity, req)

    def weights_updated(self, payload: dict[str, Any]) -> None:
        """A weight update succeeded: report the checkpoint and version served from now on."""
        self.served_weights = {"model_path": payload["model_path"], "weight_version": payload["weight_version"]}

    def start_control(self, identity: bytes, req: ControlRequest) -> None:
        if self.stopping:
            raise Rejected("server_shutdown", SHUTDOWN_MESSAGE)
        if self.draining and isinstance(req, HealthReq):  # a load balancer stops sending here
            raise Rejected("draining", DRAINING_MESSAGE)
        self.control.start(identity, req)

    def start_drain(self, why: str) -> bool:
        """Start the graceful drain; False when it had started already (or cannot: stopping)."""
        if self.drain is None or self.drain.started or self.stopping:
            return False
        self.drain.start(why)
        return True

    def compose_server_info(self, scheduler_payload: dict[str, Any]) -> dict[str, Any]:
        """The whole server info: the scheduler's figures, and the front door's, the model's,
        the flags and the processes."""
        info = dict(scheduler_payload)
        info["tokenizer"] = {
            "active_requests": self.table.num_groups,
            "active_samples": self.table.num_unfinished_samples,
            "active_clients": self.table.num_clients,
            "pending_controls": len(self.control.pending),
            "max_requests_per_client": self.server_args.max_requests_per_client,
            "max_controls_per_client": self.server_args.max_controls_per_client,
            "draining": self.draining,
            **self.stats,
        }
        info["weight_version"] = self.served_weights["weight_version"]
        info["model"] = {
            **self.served_weights,
            "tokenizer_path": self.server_args.resolved_tokenizer_path(),
            "vocab_size": self.limits.vocab_size,
            "context_len": self.limits.context_len,
            "max_req_input_len": self.limits.max_req_input_len,
            "max_total_tokens": self.limits.max_total_tokens,
            **self.sampling_defaults.info(),
        }
        info["server_args"] = self.server_args.redacted()
        info["processes"] = self.processes
        return info

    async def shutdown(self) -> None:
        """Tell every request in flight, and every control call waiting, that the server is
        going away; refuse whatever arrives afterwards (``stopping``)."""
        self.stopping = True
        for group in self.table.all_groups():
            self.outputs.drop_group(group, abort_in_scheduler=True)
            await self.replies.send(
                group.identity, ErrorReply(rid=group.client_rid, code="server_shutdown", message=SHUTDOWN_MESSAGE)
            )
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
