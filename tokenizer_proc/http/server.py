"""The HTTP front door: FastAPI on uvicorn, on the tokenizer process's own uvloop loop.

HTTP and ZMQ clients share one request path: an HTTP request becomes the same
``GenerateReq`` a ZMQ client sends, submitted as a *local client* of the
TokenizerManager (``open_local``), so validation, tokenization, the rid space, reply
routing, metrics and aborts are the ZMQ path's own. A client that disconnects closes
its local client, which aborts what it still has in flight (its KV is freed). The routes
reach the manager only through ``FrontDoor`` (tokenizer_proc/front_door.py).

The server listens from the start of the process, before the tokenizer and the
scheduler are ready: until then every endpoint answers 503 (``/health`` included), so
a load balancer can poll it; only the chat page at ``/`` answers at once (it is static and
says itself that the server is loading). Errors use OpenAI's JSON (``{"error": {"message", "type",
"param", "code"}}``); the status comes from the same error codes the ZMQ client sees.

This module binds and runs the server and assembles the app; the routes are in one module
per group, each an ``APIRouter`` that reaches the shared state through the ``Http``
dependency (tokenizer_proc/http/context.py):

- openai_routes.py: POST /v1/completions, /v1/chat/completions; GET /v1/models
- responses_routes.py: POST /v1/responses; GET, DELETE /v1/responses/{id} (OpenAI's Responses API)
- native_routes.py: POST /generate (SGLang's native body)
- ollama_routes.py: Ollama's API: POST /api/chat, /api/generate, /api/show; GET /api/tags, /api/ps, /api/version; HEAD /
- anthropic_routes.py: POST /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API, in
  its error shape)
- token_routes.py: POST /tokenize, /detokenize (SGLang's and vLLM's bodies)
- embedding_routes.py: POST /v1/embeddings, /encode, /v1/rerank (/rerank, /v2/rerank) on an embedding
  server (--is-embedding); POST /v1/score (SGLang's label-token probabilities) on a generation server
- lora_routes.py: POST /load_lora_adapter, /unload_lora_adapter (SGLang's, with --enable-lora)
- control_routes.py: GET /health, /health_generate, /get_server_info, /metrics (with
  --enable-metrics); POST /flush_cache, /drain
- chat_page.py: GET /, the chat page for a person with a browser (static/chat.html)
"""

from __future__ import annotations

import contextlib
import socket
from typing import Iterator

import uvicorn
from fastapi import FastAPI

from runtime.config.args import ServerArgs, endpoint
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.http import (
    anthropic_routes,
    chat_page,
    control_routes,
    embedding_routes,
    lora_routes,
    native_routes,
    ollama_routes,
    openai_routes,
    responses_routes,
    token_routes,
)
from tokenizer_proc.http.context import HttpContext
from tokenizer_proc.http.errors import add_error_handlers

__all__ = ["HttpServer", "build_app"]


class HttpServer:
    """Binds at construction (a port conflict is reported at once); ``serve`` runs it;
    ``attach`` makes it answer once the tokenizer manager (its ``FrontDoor``) exists."""

    def __init__(self, server_args: ServerArgs, max_request_bytes: int) -> None:
        self.server_args = server_args
        self.context = HttpContext(server_args, max_request_bytes)
        host, port = server_args.host, server_args.resolved_http_port()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise OSError(f"cannot listen for HTTP on {host}:{port} (--http-port): {exc}") from None
        bound = self.sock.getsockname()[1]
        self.address = endpoint("http", host, bound)
        self.app = build_app(self.context)
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            log_level=server_args.log_level,
            timeout_keep_alive=30,
        )
        self.server = _Server(config)

    @property
    def model_name(self) -> str:
        """The name the OpenAI API serves (--served-model-name, else the model path)."""
        return self.context.model_name

    def attach(self, door: FrontDoor) -> None:
        self.context.attach(door)

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: this process keeps run_child's (SIGTERM exits,
    SIGINT is the launcher's to handle)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # the same hook in uvicorn < 0.29
        pass


def build_app(context: HttpContext) -> FastAPI:
    """The app: ``context`` on ``app.state`` (the routes' ``Http`` dependency), the error
    handlers, the route groups and the chat page."""
    app = FastAPI(title="tinyserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.http = context
    add_error_handlers(app)
    app.include_router(control_routes.router)
    app.include_router(native_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(anthropic_routes.router)
    app.include_router(responses_routes.router)
    app.include_router(token_routes.router)
    app.include_router(ollama_routes.router)
    app.include_router(embedding_routes.router)
    app.include_router(lora_routes.router)
    app.include_router(chat_page.router)
    return app
