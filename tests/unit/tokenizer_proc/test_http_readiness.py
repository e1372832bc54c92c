"""Until the server is ready, every API route answers 503 "starting" with ``Retry-After``, in its own
API's error shape, whatever the body, the method or the key: no route may reach the front door, the
tokenizer or a reply formatter before they exist (POST /v1/completions once answered 500 from an
assert on the logprob formatter). The walk covers every route the app has, so a route added later
is covered without a line here; only the chat page at ``/`` answers at once (it is static and shows
that the server is loading)."""

from __future__ import annotations

import json
from typing import Any, Iterator

from fastapi.routing import APIRoute

from runtime.config.args import ServerArgs
from tests.support.asgi import call_app
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.server import build_app

STATIC = {"/"}
# A body a client would send (a completion with logprobs reached the assert that failed).
BODY = json.dumps({"model": "m", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "logprobs": 1})


def _api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """Every APIRoute, through included routers (FastAPI keeps each as a wrapper of the original)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):
            yield from _api_routes(route.original_router.routes)


def _routes() -> list[tuple[str, str]]:
    app = build_app(HttpContext(ServerArgs(api_key="secret"), 1 << 20))
    return [
        (method, route.path)
        for route in _api_routes(app.routes)
        if route.path not in STATIC
        for method in sorted(route.methods)
    ]


def test_every_api_route_answers_503_with_retry_after_until_ready() -> None:
    routes = _routes()
    assert ("POST", "/v1/completions") in routes and ("GET", "/health") in routes
    app = build_app(HttpContext(ServerArgs(api_key="secret"), 1 << 20))
    for method, path in routes:
        concrete = path.replace("{", "").replace("}", "")  # a path parameter: any value
        for key in (None, "secret"):
            reply = call_app(
                app,
                method,
                concrete,
                BODY.encode() if method == "POST" else b"",
                {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})},
            )
            assert reply.status == 503, (method, path, reply.status, reply.body)
            assert reply.headers.get("retry-after") == "1", (method, path)
            assert b"the server is starting" in reply.body, (method, path, reply.body)
