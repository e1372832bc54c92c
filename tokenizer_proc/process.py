"""The tokenizer process's entry: bind both front doors, load the tokenizer, wait for the
scheduler's figures, then serve.

The HTTP server starts listening first, so that ``/health`` answers 503 while the rest
starts (the tokenizer load runs in a thread meanwhile); the ZMQ socket is bound as early,
so that a port conflict is reported in a second, not after the model load of the other
processes.

SIGTERM (from the launcher: a stop, or another process died) is handled on the loop: once
serving, every request in flight gets a ``server_shutdown`` error, the HTTP server lets
its responses finish, and the ZMQ replies are given up to SHUTDOWN_LINGER_MS to leave,
before the process exits. SIGUSR1 (the launcher's first SIGTERM) starts a graceful drain
instead (tokenizer_proc/drain.py), which ends in the same stop once nothing is in flight.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from multiprocessing.connection import Connection
from typing import Any

import zmq
import zmq.asyncio

from runtime.config.args import ServerArgs, endpoint
from runtime.config.port_args import PortArgs
from runtime.protocol.child_process import exit_now, recv_status, send_status
from runtime.protocol.ipc import AsyncPullSocket, AsyncRouter, PushSocket
from runtime.protocol.messages import SchedulerInput, TokenizerInput
from runtime.text.tokenizer import load_tokenizer
from tokenizer_proc.drain import Drain
from tokenizer_proc.limits import default_max_request_bytes, send_hwm
from tokenizer_proc.request_builder import ModelLimits
from tokenizer_proc.sampling_defaults import SamplingDefaults
from tokenizer_proc.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 1.0  # for HTTP responses to finish (they were all answered already)
SHUTDOWN_LINGER_MS = 500  # for the ZMQ replies to leave
ROUTER_RCVHWM = 1000  # requests read ahead per client: a flood waits in its sender's queue


async def _serve(server_args: ServerArgs, port_args: PortArgs, ready_conn: Connection) -> None:
    from tokenizer_proc.http.server import HttpServer
    from tokenizer_proc.metrics import Metrics

    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task[None]] = []
    manager: TokenizerManager | None = None

    def on_sigterm() -> None:
        if manager is None:
            exit_now()  # not serving yet: nothing to tell anyone
        if not stopping:
            stopping.append(asyncio.ensure_future(_stop(manager, http, http_task, ctx, router, from_detokenizer)))

    loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    # SIGUSR1: the launcher's first SIGTERM asks for a graceful drain (tokenizer_proc/drain.py).
    loop.add_signal_handler(signal.SIGUSR1, lambda: manager is not None and manager.start_drain("SIGTERM"))
    ctx = zmq.asyncio.Context()
    max_request_bytes = server_args.max_request_bytes or default_max_request_bytes(
        server_args.resolved_model_path(), server_args.context_length
    )
    router = AsyncRouter(
        ctx,
        server_args.client_address(),
        maxmsgsize=max_request_bytes,
        rcvhwm=ROUTER_RCVHWM,
        sndhwm=send_hwm(server_args.max_requests_per_client, server_args.max_controls_per_client),
    )
    from_detokenizer: AsyncPullSocket[Any] = AsyncPullSocket(port_args.tokenizer_ipc, TokenizerInput, ctx, bind=True)
    to_scheduler: PushSocket[Any] = PushSocket(port_args.scheduler_input_ipc, SchedulerInput, bind=False)
    http = HttpServer(server_args, max_request_bytes)
    http_task = asyncio.ensure_future(http.serve())
    tokenizer = await loop.run_in_executor(
        None, load_tokenizer, server_args.resolved_tokenizer_path(), server_args.chat_template
    )
    # The launcher sends the scheduler's figures once the scheduler is ready.
    info = await loop.run_in_executor(None, recv_status, ready_conn)
    limits = ModelLimits(
        vocab_size=int(info["vocab_size"]),
        context_len=int(info["context_len"]),
        max_req_input_len=int(info["max_req_input_len"]),
        max_total_tokens=int(info["max_total_tokens"]),
    )
    metrics = Metrics(http.model_name) if server_args.enable_metrics else None
    sampling_defaults = SamplingDefaults.load(server_args)
    sampling_defaults.log()
    manager = TokenizerManager(server_args, tokenizer, limits, router, to_scheduler, metrics, sampling_defaults)
    manager.processes = dict(info.get("processes") or {})

    async def drained() -> None:
        send_status(ready_conn, {"status": "drained"})  # the launcher stops the others and exits 0
        on_sigterm()

    manager.drain = Drain(manager, server_args.graceful_shutdown_timeout, drained)
    http.attach(manager)
    address = endpoint("tcp", server_args.host, router.port)
    send_status(ready_conn, {"status": "ready", "address": address, "http_address": http.address})
    logger.info("tokenizer ready on %s and %s", address, http.address)
    await asyncio.gather(
        manager.client_loop(), manager.outputs.output_loop(from_detokenizer), manager.probe_loop(), http_task
    )


async def _stop(
    manager: TokenizerManager,
    http: Any,
    http_task: "asyncio.Future[None]",
    ctx: zmq.asyncio.Context,
    router: AsyncRouter,
    from_detokenizer: AsyncPullSocket[Any],
) -> None:
    """Answer everything in flight with server_shutdown, let the answers leave, exit 0."""
    try:
        logger.info("shutting down: %d request(s) in flight get server_shutdown", manager.table.num_groups)
        await manager.shutdown()
        http.server.should_exit = True  # uvicorn closes idle connections and finishes the answered ones
        try:
            await asyncio.wait_for(asyncio.shield(http_task), SHUTDOWN_GRACE_S)
        except (asyncio.TimeoutError, Exception):
            pass
        router.close(SHUTDOWN_LINGER_MS)
        from_detokenizer.close()
        ctx.term()  # returns once the router's queued replies are sent, or after the linger
    finally:
        exit_now()


def run_tokenizer_process(server_args: ServerArgs, port_args: PortArgs, ready_conn: Connection) -> None:
    """Child-process main: bind, load the tokenizer, wait for the scheduler's figures, serve."""
    import uvloop

    uvloop.run(_serve(server_args, port_args, ready_conn))
