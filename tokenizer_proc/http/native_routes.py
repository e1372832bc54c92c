"""SGLang's native generation route, POST /generate: SGLang's body in (tokenizer_proc/native_protocol.py)
and SGLang's reply out (tokenizer_proc/native_reply.py): text, output_ids and meta_info per sample, a
list for a batch or n > 1; whole, or as server-sent events each holding everything so far."""

from __future__ import annotations

from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from runtime.protocol.messages import GenerateChunk
from tokenizer_proc.http.body import read_body
from tokenizer_proc.http.context import Http, HttpContext, api_router
from tokenizer_proc.http.errors import RequestFailed
from tokenizer_proc.http.run import SSE_DONE, LocalRun, sse
from tokenizer_proc.native_protocol import NativeGenerateReq
from tokenizer_proc.native_reply import NativeReplies, SampleSoFar

router = api_router()


@router.post("/generate")
async def generate(request: Request, http: Http) -> Response:
    http.authorize(request)
    body: NativeGenerateReq = await read_body(request, NativeGenerateReq, http.max_request_bytes)
    reqs, batch = body.generate_reqs()
    replies = _replies(http, body, reqs)
    run = await http.start(reqs)
    if body.stream:
        return StreamingResponse(
            _native_stream(run, replies), media_type="text/event-stream", background=BackgroundTask(run.close)
        )
    results: list[list[dict[str, Any]]] = [[{} for _ in range(run.n)] for _ in reqs]

    def take(i: int, chunk: GenerateChunk) -> None:
        if chunk.finished:
            sample = SampleSoFar()
            sample.add(chunk)
            results[i][chunk.meta.index or 0] = replies.result(chunk, sample)

    await run.collect(request, take)
    flat = [r for per_prompt in results for r in per_prompt]
    return JSONResponse(flat if batch or run.n > 1 else flat[0])


def _replies(http: HttpContext, body: NativeGenerateReq, reqs: list[Any]) -> NativeReplies:
    door = http.ready_door()
    assert http.logprobs is not None  # set with the door
    return NativeReplies(reqs, http.logprobs.token, body.return_text_in_logprobs, door.weight_version)


async def _native_stream(run: LocalRun, replies: NativeReplies) -> AsyncIterator[bytes]:
    """SGLang's stream: each event has the text, output ids and logprobs so far, and meta_info."""
    samples: dict[tuple[int, int], SampleSoFar] = {}
    try:
        async for i, chunk in run.events():
            index = chunk.meta.index or 0
            sample = samples.setdefault((i, index), SampleSoFar())
            sample.add(chunk)
            out = replies.result(chunk, sample)
            out["index"] = index
            yield sse(out)
    except RequestFailed as exc:
        yield sse({"error": {"message": exc.message, "code": exc.code}})
    finally:
        run.close()
    yield SSE_DONE
