"""GET /: the chat page (tokenizer_proc/http/static/chat.html), so that a person who just started
the server can talk to the model from a browser without writing code, as with llama.cpp's server.

The page is one static file shipped as package data (pyproject.toml's ``package-data``): inline
CSS and JS, nothing from a CDN, so it works offline. It is only a client of the server's own
OpenAI API (``GET /v1/models``, streamed ``POST /v1/chat/completions``), so it needs no state
here. Unlike every other route it answers while the server is still starting, and without the
api key: it holds no data, the page itself says that the server is loading (its
``/v1/models`` answers 503 until then) and asks for the key when ``/v1/models`` answers 401.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

# The page may reach only this server: a CDN link added by mistake fails in every browser, not
# only in an offline one.
_HEADERS = {
    "Cache-Control": "no-cache",  # a restarted (perhaps upgraded) server's page is fetched anew
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
    ),
}


@cache
def page_html() -> str:
    """The page's text, read once from the installed package."""
    return (resources.files("tokenizer_proc.http") / "static" / "chat.html").read_text(encoding="utf-8")


@router.get("/", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(page_html(), headers=_HEADERS)
