"""Ollama's API, so that Ollama's clients and the apps built on them (its Python and JS libraries, chat
UIs with an "Ollama URL" setting) drive this server unchanged: ``POST /api/chat`` and ``/api/generate``
(whole, or NDJSON streams: Ollama streams unless ``"stream": false``), ``GET /api/tags``, ``POST
/api/show``, ``GET /api/ps``, ``GET /api/version`` and ``HEAD /`` (Ollama's liveness probe).

The bodies become OpenAI chat requests (tokenizer_proc/ollama_protocol.py) and run as those do; the
replies are tokenizer_proc/ollama_reply.py, the model's description tokenizer_proc/ollama_models.py.
Errors are Ollama's ``{"error": "..."}`` with the HTTP status; an error after a stream's first line is
its last line. With --api-key every route but ``/api/version`` and ``HEAD /`` needs it (``Authorization:
Bearer``; Ollama's clients send none unless given headers or ``OLLAMA_API_KEY``).

On an embedding server (``--is-embedding``): ``POST /api/embed`` and its older form ``/api/embeddings``,
each input one embedding request of the shared path (tokenizer_proc/http/embedding_run.py); a generation
server answers them 501, as Ollama's clients read a route that is not served.

Not served: the model store (pull, push, create, copy, delete, blobs: the server serves the model it was
started with); each answers 501 saying so."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.config.version import package_version
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.embedding_model import EmbeddingModel
from tokenizer_proc.http import embedding_run
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router
from tokenizer_proc.http.errors import RequestFailed
from tokenizer_proc.http.run import FastJSONResponse, LocalRun
from tokenizer_proc.ollama_models import ModelFacts, model_facts
from tokenizer_proc.ollama_protocol import (
    ChatBody,
    EmbedBody,
    EmbeddingsBody,
    GenerateBody,
    ShowBody,
    embed_req,
    names_model,
    not_found,
    ollama_name,
    ollama_names,
    raw_prompt,
)
from tokenizer_proc.ollama_reply import NDJSON, OllamaReply, Timing, load_reply, ndjson, ollama_error, rfc3339

router = api_router(error_shape=ollama_error)

# The Ollama release whose API these routes follow (``think``, streamed tool calls): clients compare
# ``/api/version`` with the release that brought a feature before they use it.
OLLAMA_API_VERSION = "0.9.0"
# A loaded model never expires here (Ollama's ``keep_alive`` is accepted, not needed).
NEVER = "9999-12-31T23:59:59Z"
_NOT_SERVED = "tinyserve serves the one model it was started with (--model-path); it has no model store"


@router.head("/")
async def alive() -> Response:
    """Ollama's liveness probe (its clients send ``HEAD /`` before anything else); ``GET /`` stays the chat page."""
    return Response(status_code=200)


@router.get("/api/version")
async def version() -> JSONResponse:
    """No key needed: a client checks the version before it is configured (as ``/health``)."""
    return JSONResponse({"version": OLLAMA_API_VERSION, "tinyserve_version": package_version()})


@router.post("/api/chat")
async def chat(request: Request, http: Http) -> Response:
    timing = Timing()
    http.authorize(request)
    body: ChatBody = await read_body(request, ChatBody, http.max_request_bytes)
    request.state.field_names = ollama_names(chat=True)
    _check_model(http, body.model)
    if not body.messages:
        return JSONResponse(load_reply("chat", body.model))
    chat_body = body.openai_request(http.server_args.reasoning_parser)
    parsing = http.output_parsing(chat_body)
    run = await http.start(chat_body.generate_reqs(parsing.tools))
    timing.accept()
    return await _reply(request, run, OllamaReply("chat", body.model, parsing, timing), body.stream)


@router.post("/api/generate")
async def generate(request: Request, http: Http) -> Response:
    timing = Timing()
    http.authorize(request)
    body: GenerateBody = await read_body(request, GenerateBody, http.max_request_bytes)
    request.state.field_names = ollama_names(chat=False)
    _check_model(http, body.model)
    if body.loads_only:
        return JSONResponse(load_reply("generate", body.model))
    chat_body, raw = body.openai_request(http.server_args.reasoning_parser)
    parsing = http.output_parsing(chat_body)
    reqs = chat_body.generate_reqs(parsing.tools)
    if raw is not None:  # the prompt as text: no template, no tools
        reqs = [raw_prompt(r, raw) for r in reqs]
    run = await http.start(reqs)
    timing.accept()
    return await _reply(request, run, OllamaReply("generate", body.model, parsing, timing), body.stream)


@router.get("/api/tags")
async def tags(request: Request, http: Http) -> JSONResponse:
    """The served model, as Ollama lists the models it has."""
    http.authorize(request)
    facts = _facts(http)
    return JSONResponse({"models": [{**_listing(http, facts), "modified_at": rfc3339(facts.modified_at)}]})


@router.post("/api/show")
async def show(request: Request, http: Http) -> JSONResponse:
    http.authorize(request)
    body: ShowBody = await read_body(request, ShowBody, http.max_request_bytes)
    _check_model(http, body.model_name)
    door = http.ready_door()
    facts = _facts(http)
    info = door.model_info()
    defaults = info.get("effective_sampling_params") or {}
    args = http.server_args
    parameters = "\n".join(f"{_OLLAMA_PARAMETER.get(k, k)} {v}" for k, v in sorted(defaults.items()))
    capabilities = [
        "completion",
        *(["tools"] if args.tool_call_parser else []),
        *(["thinking"] if args.reasoning_parser else []),
    ]
    return JSONResponse(
        {
            "modelfile": f"# served by tinyserve {package_version()}\nFROM {info.get('model_path') or args.model_path}\n"
            + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
            "parameters": parameters,
            "template": str(getattr(door.tokenizer, "chat_template", None) or ""),
            "details": facts.details(),
            "model_info": facts.model_info(door.context_len),
            "capabilities": capabilities,
            "modified_at": rfc3339(facts.modified_at),
        }
    )


@router.get("/api/ps")
async def ps(request: Request, http: Http) -> JSONResponse:
    """The loaded model (always the served one); ``size_vram`` is not measured here: 0."""
    http.authorize(request)
    listing = _listing(http, _facts(http))
    return JSONResponse(
        {"models": [{**listing, "expires_at": NEVER, "size_vram": 0, "context_length": http.ready_door().context_len}]}
    )


@router.post("/api/embed")
async def embed(request: Request, http: Http) -> FastJSONResponse:
    """Ollama's embeddings on an embedding server (--is-embedding): ``embeddings`` in input order."""
    timing = Timing()
    http.authorize(request)
    body: EmbedBody = await read_body(request, EmbedBody, http.max_request_bytes)
    _check_model(http, body.model)
    model = _embedder(http)
    embedding_run.check_dimensions(model, body.dimensions)
    request.state.field_names = lambda ref: _EMBED_NAMES.get(ref.name, ref.name)
    reqs = body.generate_reqs()
    batch = isinstance(body.input, list)
    chunks = await embedding_run.run_all(request, http, reqs, (lambda i: f"input[{i}]") if batch else None)
    timing.accept()  # (the load: none here; the durations below are the whole call's)
    vectors = [embedding_run.cut(model, embedding_run.vector(c), body.dimensions) for c in chunks]
    durations = timing.durations()
    return FastJSONResponse(
        {
            "model": body.model,
            "embeddings": vectors,
            "total_duration": durations["total_duration"],
            "load_duration": 0,
            "prompt_eval_count": embedding_run.prompt_tokens(chunks),
        }
    )


@router.post("/api/embeddings")
async def embeddings(request: Request, http: Http) -> FastJSONResponse:
    """Ollama's older embeddings route: one prompt, ``{"embedding": [...]}``."""
    http.authorize(request)
    body: EmbeddingsBody = await read_body(request, EmbeddingsBody, http.max_request_bytes)
    _check_model(http, body.model)
    _embedder(http)
    if not body.prompt:
        return FastJSONResponse({"embedding": []})
    request.state.field_names = lambda ref: "prompt" if ref.name in ("text", "prompt") else ref.name
    (chunk,) = await embedding_run.run_all(request, http, [embed_req(body.prompt)], None)
    return FastJSONResponse({"embedding": embedding_run.vector(chunk)})


# A refusal of an embedding input, in Ollama's names.
_EMBED_NAMES = {"text": "input", "prompt": "input", "truncate_prompt_tokens": "truncate"}


def _embedder(http: HttpContext) -> EmbeddingModel:
    """The embedding model; a generation server answers 501 as Ollama's routes do for what is not
    served, and a cross-encoder has no vectors (400)."""
    model = http.ready_door().embedding
    if model is None:
        raise oai.BadRequest(
            "embeddings are not served: this server generates text; start one with --is-embedding and an "
            "embedding model to embed",
            status=501,
            code="not_implemented",
        )
    if model.classifier:
        raise oai.BadRequest(embedding_run.CROSS_ENCODER_HAS_NO_VECTORS, "model")
    return model


@router.post("/api/pull")
@router.post("/api/push")
@router.post("/api/create")
@router.post("/api/copy")
@router.delete("/api/delete")
@router.post("/api/blobs/{digest}")
@router.head("/api/blobs/{digest}")
async def model_store(request: Request, http: Http) -> Response:
    http.authorize(request)
    raise oai.BadRequest(f"{request.url.path} is not supported: {_NOT_SERVED}", status=501, code="not_implemented")


# Sampling defaults as Ollama's Modelfile names them.
_OLLAMA_PARAMETER = {"repetition_penalty": "repeat_penalty", "max_new_tokens": "num_predict"}


def _check_model(http: HttpContext, model: str) -> None:
    if not names_model(model, http.model_name, http.server_args.model_path):
        raise not_found(model)


def _listing(http: HttpContext, facts: ModelFacts) -> dict[str, Any]:
    """What /api/tags and /api/ps say of the served model alike."""
    name = ollama_name(http.model_name)
    return {"name": name, "model": name, "size": facts.size, "digest": facts.digest, "details": facts.details()}


def _facts(http: HttpContext) -> ModelFacts:
    """The served checkpoint's facts (the folder a weight update moved to, if one did)."""
    folder = http.ready_door().model_info().get("model_path") or http.server_args.resolved_model_path()
    return model_facts(str(folder))


async def _reply(request: Request, run: LocalRun, reply: OllamaReply, stream: bool) -> Response:
    """The reply whole, or as an NDJSON stream; the run is closed either way (a client that went away
    has its request aborted)."""
    if stream:
        return StreamingResponse(_stream(reply, run), media_type=NDJSON, background=BackgroundTask(run.close))
    await run.collect(request, lambda _, chunk: reply.add(chunk))
    return JSONResponse(reply.body())


async def _stream(reply: OllamaReply, run: LocalRun) -> AsyncIterator[bytes]:
    """One line per piece, then the ``done`` line; a failure after the first line is an ``error`` line."""
    try:
        async for _, chunk in run.events():
            for obj in reply.stream_objects(chunk):
                yield ndjson(obj)
    except RequestFailed as exc:
        yield ndjson({"error": exc.message})
    finally:
        run.close()
