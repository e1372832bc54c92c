"""bench.serving's HTTP backend: OpenAI ``/v1/completions`` requests with token-id prompts.

A small asyncio client on h11 (the HTTP/1.1 state machine uvicorn already depends on),
one connection per request as sglang.bench_serving's aiohttp client opens them: the
benchmark shares the CPU with the server, so the client should cost as little as the
ZMQ one does (the openai SDK builds a pydantic object per stream event).

A stream asks for ``stream_options.include_usage`` so that the token count comes from
the server, whatever ``--stream-interval`` groups into one event. Other OpenAI-compatible
servers (llama.cpp's ``llama-server``, bench/llamacpp_baseline.py) take the same requests;
``extra_body`` adds the fields only they read, and a usage without ``prompt_tokens_details``
counts no cached tokens. A request on a LoRA adapter names it as OpenAI clients do, with the model
``SERVED:ADAPTER`` (each adapter's id in ``/v1/models``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator
from urllib.parse import urlsplit

import h11

if TYPE_CHECKING:
    from bench.load_runner import RequestRecord


@dataclass
class Event:
    """One stream event: a chunk of tokens (``choice``), or the final usage."""

    choice: bool
    completion_tokens: int = 0
    cached_tokens: int = 0


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} [{code}] {message}")
        self.status = status
        self.code = code


class CompletionsClient:
    """POST /v1/completions for bench requests (greedy, exactly ``max_new_tokens`` tokens)."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, extra_body: dict[str, Any] | None = None
    ) -> None:
        parts = urlsplit(base_url)
        self.extra_body = dict(extra_body or {})
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.model = model
        self.headers = [("Host", parts.netloc), ("Content-Type", "application/json")]
        if api_key is not None:
            self.headers.append(("Authorization", f"Bearer {api_key}"))

    def body(self, input_ids: list[int], max_new_tokens: int, stream: bool, adapter: str | None = None) -> bytes:
        """The request's JSON; ``adapter``: the LoRA adapter it runs on (None: the base model)."""
        body: dict[str, Any] = {
            "model": self.model if adapter is None else f"{self.model}:{adapter}",
            "prompt": input_ids,
            "max_tokens": max_new_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": stream,
            **self.extra_body,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return json.dumps(body).encode()

    async def _post(self, body: bytes) -> AsyncIterator[bytes]:
        """The response body's pieces as they arrive; HttpError for a status other than 200."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        conn = h11.Connection(h11.CLIENT)
        try:
            writer.write(
                conn.send(
                    h11.Request(
                        method="POST",
                        target="/v1/completions",
                        headers=[*self.headers, ("Content-Length", str(len(body)))],
                    )
                )
            )
            writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            status, error = 0, b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(await reader.read(65536))
                elif isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    if status == 200:
                        yield bytes(event.data)
                    else:
                        error += bytes(event.data)
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            if status != 200:
                err = json.loads(error or b"{}").get("error", {})
                raise HttpError(status, str(err.get("code", status)), str(err.get("message", "")))
        finally:
            writer.close()

    async def stream(
        self, input_ids: list[int], max_new_tokens: int, adapter: str | None = None
    ) -> AsyncIterator[Event]:
        buf = b""
        async for piece in self._post(self.body(input_ids, max_new_tokens, stream=True, adapter=adapter)):
            buf += piece
            while b"\n\n" in buf:
                line, buf = buf.split(b"\n\n", 1)
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise HttpError(200, str(data["error"].get("code")), str(data["error"].get("message")))
                if data["choices"]:
                    yield Event(choice=True)
                if data.get("usage"):
                    usage = data["usage"]
                    yield Event(
                        choice=False, completion_tokens=usage["completion_tokens"], cached_tokens=_cached_tokens(usage)
                    )

    async def complete(self, input_ids: list[int], max_new_tokens: int, adapter: str | None = None) -> Event:
        body = self.body(input_ids, max_new_tokens, stream=False, adapter=adapter)
        raw = b"".join([piece async for piece in self._post(body)])
        usage = json.loads(raw)["usage"]
        return Event(choice=False, completion_tokens=usage["completion_tokens"], cached_tokens=_cached_tokens(usage))


def _cached_tokens(usage: dict[str, Any]) -> int:
    """The usage's cached prompt tokens (0 where the server does not report them)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


async def send(
    client: CompletionsClient,
    input_ids: list[int],
    max_new_tokens: int,
    stream: bool,
    rec: RequestRecord,
    start: float,
    adapter: str | None = None,
) -> None:
    """One bench request (on LoRA adapter ``adapter``, None: the base); fills ``rec`` as the ZMQ path
    does: TTFT at the first token event, a gap per later event, token counts from the usage."""
    if not stream:
        done = await client.complete(input_ids, max_new_tokens, adapter)
        rec.output_len, rec.cached_tokens = done.completion_tokens, done.cached_tokens
        return
    last = start
    async for event in client.stream(input_ids, max_new_tokens, adapter):
        now = time.perf_counter()
        if event.choice:
            if rec.ttft is None:
                rec.ttft = now - start
            else:
                rec.itl.append(now - last)
            last = now
        else:  # the usage event after the last chunk
            rec.output_len, rec.cached_tokens = event.completion_tokens, event.cached_tokens
