"""OpenAI's Responses API replies: the Response object (``POST /v1/responses``, ``GET
/v1/responses/{id}``) and the typed events of its stream.

A response's ``output`` is a list of items: a ``reasoning`` item (what ``--reasoning-parser``
split off, as a summary and as content), a ``message`` item (the text), ``function_call`` items
(what the tool-call parser or a required / named ``tool_choice`` produced). The text goes through
the chat path's ``ChatChoice`` (tokenizer_proc/openai_reply.py), which runs those parsers; its
deltas (reasoning, content, calls) become items here.

One code path builds both forms: a whole reply is its finished text fed as a single delta, a
stream feeds the pieces as they come, and every event is made as the items change. So a stream
ends with the same items as the whole reply of the same request, and a stream that the SDK's
``client.responses.stream`` helper reassembles equals what ``responses.create`` returns.

The stream's events, in order (each with ``type`` and an increasing ``sequence_number``):
``response.created``, ``response.in_progress``; per item ``response.output_item.added``, its parts
(``response.content_part.added``, ``response.reasoning_summary_part.added``), its deltas
(``response.output_text.delta``, ``response.reasoning_text.delta`` with
``response.reasoning_summary_text.delta``, ``response.function_call_arguments.delta``), their
``.done`` events and ``response.output_item.done``; last ``response.completed`` or
``response.incomplete`` (``max_output_tokens`` reached), or ``response.failed``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Literal

from runtime.protocol.messages import GenerateChunk
from tokenizer_proc import openai_reply as reply_fmt
from tokenizer_proc.openai_reply import ChatChoice, OutputParsing

# Server error codes that mean "too busy now, retry later" (tokenizer_proc/http/errors.py's 429 and 503s).
_RATE_LIMITED = frozenset({"too_many_requests", "overloaded", "out_of_memory", "draining"})
ItemKind = Literal["reasoning", "message", "function_call"]
Event = dict[str, Any]


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``resp_``, ``msg_``, ``fc_``, ``rs_`` and hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """One output item while it is written and after."""

    kind: ItemKind
    id: str
    text: str = ""  # the reasoning, the message's text or the call's arguments
    call_id: str | None = None
    name: str | None = None
    status: str = "in_progress"

    def as_dict(self) -> dict[str, Any]:
        if self.kind == "reasoning":
            summary = [{"type": "summary_text", "text": self.text}] if self.status != "in_progress" else []
            content = [{"type": "reasoning_text", "text": self.text}] if self.status != "in_progress" else []
            return {"type": "reasoning", "id": self.id, "summary": summary, "content": content, "status": self.status}
        if self.kind == "message":
            parts = [_text_part(self.text)] if self.status != "in_progress" else []
            return {"type": "message", "id": self.id, "role": "assistant", "status": self.status, "content": parts}
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text,
            "status": self.status,
        }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


@dataclass
class _Outcome:
    """How the response stands: its status and what the Response object says of it."""

    status: str = "in_progress"
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    completed_at: int | None = None
    usage: dict[str, Any] | None = None


class ResponsesReply:
    """One response: its output items, built from the chat choice's deltas, as the Response object
    (``body``) or as stream events (``opening_events``, ``feed``, ``failed``).

    ``echoed``: the request fields the Response repeats (``ResponsesRequest.echoed``);
    ``count_tokens``: the tokenizer's count of a text, for ``output_tokens_details.reasoning_tokens``."""

    def __init__(
        self,
        echoed: dict[str, Any],
        model: str,
        parsing: OutputParsing,
        count_tokens: Callable[[str], int] | None = None,
    ) -> None:
        self.id = new_id("resp")
        self.created_at = reply_fmt.now()
        self.echoed = echoed
        self.model = model
        self.choice = ChatChoice(parsing)
        self.count_tokens = count_tokens
        self.usage = reply_fmt.Usage()
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # the chat delta's call index -> its item
        self.outcome = _Outcome()
        self.sequence = 0

    # ------------------------------------------------------------------ the Response object

    def snapshot(self) -> dict[str, Any]:
        """The Response object as it stands (in progress, finished, or failed)."""
        output = [item.as_dict() for item in self.items]
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.outcome.status,
            "error": self.outcome.error,
            "incomplete_details": self.outcome.incomplete_details,
            "model": self.model,
            "output": output,
            "output_text": "".join(p["text"] for o in output if o["type"] == "message" for p in o["content"]),
            "usage": self.outcome.usage,
            "completed_at": self.outcome.completed_at,
            **self.echoed,
        }

    def add(self, chunk: GenerateChunk) -> None:
        """A whole reply's chunk (not streamed: the finished one carries the whole text)."""
        if chunk.finished:
            self.feed(chunk)
        else:
            self.usage.add(0, chunk)

    def body(self) -> dict[str, Any]:
        return self.snapshot()

    # ------------------------------------------------------------------ stream

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def opening_events(self) -> list[Event]:
        """``response.created`` and ``response.in_progress``: the response with no output yet."""
        return [
            self._event("response.created", response=self.snapshot()),
            self._event("response.in_progress", response=self.snapshot()),
        ]

    def feed(self, chunk: GenerateChunk) -> list[Event]:
        """The events of one streamed piece of text (the last one ends the response)."""
        self.usage.add(0, chunk)
        delta = self.choice.delta(chunk.text, chunk.finished)
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            events += self._content(delta["content"])
        for call in delta.get("tool_calls", ()):
            events += self._call(call)
        if chunk.finished:
            events += self._finish(chunk)
        return events

    def failed(self, code: str, message: str) -> list[Event]:
        """The response failed after its stream began: the open item closed, ``response.failed`` with the error, its code one
        of OpenAI's (the SDK's ``ResponseError`` knows no other), the server's own in the message."""
        events = self._close("incomplete")  # the item being written keeps what it had
        kind = "rate_limit_exceeded" if code in _RATE_LIMITED else "server_error"
        self.outcome = _Outcome("failed", error={"code": kind, "message": f"{code}: {message}"})
        return [*events, self._event("response.failed", response=self.snapshot())]

    # ------------------------------------------------------------------ items

    def _start(self, item: _Item) -> list[Event]:
        """Close the open item, open ``item``: its added event and its (empty) parts."""
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        at = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=at, item=item.as_dict()))
        if item.kind == "message":
            events.append(self._part_event("response.content_part.added", item, _text_part("")))
        elif item.kind == "reasoning":
            events.append(self._summary_event("response.reasoning_summary_part.added", item, part=_summary("")))
            events.append(self._part_event("response.content_part.added", item, _reasoning_part("")))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        at = self.items.index(item)
        events: list[Event] = []
        if item.kind == "message":
            events.append(self._part_event("response.output_text.done", item, None, text=item.text, logprobs=[]))
            events.append(self._part_event("response.content_part.done", item, _text_part(item.text)))
        elif item.kind == "reasoning":
            events.append(self._part_event("response.reasoning_text.done", item, None, text=item.text))
            events.append(self._part_event("response.content_part.done", item, _reasoning_part(item.text)))
            events.append(self._summary_event("response.reasoning_summary_text.done", item, text=item.text))
            events.append(self._summary_event("response.reasoning_summary_part.done", item, part=_summary(item.text)))
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=at,
                    name=item.name,
                    arguments=item.text,
                )
            )
        events.append(self._event("response.output_item.done", output_index=at, item=item.as_dict()))
        return events

    def _part_event(self, kind: str, item: _Item, part: dict[str, Any] | None, **fields: Any) -> Event:
        at = self.items.index(item)
        extra = {} if part is None else {"part": part}
        return self._event(kind, item_id=item.id, output_index=at, content_index=0, **extra, **fields)

    def _summary_event(self, kind: str, item: _Item, **fields: Any) -> Event:
        return self._event(kind, item_id=item.id, output_index=self.items.index(item), summary_index=0, **fields)

    def _reasoning(self, text: str) -> list[Event]:
        events = (
            []
            if self.open is not None and self.open.kind == "reasoning"
            else self._start(_Item("reasoning", new_id("rs")))
        )
        item = self.open
        assert item is not None
        item.text += text
        events.append(self._summary_event("response.reasoning_summary_text.delta", item, delta=text))
        events.append(self._part_event("response.reasoning_text.delta", item, None, delta=text))
        return events

    def _content(self, text: str) -> list[Event]:
        events = (
            []
            if self.open is not None and self.open.kind == "message"
            else self._start(_Item("message", new_id("msg")))
        )
        item = self.open
        assert item is not None
        item.text += text
        events.append(self._part_event("response.output_text.delta", item, None, delta=text, logprobs=[]))
        return events

    def _call(self, call: dict[str, Any]) -> list[Event]:
        """A chat call delta: the first of a call carries its id and name, later ones more arguments."""
        function = call.get("function", {})
        events: list[Event] = []
        if "id" in call:
            item = _Item("function_call", new_id("fc"), call_id=call["id"], name=function.get("name"))
            events += self._start(item)
            self.calls[call["index"]] = item
        item = self.calls[call["index"]]
        arguments = function.get("arguments") or ""
        if arguments:
            item.text += arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=self.items.index(item),
                    delta=arguments,
                )
            )
        return events

    def _finish(self, chunk: GenerateChunk) -> list[Event]:
        """The last item closed (an empty message when there is no text and no call), the usage,
        and ``response.completed`` or ``response.incomplete``."""
        reason = chunk.finish_reason or {}
        kind = reason.get("type", "stop")
        status = "completed" if kind == "stop" else "incomplete"
        events = self._close(status)
        if not any(item.kind in ("message", "function_call") for item in self.items):
            events += self._start(_Item("message", new_id("msg")))
            events += self._close(status)
        details = None
        if status == "incomplete":
            details = {"reason": "max_output_tokens" if kind == "length" else str(reason.get("message") or kind)}
        self.outcome = _Outcome(status, details, completed_at=reply_fmt.now(), usage=self._usage())
        final = "response.completed" if status == "completed" else "response.incomplete"
        events.append(self._event(final, response=self.snapshot()))
        return events

    def _usage(self) -> dict[str, Any]:
        counts = self.usage.as_dict()
        output = counts["completion_tokens"]
        reasoning = "".join(item.text for item in self.items if item.kind == "reasoning")
        thought = min(self.count_tokens(reasoning), output) if reasoning and self.count_tokens is not None else 0
        return {
            "input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": counts["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": counts["total_tokens"],
        }


def _summary(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}
