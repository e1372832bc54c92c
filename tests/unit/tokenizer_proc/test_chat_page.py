"""GET /, the chat page, without a browser (tests/e2e/test_chat_page_browser.py drives it in one):
the app answers with the packaged file at once, while the server is still starting and without
the api key, and the file names no other host, so that it works offline.

The app is called as ASGI directly (no HTTP client library is a test dependency)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

from runtime.config.args import ServerArgs
from tests.support import REPO_ROOT
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app

PAGE = REPO_ROOT / "tokenizer_proc" / "http" / "static" / "chat.html"


def get(path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` (with ``key`` as the bearer token) from an app whose server is still starting
    (no front door attached) and has an api key: (status, headers, body)."""
    app = build_app(HttpContext(ServerArgs(api_key="secret"), 1 << 20))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"localhost")] + ([] if key is None else [(b"authorization", f"Bearer {key}".encode())]),
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


def test_the_page_answers_while_the_server_starts_and_without_a_key() -> None:
    status, headers, body = get("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert body == PAGE.read_bytes()
    assert headers["cache-control"] == "no-cache"
    # the browser itself refuses anything from elsewhere, a mistake included
    assert "default-src 'none'" in headers["content-security-policy"]
    assert "connect-src 'self'" in headers["content-security-policy"]
    # what the page shows instead of the model's name: asks for the key, then "the server is starting"
    assert get("/v1/models")[0] == 401
    status, _, body = get("/v1/models", "secret")
    assert status == 503 and b"the server is starting" in body


def test_the_page_is_one_file_that_names_no_other_host() -> None:
    html = PAGE.read_text()
    assert "<script>" in html and "<style>" in html
    assert re.findall(r"\b(?:https?:)?//[\w.-]+\.\w", html) == []  # no URL with a host
    assert re.findall(r"\b(?:src|href)\s*=\s*\"(?!data:)", html) == []  # nothing loaded but a data: icon
    # it reaches the API relative to itself, so that it works behind a path prefix too
    assert {"v1/models", "v1/chat/completions"} <= set(re.findall(r'fetch\("([^"]+)"', html))
