"""``GenerateCall`` (what ``AsyncClient.generate`` returns) and the shapes of its results."""

from __future__ import annotations

from typing import Any, AsyncGenerator, Awaitable, Callable, Generator

from runtime.protocol.messages import GenerateChunk, GenerateReq


def chunk_dict(chunk: GenerateChunk) -> dict[str, Any]:
    return {
        "rid": chunk.rid,
        "text": chunk.text,
        "output_ids": chunk.output_ids,
        "finished": chunk.finished,
        "finish_reason": chunk.finish_reason,
        "meta": chunk.meta.as_dict(),
        "index": chunk.meta.index or 0,
    }


def result_dict(chunk: GenerateChunk) -> dict[str, Any]:
    return {"rid": chunk.rid, "text": chunk.text, "output_ids": chunk.output_ids, "meta": chunk.meta.as_dict()}


def is_batch(prompt: Any, input_ids: Any, messages: Any) -> bool:
    if prompt is not None:
        return isinstance(prompt, (list, tuple))
    if input_ids is not None:
        return bool(input_ids) and isinstance(input_ids[0], (list, tuple))
    if messages is not None:
        return bool(messages) and isinstance(messages[0], (list, tuple))
    return False


class GenerateCall:
    """What ``AsyncClient.generate`` returns: awaitable (the result) and, when
    streaming, async-iterable (the chunks). Nothing is sent until it is used.

    The client hands over how to run the requests (``run``: the whole result) and, for a
    stream, how to stream them (``stream``: the chunks); this module knows no client."""

    def __init__(
        self,
        reqs: list[GenerateReq],
        *,
        run: Callable[[], Awaitable[Any]],
        stream: Callable[[], AsyncGenerator[dict[str, Any], None]] | None,
    ) -> None:
        self._reqs = reqs
        self._run = run
        self._stream = stream

    @property
    def rids(self) -> list[str]:
        return [r.rid for r in self._reqs]

    def __await__(self) -> Generator[Any, None, Any]:
        if self._stream is not None:
            return self._as_iterator().__await__()
        return self._run().__await__()

    async def _as_iterator(self) -> AsyncGenerator[dict[str, Any], None]:
        return self.__aiter__()

    def __aiter__(self) -> AsyncGenerator[dict[str, Any], None]:
        if self._stream is None:
            raise TypeError("iterate only a stream=True call; await the others")
        return self._stream()
