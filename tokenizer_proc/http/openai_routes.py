"""The OpenAI-compatible routes: GET /v1/models, POST /v1/completions and /v1/chat/completions.
The request bodies become ``GenerateReq``s (tokenizer_proc/openai_protocol.py); the replies and
stream events are built by tokenizer_proc/openai_reply.py. These routes only connect the two."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.background import BackgroundTask

from tokenizer_proc import openai_protocol as oai
from tokenizer_proc import openai_reply as reply_fmt
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router
from tokenizer_proc.http.errors import STATUS_OF_CODE, RequestFailed, error_type
from tokenizer_proc.http.run import SSE_DONE, LocalRun, sse

router = api_router()


@router.get("/v1/models")
async def models(request: Request, http: Http) -> JSONResponse:
    """The served model, and each LoRA adapter loaded as a model ``SERVED:ADAPTER`` (its parent the base)."""
    http.authorize(request)
    door = http.ready_door()
    base = {
        "id": http.model_name,
        "object": "model",
        "created": http.created,
        "owned_by": "tinyserve",
        "root": http.server_args.model_path,
        "parent": None,
        "max_model_len": door.context_len,
    }
    adapters = door.lora.adapters.values() if door.lora is not None else ()
    data = [base] + [
        {**base, "id": f"{http.model_name}:{a['name']}", "root": a["path"], "parent": http.model_name} for a in adapters
    ]
    return JSONResponse({"object": "list", "data": data})


@router.post("/v1/completions")
async def completions(request: Request, http: Http) -> Response:
    return await _openai_generate(http, request, oai.CompletionRequest, "completion")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, http: Http) -> Response:
    return await _openai_generate(http, request, oai.ChatCompletionRequest, "chat")


async def _openai_generate(
    http: HttpContext, request: Request, schema: type[BaseModel], kind: reply_fmt.Kind
) -> Response:
    """Both generation routes: read and check the body, run it, reply whole or as a stream."""
    http.authorize(request)
    body: Any = await read_body(request, schema, http.max_request_bytes)
    request.state.field_names = oai.openai_names(kind == "chat", body)  # a refusal names this body's fields
    body.lora_path = http.adapter_of(body.model, body.lora_path)
    assert http.logprobs is not None
    if kind == "chat":
        parsing = http.output_parsing(body)
        run = await http.start(body.generate_reqs(parsing.tools))
        reply = reply_fmt.OpenAIReply(kind, body, run.n, http.model_name, http.logprobs, parsing=parsing)
    else:
        run = await http.start(body.generate_reqs())
        reply = reply_fmt.OpenAIReply(
            kind, body, run.n, http.model_name, http.logprobs, prompts=http.prompt_texts(body) if body.echo else None
        )
    if body.stream:
        return StreamingResponse(
            _openai_stream(reply, run), media_type="text/event-stream", background=BackgroundTask(run.close)
        )
    await run.collect(request, reply.add)
    return JSONResponse(reply.body())


async def _openai_stream(reply: reply_fmt.OpenAIReply, run: LocalRun) -> AsyncIterator[bytes]:
    """OpenAI's stream: one event per new piece of a choice, the usage last, then [DONE]; a
    failure after the first byte can only be an error event."""
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
        yield sse(
            {
                "error": {
                    "message": exc.message,
                    "type": error_type(STATUS_OF_CODE.get(exc.code, 500)),
                    "param": None,
                    "code": exc.code,
                }
            }
        )
    finally:
        run.close()
    yield SSE_DONE
