"""What the HTTP routes share: the flags, the front door (``FrontDoor``, once the tokenizer manager
exists) and the helpers every route group needs (readiness, the api key, the model name, starting
a ``LocalRun``). ``build_app`` stores one ``HttpContext`` on ``app.state``; a route receives it as
the typed dependency ``Http``, the FastAPI way, instead of closing over the server object, so
that the routes can live in their own modules (tokenizer_proc/http/*_routes.py).

Every route group is an ``api_router``: its dependency runs before any route of the group, says which
API's error shape the group answers in, and refuses every request with 503 (``Retry-After``) until the
server is ready, so that no route can reach a front door, a tokenizer or a formatter that is not there
yet (tests/unit/tokenizer_proc/test_http_readiness.py walks every route of the app)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from runtime.config.args import ServerArgs
from runtime.protocol.messages import GenerateReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc import openai_reply as reply_fmt
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.http.errors import ErrorShape, openai_error
from tokenizer_proc.http.run import LocalRun
from tokenizer_proc.request_builder import check_api_key


class HttpContext:
    """The state of the HTTP front door; ``attach`` makes it answer (until then, 503)."""

    def __init__(self, server_args: ServerArgs, max_request_bytes: int) -> None:
        self.server_args = server_args
        self.max_request_bytes = max_request_bytes  # a larger body is refused (413) before it is read
        self.model_name = server_args.served_model_name or server_args.resolved_model_path()
        self.door: FrontDoor | None = None
        self.logprobs: reply_fmt.LogprobFormatter | None = None
        self.created = reply_fmt.now()

    def attach(self, door: FrontDoor) -> None:
        """The tokenizer manager is ready: serve through it."""
        self.door = door
        self.logprobs = reply_fmt.LogprobFormatter(door.tokenizer)

    def ready_door(self) -> FrontDoor:
        """The front door, or 503 "starting" while the server loads (``/health`` included)."""
        if self.door is None:
            raise oai.BadRequest("the server is starting", status=503, code="starting")
        return self.door

    def authorize(self, request: Request) -> None:
        """Rejected (401) unless the request carries --api-key: as a bearer token (OpenAI's clients)
        or in ``x-api-key`` (Anthropic's)."""
        header = request.headers.get("authorization")
        key = header[7:].strip() if header is not None and header[:7].lower() == "bearer " else None
        check_api_key(self.server_args.api_key, key if key is not None else request.headers.get("x-api-key"))

    def check_model(self, model: str) -> None:
        """An OpenAI request names the served model (or --model-path as given), else 404."""
        if model not in (self.model_name, self.server_args.model_path):
            raise oai.BadRequest(
                f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                "model",
                status=404,
                code="model_not_found",
            )

    def adapter_of(self, model: str, lora_path: str | None) -> str | None:
        """The LoRA adapter an OpenAI request names: ``model`` as ``SERVED:ADAPTER`` (each adapter's id in
        /v1/models), or SGLang's extra field ``lora_path`` with the served model (None: the base model).
        Whether the adapter is loaded is the request builder's check (a 400 naming it)."""
        for served in (self.model_name, self.server_args.model_path):
            if served and model.startswith(served + ":"):
                named = model[len(served) + 1 :]
                if lora_path is not None and lora_path != named:
                    raise oai.BadRequest(f"model names adapter {named!r} and lora_path {lora_path!r}", "lora_path")
                return named
        self.check_model(model)
        return lora_path

    def output_parsing(self, body: oai.ChatCompletionRequest) -> reply_fmt.OutputParsing:
        """How a chat request's output is read: its tools against --tool-call-parser, its reasoning
        split by --reasoning-parser unless it asked to keep it inline (separate_reasoning false)."""
        args = self.server_args
        tools = body.tool_plan(args.tool_call_parser)
        return reply_fmt.OutputParsing(
            tools,
            args.tool_call_parser,
            args.reasoning_parser if body.separate_reasoning else None,
            body.enable_thinking,
            constrained=bool(tools.constraint) or body.constrained,
        )

    def prompt_texts(self, body: oai.CompletionRequest) -> list[str]:
        """Each prompt as text (``echo``): token-id prompts decoded."""
        prompts = (
            body.prompt
            if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int)
            else [body.prompt]
        )
        door = self.ready_door()
        return [p if isinstance(p, str) else str(door.tokenizer.decode(p)) for p in prompts]

    async def start(self, reqs: list[GenerateReq]) -> LocalRun:
        """Submit ``reqs`` as one local client; Rejected when one is refused."""
        run = LocalRun(self.ready_door(), reqs)
        await run.submit()
        return run


def http_context(request: Request) -> HttpContext:
    """The app's ``HttpContext`` (set by ``build_app``)."""
    context: HttpContext = request.app.state.http
    return context


# A route parameter ``http: Http`` receives the app's HttpContext.
Http = Annotated[HttpContext, Depends(http_context)]


def api_router(error_shape: ErrorShape = openai_error) -> APIRouter:
    """A route group of one API: its errors in ``error_shape``, and none of its routes run before the
    server is ready (503 "starting", with ``Retry-After``, in that shape)."""

    async def ready(request: Request) -> None:
        request.state.error_shape = error_shape
        http_context(request).ready_door()

    return APIRouter(dependencies=[Depends(ready)])
