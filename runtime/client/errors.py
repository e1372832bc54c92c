"""The client's exceptions (``runtime.client`` exports them)."""

from __future__ import annotations

from typing import Any


class RequestError(Exception):
    """The server rejected or failed one request; ``code`` is machine-readable
    ("invalid_request", "unauthorized", "too_long", "internal", ...)."""

    def __init__(self, code: str, message: str, rid: str = "") -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.message = message
        self.rid = rid
        self.results: list[Any] | None = None  # for a batch: every result, errors in place


class RequestTimeout(TimeoutError):
    """No reply within the client's timeout; the request was aborted on the server."""


class ServerGone(RequestError, ConnectionError):
    """The connection to the server closed, or the server stopped answering heartbeats, or
    no connection came up within ``CONNECT_TIMEOUT_S``: the request is lost (a server that
    loses a client aborts its requests). Code ``server_gone``; also a ConnectionError."""

    def __init__(self, message: str, rid: str = "") -> None:
        super().__init__("server_gone", message, rid)
