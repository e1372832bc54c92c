"""GET /, the chat page, without a browser (tests/e2e/test_chat_page_browser.py drives it in one):
the app answers with the packaged file at once, while the server is still starting and without
the api key, and the file names no other host, so that it works offline.

The app is called as ASGI directly (no HTTP client library is a test dependency)."""

from __future__ import annotations

import re

from runtime.config.args import ServerArgs
from tests.support import REPO_ROOT
from tests.support.asgi import call_app
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app

PAGE = REPO_ROOT / "tokenizer_proc" / "http" / "static" / "chat.html"


def get(path: str, key: str | None = None) -> tuple[int, dict[str, str], bytes]:
    """GET ``path`` (with ``key`` as the bearer token) from an app whose server is still starting
    (no front door attached) and has an api key: (status, headers, body)."""
    app = build_app(HttpContext(ServerArgs(api_key="secret"), 1 << 20))
    reply = call_app(app, "GET", path, headers=None if key is None else {"authorization": f"Bearer {key}"})
    return reply.status, reply.headers, reply.body


def test_the_page_answers_while_the_server_starts_and_without_a_key() -> None:
    status, headers, body = get("/")
    assert status == 200 and headers["content-type"].startswith("text/html")
    assert body == PAGE.read_bytes()
    assert headers["cache-control"] == "no-cache"
    # the browser itself refuses anything from elsewhere, a mistake included
    assert "default-src 'none'" in headers["content-security-policy"]
    assert "connect-src 'self'" in headers["content-security-policy"]
    # what the page shows instead of the model's name while starting: "the server is starting",
    # with or without a key (the API answers 503 before it checks one: tests/unit/tokenizer_proc/test_http_readiness.py)
    for key in (None, "secret"):
        status, _, body = get("/v1/models", key)
        assert status == 503 and b"the server is starting" in body


def test_the_page_is_one_file_that_names_no_other_host() -> None:
    html = PAGE.read_text()
    assert "<script>" in html and "<style>" in html
    assert re.findall(r"\b(?:https?:)?//[\w.-]+\.\w", html) == []  # no URL with a host
    assert re.findall(r"\b(?:src|href)\s*=\s*\"(?!data:)", html) == []  # nothing loaded but a data: icon
    # it reaches the API relative to itself, so that it works behind a path prefix too
    assert {"v1/models", "v1/chat/completions"} <= set(re.findall(r'fetch\("([^"]+)"', html))
