"""The responses ``POST /v1/responses`` kept (``store``, on by default), for ``GET`` / ``DELETE
/v1/responses/{id}`` and for a later request's ``previous_response_id``.

Why in memory and bounded: the server keeps no state across restarts, and a client that never
deletes what it stored (every SDK call stores by default) must not grow the process without end.
The store keeps the most recently used ``--responses-store-size`` responses and forgets the least
recently used one beyond that (a lookup counts as a use: a conversation in progress stays). A
forgotten id answers 404, as OpenAI's does once a stored response expires.

Each entry is the Response object and the conversation it continued: the input items of every
response before it in its ``previous_response_id`` chain and its own (without ``instructions``,
which OpenAI does not carry over). The next request's conversation is that, then the entry's
output items, then its own input.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tokenizer_proc import openai_protocol as oai

DEFAULT_SIZE = 1000  # --responses-store-size


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the Response object as it was returned
    input_items: list[dict[str, Any]]  # the conversation before its output

    @property
    def conversation(self) -> list[dict[str, Any]]:
        """What a request continuing from this response sees first: its input, then its output."""
        return [*self.input_items, *self.body["output"]]


class ResponseStore:
    """Stored responses by id, least recently used forgotten first beyond ``size`` (0: none kept)."""

    def __init__(self, size: int = DEFAULT_SIZE) -> None:
        if size < 0:
            raise ValueError(f"a response store holds >= 0 responses, got {size}")
        self.size = size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return response_id in self._entries

    def put(self, body: dict[str, Any], input_items: list[dict[str, Any]]) -> None:
        """Keep ``body`` (under its ``id``) and the conversation before it."""
        if self.size == 0:
            return
        self._entries[body["id"]] = StoredResponse(body, input_items)
        self._entries.move_to_end(body["id"])
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, now the most recently used; 404 naming it when it is not stored
        (``param``: the request field that named it)."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise not_found(response_id, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        """Forget it; 404 when it is not stored."""
        if self._entries.pop(response_id, None) is None:
            raise not_found(response_id)


def not_found(response_id: str, param: str | None = None) -> oai.BadRequest:
    where = f" ({param})" if param else ""
    return oai.BadRequest(
        f"no response with id {response_id!r} is stored{where}: it was not stored (store false), "
        "was deleted, or was forgotten (--responses-store-size)",
        param,
        status=404,
        code="not_found",
    )
