"""SGLang's native generation route, POST /generate: SGLang's body (``NativeGenerateReq``) in, and
SGLang's reply out (text, output_ids, meta_info per sample; a list for a batch or n > 1), whole or
as a stream of server-sent events with the text so far."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.protocol.messages import GenerateChunk
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http
from tokenizer_proc.http.errors import RequestFailed
from tokenizer_proc.http.run import SSE_DONE, LocalRun, abort_on_disconnect, sse

router = APIRouter()


@router.post("/generate")
async def generate(request: Request, http: Http) -> Response:
    http.authorize(request)
    body: oai.NativeGenerateReq = await read_body(request, oai.NativeGenerateReq, http.max_request_bytes)
    reqs, batch = body.generate_reqs()
    run = await http.start(reqs)
    if body.stream:
        return StreamingResponse(
            _native_stream(run), media_type="text/event-stream", background=BackgroundTask(run.close)
        )
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


def _native_result(chunk: GenerateChunk) -> dict[str, Any]:
    """One sample's reply: SGLang's meta_info names (e2e_latency, id) beside ours."""
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
