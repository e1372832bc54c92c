"""The "server" flags: the front doors (the ZMQ client socket and the HTTP server), who may use
them (--api-key, the per-client limits, the largest request) and how long a request or a graceful
shutdown may take. The tokenizer process enforces them (tokenizer_proc/limits.py, drain.py)."""

from __future__ import annotations

import argparse
from typing import Protocol


class FrontDoorFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    host: str
    port: int
    http_port: int | None
    api_key: str | None
    max_requests_per_client: int
    max_controls_per_client: int
    max_request_bytes: int | None
    graceful_shutdown_timeout: float
    stream_interval: int
    request_timeout: float | None
    responses_store_size: int

    def resolved_http_port(self) -> int: ...


def add_front_door_args(parser: argparse.ArgumentParser, defaults: FrontDoorFlags) -> None:
    """The "server" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("server")
    g.add_argument("--host", type=str, default=d.host, help=f"address the client socket binds (default {d.host})")
    g.add_argument(
        "--port",
        type=int,
        default=d.port,
        help=f"TCP port of the client socket; 0 picks a free port (default {d.port}). "
        "The chosen address is printed as 'ready: tcp://HOST:PORT'.",
    )
    g.add_argument(
        "--http-port",
        type=int,
        default=d.http_port,
        help="TCP port of the HTTP (OpenAI-compatible) server on --host; default --port + 1 "
        "(0 when --port is 0: a free port). The chosen address is printed as "
        "'http: http://HOST:PORT' before the ready line.",
    )
    g.add_argument(
        "--api-key",
        type=str,
        default=d.api_key,
        help="when set, every request must carry this key; over HTTP as 'Authorization: Bearer KEY' (default: none)",
    )
    g.add_argument(
        "--max-requests-per-client",
        type=int,
        default=d.max_requests_per_client,
        help="scheduler requests (each of n samples counts) one client may have in flight; "
        "more are refused with too_many_requests (HTTP 429). A ZMQ client is its "
        f"connection, an HTTP client one request (default {d.max_requests_per_client})",
    )
    g.add_argument(
        "--max-controls-per-client",
        type=int,
        default=d.max_controls_per_client,
        help="server_info / health / flush_cache round trips one client may have waiting for "
        f"the scheduler; more are refused with too_many_requests "
        f"(default {d.max_controls_per_client})",
    )
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=d.max_request_bytes,
        help="largest request frame (ZMQ_MAXMSGSIZE; a larger frame closes that client's "
        "connection) and HTTP body (413) in bytes (default: room for the longest prompt "
        "the model admits, 32 bytes per token of context + 1 MiB)",
    )
    g.add_argument(
        "--graceful-shutdown-timeout",
        type=float,
        default=d.graceful_shutdown_timeout,
        help="on SIGTERM (or POST /drain), refuse new requests and let those in flight finish "
        "for up to this many seconds, then abort the rest and exit 0; a second SIGTERM "
        "or SIGINT stops at once; 0 stops at once, answering every request in flight "
        f"with server_shutdown (default {d.graceful_shutdown_timeout:g})",
    )
    g.add_argument(
        "--stream-interval",
        type=int,
        default=d.stream_interval,
        help=f"send a stream chunk every N generated tokens (default {d.stream_interval})",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="seconds from arrival after which a generate request still waiting or running is "
        "aborted (finish reason abort, message 'timeout'), unless the request gives its "
        "own deadline_s (default: none)",
    )
    g.add_argument(
        "--responses-store-size",
        type=int,
        default=d.responses_store_size,
        help="responses POST /v1/responses keeps in memory (store, on by default) for "
        "previous_response_id and GET /v1/responses/ID; the least recently used beyond this many "
        f"are forgotten; 0 keeps none (default {d.responses_store_size})",
    )


def check_addresses(args: FrontDoorFlags) -> None:
    """Both ports must be bindable and distinct: a clash would otherwise fail in a child process,
    after the model has loaded."""
    if not args.host:
        raise ValueError("--host must not be empty")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535] (0 picks a free port), got {args.port}")
    if not 0 <= args.resolved_http_port() <= 65535:
        raise ValueError(f"--http-port must be in [0, 65535] (0 picks a free port), got {args.resolved_http_port()}")
    if args.port and args.resolved_http_port() == args.port:
        raise ValueError(f"--http-port must differ from --port ({args.port})")


def check_timeouts(args: FrontDoorFlags) -> None:
    """Time limits are seconds; a NaN or infinite request timeout would never fire (or always)."""
    if not args.graceful_shutdown_timeout >= 0:
        raise ValueError(f"--graceful-shutdown-timeout must be >= 0, got {args.graceful_shutdown_timeout}")
    if args.request_timeout is not None and not 0 < args.request_timeout < float("inf"):
        raise ValueError(f"--request-timeout must be a number of seconds > 0, got {args.request_timeout}")


def check_responses_store_size(args: FrontDoorFlags) -> None:
    """0 is a store that keeps nothing; a negative size means nothing."""
    if args.responses_store_size < 0:
        raise ValueError(f"--responses-store-size must be >= 0 (0 keeps none), got {args.responses_store_size}")


def check_api_key(args: FrontDoorFlags) -> None:
    """An empty key would look set (so required) yet match a missing Authorization header."""
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key must not be empty")
