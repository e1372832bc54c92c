"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

The body becomes a chat completions request (tokenizer_proc/responses_protocol.py) and runs on
the chat path; the Response object and its stream's typed events are built by
tokenizer_proc/responses_reply.py; stored responses (``store``, ``previous_response_id``) live in
the app's ``ResponseStore`` (tokenizer_proc/response_store.py, ``--responses-store-size``). These
routes only connect them. Errors are OpenAI's (``{"error": {...}}``), naming this API's fields.
"""

from __future__ import annotations

from typing import Annotated, Any, AsyncIterator, Callable

import msgspec
from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router, http_context
from tokenizer_proc.http.errors import RequestFailed
from tokenizer_proc.http.run import LocalRun
from tokenizer_proc.response_store import ResponseStore
from tokenizer_proc.responses_protocol import ResponsesRequest, responses_errors, responses_names
from tokenizer_proc.responses_reply import Event, ResponsesReply

router = api_router()
_encode = msgspec.json.Encoder().encode


def response_store(request: Request) -> ResponseStore:
    """The app's store, made on first use with --responses-store-size."""
    store: ResponseStore | None = getattr(request.app.state, "responses", None)
    if store is None:
        store = request.app.state.responses = ResponseStore(http_context(request).server_args.responses_store_size)
    return store


# A route parameter ``store: Store`` receives the app's ResponseStore.
Store = Annotated[ResponseStore, Depends(response_store)]


def typed_sse(event: Event) -> bytes:
    """One server-sent event named by its type, as the Responses API streams them."""
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


@router.post("/v1/responses")
async def create_response(request: Request, http: Http, store: Store) -> Response:
    http.authorize(request)
    body: ResponsesRequest = await read_body(request, ResponsesRequest, http.max_request_bytes)
    request.state.field_names = responses_names()  # a refusal of the request path names this API's fields
    adapter = http.adapter_of(body.model, None)  # (an adapter is a model "SERVED:ADAPTER" here too)
    earlier = (
        store.get(body.previous_response_id, "previous_response_id").conversation if body.previous_response_id else []
    )
    items = [*earlier, *body.input_items()]
    chat = body.chat_request(items)
    chat.lora_path = adapter
    with responses_errors():
        parsing = http.output_parsing(chat)
        reqs = chat.generate_reqs(parsing.tools)
    run = await http.start(reqs)
    reply = ResponsesReply(body.echoed(), http.model_name, parsing, _token_counter(http))
    own_items = items[len(earlier) :]
    kept = [*earlier, *own_items] if body.store else None
    if body.stream:
        return StreamingResponse(
            _stream(reply, run, store, kept), media_type="text/event-stream", background=BackgroundTask(run.close)
        )
    await run.collect(request, lambda _, chunk: reply.add(chunk))
    result = reply.body()
    if kept is not None:
        store.put(result, kept)
    return JSONResponse(result)


async def _stream(
    reply: ResponsesReply, run: LocalRun, store: ResponseStore, kept: list[dict[str, Any]] | None
) -> AsyncIterator[bytes]:
    """The typed events; the finished response is stored (when asked) before its last event is
    sent, so that a client may continue from it as soon as it has read it. A failure after the
    first byte can only be a ``response.failed`` event."""
    try:
        for event in reply.opening_events():
            yield typed_sse(event)
        async for _, chunk in run.events():
            events = reply.feed(chunk)
            if chunk.finished and kept is not None:
                store.put(reply.body(), kept)
            for event in events:
                yield typed_sse(event)
    except RequestFailed as exc:
        for event in reply.failed(exc.code, exc.message):
            yield typed_sse(event)
    finally:
        run.close()


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str, http: Http, store: Store) -> JSONResponse:
    http.authorize(request)
    return JSONResponse(store.get(response_id).body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str, http: Http, store: Store) -> JSONResponse:
    http.authorize(request)
    store.delete(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


def _token_counter(http: HttpContext) -> Callable[[str], int]:
    """The served tokenizer's count of a text (the reasoning's tokens of the usage)."""
    tokenizer = http.ready_door().tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    return count
