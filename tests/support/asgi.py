"""Calling the HTTP app as ASGI directly, in process: no server, no socket, no HTTP client library.
For unit tests of routes that need no front door (the chat page, the 503s while starting) or a fake one."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class AsgiReply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def call_app(app: Any, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> AsgiReply:
    """One request to ``app``, its whole reply (the app runs on a fresh event loop)."""
    raw_headers = [(b"host", b"localhost")] + [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    if body:
        raw_headers.append((b"content-length", str(len(body)).encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": raw_headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays connected until the reply is sent
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    reply_headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return AsgiReply(start["status"], reply_headers, b"".join(m.get("body", b"") for m in sent[1:]))
