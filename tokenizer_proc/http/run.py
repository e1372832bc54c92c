"""One HTTP request's generation as a *local client* of the front door (``FrontDoor.open_local``):
its requests are submitted, its chunks read back, and whatever is left aborted when the reply is
done or the HTTP client goes away, so that an abandoned request frees its KV. Also the SSE framing
its streams are written in. Both generation route groups (OpenAI and native) run requests this way."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse

from runtime.protocol.messages import ErrorReply, GenerateChunk, GenerateReq
from tokenizer_proc.front_door import FrontDoor
from tokenizer_proc.http.errors import ClientWentAway, RequestFailed
from tokenizer_proc.rejected import Rejected

SSE_DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.Encoder().encode


class FastJSONResponse(JSONResponse):
    """A JSON reply rendered by msgspec: an embedding reply is hundreds of thousands of floats, which
    the standard library's encoder took a fifth of the front door's time to write (256 MiniLM vectors)."""

    def render(self, content: Any) -> bytes:
        return _encode(content)


def sse(obj: Any) -> bytes:
    """One server-sent event holding ``obj`` as JSON."""
    return b"data: " + _encode(obj) + b"\n\n"


class LocalRun:
    """The requests of one HTTP request, as one local client of the front door."""

    def __init__(self, door: FrontDoor, reqs: list[GenerateReq]) -> None:
        self.door = door
        self.reqs = reqs
        self.identity, self.queue = door.open_local()
        self.prompt_index = {r.rid: i for i, r in enumerate(reqs)}
        self.n = 1  # samples per prompt (the requests share their sampling params)

    async def submit(self, where: Callable[[int], str] | None = None) -> None:
        """Validate and send every request; Rejected (and nothing left running) when one fails, its
        message led by ``where(i)`` for the ``i``-th request when given (``input[3]: ...``: which input
        of a batch was refused)."""
        try:
            samples = []
            for i, req in enumerate(self.reqs):
                try:
                    samples.append(await self.door.submit_local(self.identity, req))
                except Rejected as exc:
                    if where is None:
                        raise
                    raise Rejected(exc.code, (f"{where(i)}: ", *exc.parts), exc.param) from None
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

    async def collect(self, request: Request, take: Callable[[int, GenerateChunk], None]) -> None:
        """A whole (non-stream) reply's run: each (prompt index, chunk) to ``take`` until every sample
        has finished; aborted (ClientWentAway) if the HTTP client goes away first; closed either way.
        Every API's non-stream route reads its run this way."""
        try:
            async with abort_on_disconnect(request, self):
                async for prompt_index, chunk in self.events():
                    take(prompt_index, chunk)
        finally:
            self.close()

    def disconnected(self) -> None:
        """The client went away: abort, and wake ``events`` with ClientWentAway."""
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
