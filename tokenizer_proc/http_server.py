"""The HTTP front door: FastAPI on uvicorn, on the tokenizer process's own uvloop loop.

HTTP and ZMQ clients share one request path: an HTTP request becomes the same
``GenerateReq`` a ZMQ client sends, submitted as a *local client* of the
TokenizerManager (``open_local``), so validation, tokenization, the rid space, reply
routing, metrics and aborts are the ZMQ path's own. A client that disconnects closes
its local client, which aborts what it still has in flight (its KV is freed). This
module reaches the manager only through ``FrontDoor`` (tokenizer_proc/front_door.py).

The server listens from the start of the process, before the tokenizer and the
scheduler are ready: until then every endpoint answers 503 (``/health`` included), so
a load balancer can poll it. Errors use OpenAI's JSON (``{"error": {"message", "type",
"param", "code"}}``); the status comes from the same error codes the ZMQ client sees.

Endpoints: POST /v1/completions, /v1/chat/completions, /generate (SGLang's native
body), /flush_cache, /drain; GET /v1/models, /health, /health_generate, /get_server_info,
/metrics (with --enable-metrics).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, AsyncIterator, Iterator

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from runtime.config.args import ServerArgs, endpoint
from runtime.protocol.messages import ErrorReply, FlushCacheReq, GenerateChunk, GenerateReq, HealthReq, ServerInfoReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc import openai_reply as reply_fmt
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.request_builder import Rejected, check_api_key

logger = logging.getLogger(__name__)

# The ZMQ error codes as HTTP statuses (an unknown code is a 500).
STATUS_OF_CODE = {"invalid_request": 400, "too_long": 400, "unauthorized": 401, "model_not_found": 404,
                  "too_many_requests": 429, "out_of_memory": 503, "unhealthy": 503, "starting": 503,
                  "server_shutdown": 503, "draining": 503, "overloaded": 503, "aborted": 499, "internal": 500}
# Refusals a client should retry elsewhere or later: their 503 says after how many seconds.
RETRY_AFTER_S = {"draining": 1, "overloaded": 1}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}
SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


class RequestFailed(Exception):
    """A request that ended in an error reply after it was accepted (e.g. out of memory)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ClientWentAway(Exception):
    """The HTTP client disconnected before its reply; nothing is left to answer."""


def error_response(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": code}}
    retry = RETRY_AFTER_S.get(code)
    return JSONResponse(body, status_code=status, headers=None if retry is None else {"Retry-After": str(retry)})


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


class LocalRun:
    """The requests of one HTTP request, as one local client of the front door."""

    def __init__(self, door: FrontDoor, reqs: list[GenerateReq]) -> None:
        self.door = door
        self.reqs = reqs
        self.identity, self.queue = door.open_local()
        self.prompt_index = {r.rid: i for i, r in enumerate(reqs)}
        self.n = 1  # samples per prompt (the requests share their sampling params)

    async def submit(self) -> None:
        """Validate and send every request; Rejected (and nothing left running) when one fails."""
        try:
            samples = [await self.door.submit_local(self.identity, req) for req in self.reqs]
        except BaseException:
            self.close()
            raise
        self.n = samples[0]

    async def events(self) -> AsyncIterator[tuple[int, GenerateChunk]]:
        """(prompt index, chunk) until every sample has finished; RequestFailed on an error
        reply, ClientWentAway when the HTTP client went away."""
        left = len(self.reqs) * self.n
        while left:
            try:
                msg = self.queue.get_nowait()  # chunks come in bursts: no await when one is queued
            except asyncio.QueueEmpty:
                msg = await self.queue.get()
            if isinstance(msg, GenerateChunk):
                left -= msg.finished
                yield self.prompt_index[msg.rid], msg
            elif isinstance(msg, ErrorReply):
                raise RequestFailed(msg.code, msg.message)
            elif isinstance(msg, BaseException):
                raise msg

    def disconnected(self) -> None:
        self.close()
        self.queue.put_nowait(ClientWentAway())

    def close(self) -> None:
        """Idempotent: aborts whatever has not finished."""
        self.door.close_local(self.identity)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def abort_on_disconnect(request: Request, run: LocalRun) -> AsyncIterator[None]:
    """For a non-stream reply: abort the run if the client goes away before it is sent
    (a stream notices it itself, when Starlette cancels it)."""
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    watcher.add_done_callback(lambda t: None if t.cancelled() else run.disconnected())
    try:
        yield
    finally:
        watcher.cancel()


class HttpServer:
    """Binds at construction (a port conflict is reported at once); ``serve`` runs it;
    ``attach`` makes it answer once the tokenizer manager (its ``FrontDoor``) exists."""

    def __init__(self, server_args: ServerArgs, max_request_bytes: int) -> None:
        self.server_args = server_args
        self.max_request_bytes = max_request_bytes  # a larger body is refused (413) before it is read
        self.model_name = server_args.served_model_name or server_args.resolved_model_path()
        self.door: FrontDoor | None = None
        self.logprobs: reply_fmt.LogprobFormatter | None = None
        self.created = reply_fmt.now()
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
        self.app = build_app(self)
        config = uvicorn.Config(self.app, log_config=None, access_log=False, lifespan="off",
                                log_level=server_args.log_level, timeout_keep_alive=30)
        self.server = _Server(config)

    def attach(self, door: FrontDoor) -> None:
        self.door = door
        self.logprobs = reply_fmt.LogprobFormatter(door.tokenizer)

    async def serve(self) -> None:
        await self.server.serve(sockets=[self.sock])

    # ------------------------------------------------------------------ helpers for the routes

    def ready_door(self) -> FrontDoor:
        if self.door is None:
            raise oai.BadRequest("the server is starting", status=503, code="starting")
        return self.door

    def authorize(self, request: Request) -> None:
        header = request.headers.get("authorization")
        key = header[7:].strip() if header is not None and header[:7].lower() == "bearer " else None
        check_api_key(self.server_args.api_key, key)

    def check_model(self, model: str) -> None:
        if model not in (self.model_name, self.server_args.model_path):
            raise oai.BadRequest(f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                                 "model", status=404, code="model_not_found")

    def output_parsing(self, body: oai.ChatCompletionRequest) -> reply_fmt.OutputParsing:
        """How a chat request's output is read: its tools against --tool-call-parser, its reasoning
        split by --reasoning-parser unless it asked to keep it inline (separate_reasoning false)."""
        args = self.server_args
        tools = body.tool_plan(args.tool_call_parser)
        return reply_fmt.OutputParsing(tools, args.tool_call_parser,
                                       args.reasoning_parser if body.separate_reasoning else None,
                                       body.enable_thinking, constrained=bool(tools.constraint) or body.constrained)

    def prompt_texts(self, body: oai.CompletionRequest) -> list[str]:
        """Each prompt as text (``echo``): token-id prompts decoded."""
        prompts = body.prompt if isinstance(body.prompt, list) and body.prompt and \
            not isinstance(body.prompt[0], int) else [body.prompt]
        door = self.ready_door()
        return [p if isinstance(p, str) else str(door.tokenizer.decode(p)) for p in prompts]

    async def start(self, reqs: list[GenerateReq]) -> LocalRun:
        run = LocalRun(self.ready_door(), reqs)
        await run.submit()
        return run


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: this process keeps run_child's (SIGTERM exits,
    SIGINT is the launcher's to handle)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # the same hook in uvicorn < 0.29
        pass


async def _body(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The body, validated; one over ``limit`` bytes is refused before it is read whole."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise oai.BadRequest(f"the request body has {declared} bytes; the most this server reads is {limit} "
                             f"(--max-request-bytes)", status=413, code="too_long")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise oai.BadRequest(f"the request body is longer than {limit} bytes (--max-request-bytes)",
                                 status=413, code="too_long")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _loc_path(err.get("loc", ()))
        raise oai.BadRequest(f"{param or 'body'}: {err.get('msg')}", param or None) from None


def _loc_path(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; union-branch labels are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in ("str", "int", "float", "bool", "list"):
            out += ("." if out else "") + part
        else:
            break
    return out


def build_app(http: HttpServer) -> FastAPI:
    app = FastAPI(title="tinyserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(oai.BadRequest)
    async def bad_request(request: Request, exc: oai.BadRequest) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.code, exc.param)

    @app.exception_handler(Rejected)
    async def rejected(request: Request, exc: Rejected) -> JSONResponse:
        chat = request.url.path.endswith("/chat/completions")
        param = oai.openai_param(exc.param, chat) if request.url.path.startswith("/v1/") else exc.param
        message = exc.message
        if exc.param is not None and param is not None and message.startswith(f"sampling_params.{exc.param}:"):
            message = param + message[len(f"sampling_params.{exc.param}"):]
        return error_response(STATUS_OF_CODE.get(exc.code, 400), message, exc.code, param)

    @app.exception_handler(RequestFailed)
    async def failed(request: Request, exc: RequestFailed) -> JSONResponse:
        return error_response(STATUS_OF_CODE.get(exc.code, 500), exc.message, exc.code)

    @app.exception_handler(ClientWentAway)
    async def went_away(request: Request, exc: ClientWentAway) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": never read by anyone

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return error_response(500, f"{type(exc).__name__}: {exc}", "internal")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else "http")

    # ------------------------------------------------------------------ health and info

    @app.get("/health")
    async def health() -> Response:
        door = http.ready_door()
        if door.draining:
            return error_response(503, "the server is draining", "draining")
        reply = await door.local_control(HealthReq(rid="health"))
        if isinstance(reply, ErrorReply):
            return error_response(503, reply.message, reply.code)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        http.authorize(request)
        run = await http.start([GenerateReq(rid="health_generate", input_ids=[0],
                                            sampling_params={"max_new_tokens": 1, "temperature": 0})])
        try:
            async with abort_on_disconnect(request, run):
                async for _ in run.events():
                    pass
        except RequestFailed as exc:
            return error_response(503, exc.message, exc.code)
        finally:
            run.close()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        http.authorize(request)
        door = http.ready_door()
        return JSONResponse({"object": "list", "data": [{
            "id": http.model_name, "object": "model", "created": http.created, "owned_by": "tinyserve",
            "root": http.server_args.model_path, "max_model_len": door.context_len}]})

    async def control(request: Request, req: Any) -> dict[str, Any]:
        http.authorize(request)
        reply = await http.ready_door().local_control(req)
        if isinstance(reply, ErrorReply):
            raise RequestFailed(reply.code, reply.message)
        return reply.payload

    @app.get("/get_server_info")
    async def server_info(request: Request) -> JSONResponse:
        return JSONResponse(await control(request, ServerInfoReq(rid="server_info")))

    @app.post("/flush_cache")
    async def flush_cache(request: Request) -> JSONResponse:
        payload = await control(request, FlushCacheReq(rid="flush_cache"))
        return JSONResponse(payload, status_code=200 if payload.get("success") else 400)

    @app.post("/drain")
    async def drain(request: Request) -> JSONResponse:
        """Start the graceful drain (as the launcher's SIGTERM does): new requests are refused,
        those in flight finish (up to --graceful-shutdown-timeout), then the server exits 0."""
        http.authorize(request)
        started = http.ready_door().start_drain("POST /drain")
        return JSONResponse({"draining": True, "started_now": started,
                             "graceful_shutdown_timeout": http.server_args.graceful_shutdown_timeout})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        door_metrics = http.ready_door().metrics
        if door_metrics is None:
            raise oai.BadRequest("metrics are off; start the server with --enable-metrics", status=404,
                                 code="not_found")
        from prometheus_client import CONTENT_TYPE_LATEST

        door_metrics.set_scheduler_gauges(await control(request, ServerInfoReq(rid="metrics")))
        return Response(door_metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ generation

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        http.authorize(request)
        body: oai.NativeGenerateReq = await _body(request, oai.NativeGenerateReq, http.max_request_bytes)
        reqs, batch = body.generate_reqs()
        run = await http.start(reqs)
        if body.stream:
            return StreamingResponse(_native_stream(run), media_type="text/event-stream",
                                     background=BackgroundTask(run.close))
        results: list[list[dict[str, Any]]] = [[{} for _ in range(run.n)] for _ in reqs]
        try:
            async with abort_on_disconnect(request, run):
                async for i, chunk in run.events():
                    if chunk.finished:
                        results[i][chunk.meta.get("index", 0)] = _native_result(chunk)
        finally:
            run.close()
        flat = [r for per_prompt in results for r in per_prompt]
        return JSONResponse(flat if batch or run.n > 1 else flat[0])

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await openai_generate(request, oai.CompletionRequest, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await openai_generate(request, oai.ChatCompletionRequest, "chat")

    async def openai_generate(request: Request, schema: type[BaseModel], kind: reply_fmt.Kind) -> Response:
        http.authorize(request)
        body: Any = await _body(request, schema, http.max_request_bytes)
        http.check_model(body.model)
        assert http.logprobs is not None
        if kind == "chat":
            parsing = http.output_parsing(body)
            run = await http.start(body.generate_reqs(parsing.tools))
            reply = reply_fmt.OpenAIReply(kind, body, run.n, http.model_name, http.logprobs, parsing=parsing)
        else:
            run = await http.start(body.generate_reqs())
            reply = reply_fmt.OpenAIReply(kind, body, run.n, http.model_name, http.logprobs,
                                          prompts=http.prompt_texts(body) if body.echo else None)
        if body.stream:
            return StreamingResponse(_openai_stream(reply, run), media_type="text/event-stream",
                                     background=BackgroundTask(run.close))
        try:
            async with abort_on_disconnect(request, run):
                async for i, chunk in run.events():
                    reply.add(i, chunk)
        finally:
            run.close()
        return JSONResponse(reply.body())

    return app


def _native_result(chunk: GenerateChunk) -> dict[str, Any]:
    meta = dict(chunk.meta)
    meta.setdefault("finish_reason", chunk.finish_reason)
    if "latency" in meta:
        meta["e2e_latency"] = meta["latency"]
    meta["id"] = chunk.rid
    return {"text": chunk.text, "output_ids": chunk.output_ids, "meta_info": meta}


async def _native_stream(run: LocalRun) -> AsyncIterator[bytes]:
    """SGLang's stream: each event has the text so far, the new output ids and meta_info."""
    text: dict[int, str] = {}
    try:
        async for _, chunk in run.events():
            index = chunk.meta.get("index", 0)
            text[index] = text.get(index, "") + chunk.text
            out = _native_result(chunk)
            out["text"] = text[index]
            out["index"] = index
            yield sse(out)
    except RequestFailed as exc:
        yield sse({"error": {"message": exc.message, "code": exc.code}})
    finally:
        run.close()
    yield SSE_DONE


async def _openai_stream(reply: reply_fmt.OpenAIReply, run: LocalRun) -> AsyncIterator[bytes]:
    offsets: dict[int, int] = {}  # per choice: the text sent so far (completions' logprobs.text_offset)
    try:
        async for prompt_index, chunk in run.events():
            event = reply.event(prompt_index, chunk, offsets)
            if event is not None:
                yield sse(event)
        last = reply.usage_event()
        if last is not None:
            yield sse(last)
    except RequestFailed as exc:
        yield sse({"error": {"message": exc.message, "type": _ERROR_TYPE.get(STATUS_OF_CODE.get(exc.code, 500),
                                                                              "server_error"),
                             "param": None, "code": exc.code}})
    finally:
        run.close()
    yield SSE_DONE
