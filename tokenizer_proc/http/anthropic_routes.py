"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens, what Claude Code and the
official ``anthropic`` SDKs call (``ANTHROPIC_BASE_URL`` pointed at this server). The bodies are
translated onto the OpenAI chat request (tokenizer_proc/anthropic_protocol.py) and served by its
path; the replies, stream events and error bodies are Anthropic's (tokenizer_proc/anthropic_reply.py).
Errors answer in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, the HTTP
status kept); the key may come as ``x-api-key`` (Anthropic's clients) or a bearer token; the
``anthropic-version`` and ``anthropic-beta`` headers are accepted and not read."""

from __future__ import annotations

from typing import AsyncIterator

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.protocol.messages import GenerateChunk, GenerateReq, TokenizeReq
from tokenizer_proc.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_names,
    anthropic_wording,
)
from tokenizer_proc.anthropic_reply import MessageReply, MessageStream, anthropic_error, sse_event
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router
from tokenizer_proc.http.errors import STATUS_OF_CODE, RequestFailed
from tokenizer_proc.http.run import LocalRun
from tokenizer_proc.openai_reply import OutputParsing

router = api_router(error_shape=anthropic_error)


async def _read(
    request: Request, http: HttpContext, schema: type[CountTokensRequest]
) -> tuple[CountTokensRequest, OutputParsing, list[GenerateReq]]:
    """The body checked and translated: the request's output parsing and its GenerateReqs (a
    refusal on the way names the fields as the body did)."""
    http.authorize(request)
    body: CountTokensRequest = await read_body(request, schema, http.max_request_bytes)
    request.state.field_names = anthropic_names
    with anthropic_wording():
        chat = body.chat_request()
        parsing = http.output_parsing(chat)
        return body, parsing, chat.generate_reqs(parsing.tools)


@router.post("/v1/messages")
async def messages(request: Request, http: Http) -> Response:
    """A message, whole or streamed; any ``model`` name is served by the one model."""
    body, parsing, reqs = await _read(request, http, MessagesRequest)
    assert isinstance(body, MessagesRequest)
    # Claude Code asks for its model's whole output budget (tens of thousands of tokens): past the
    # context's room the reply stops for length (stop_reason max_tokens) rather than being refused.
    run = await http.start([msgspec.structs.replace(r, fit_max_tokens=True) for r in reqs])
    if body.stream:
        stream = MessageStream(parsing, http.model_name, body.stop_sequences)
        return StreamingResponse(
            _stream(stream, run), media_type="text/event-stream", background=BackgroundTask(run.close)
        )
    reply = MessageReply(parsing, http.model_name, body.stop_sequences)
    finished: list[GenerateChunk] = []
    await run.collect(request, lambda _, chunk: finished.append(chunk) if chunk.finished else None)
    return JSONResponse(reply.body(finished[-1]))  # collect ends only once the request has finished


async def _stream(stream: MessageStream, run: LocalRun) -> AsyncIterator[bytes]:
    """Anthropic's event stream; a failure after the first byte is an ``error`` event."""
    try:
        async for _, chunk in run.events():
            for event in stream.events(chunk):
                yield sse_event(event)
    except RequestFailed as exc:
        yield sse_event(stream.error(STATUS_OF_CODE.get(exc.code, 500), exc.message, exc.code))
    finally:
        run.close()


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request, http: Http) -> JSONResponse:
    """``{"input_tokens": N}``: the prompt the same body would be served, counted by the front door
    (the same template, messages, tools and template kwargs)."""
    _, _, reqs = await _read(request, http, CountTokensRequest)
    req = reqs[0]
    counted = await http.ready_door().tokenize(
        TokenizeReq(rid=req.rid, messages=req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs)
    )
    return JSONResponse({"input_tokens": counted["count"]})
