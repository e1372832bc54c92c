"""Anthropic's Messages API replies: the whole ``message``, the events of its stream, and its error body.

The text is read by the OpenAI chat path's ``ChatChoice`` (tokenizer_proc/openai_reply.py): the
reasoning parser splits the thinking off, the tool-call parser (or a constrained ``any`` / named
tool choice) reads the calls; here they only change shape. A message's ``content`` is its blocks
in the order they were written: ``thinking`` (``signature`` empty: nothing here signs), ``text``,
then one ``tool_use`` per call (``input`` the arguments as an object).

A stream is Anthropic's event sequence, each event as ``event: <type>`` and ``data: <json>``:
``message_start`` (the message with empty content and the prompt's usage), one ``ping``, then per
block ``content_block_start``, its ``content_block_delta``s (``thinking_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``, indices in order and a block opened only once its
first piece has come, then ``message_delta`` (the stop reason and the output's usage) and
``message_stop``. ``message_start`` waits for the first output, which carries the prompt's counts.

Usage follows Anthropic's arithmetic: ``input_tokens`` are the prompt tokens that were computed,
``cache_read_input_tokens`` those found in the prefix cache; their sum is the prompt
(``count_tokens``). Nothing is written to a cache on request, so ``cache_creation_input_tokens`` is 0.

A generation that was aborted (its deadline passed, the server stopped it) has no Anthropic stop
reason: it is an error, 504 ``timeout_error`` for a deadline, else 500 ``api_error``; in a stream,
an ``error`` event after what was already sent.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import msgspec

from runtime.protocol.messages import ChunkMeta, GenerateChunk
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.openai_reply import ChatChoice, OutputParsing

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_encode = msgspec.json.Encoder().encode


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status (``api_error`` for any other)."""
    return _ERROR_TYPES.get(status, "api_error")


def anthropic_error(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """Anthropic's error body (the Anthropic routes' ``ErrorShape``). It has no field for the
    offending parameter, so the message names it."""
    if param is not None and param not in message:
        message = f"{param}: {message}"
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event of Anthropic's stream: its ``type`` is the event's name."""
    return b"event: " + event["type"].encode() + b"\ndata: " + _encode(event) + b"\n\n"


def aborted(chunk: GenerateChunk) -> oai.BadRequest | None:
    """The error a finished chunk stands for, if it was aborted (see the module docstring)."""
    reason = chunk.finish_reason or {}
    if reason.get("type") != "abort":
        return None
    why = str(reason.get("message") or "aborted")
    if why == "timeout":
        return oai.BadRequest(
            "the request passed its deadline (timeout / deadline_s, or the server's --request-timeout) and was aborted",
            status=504,
            code="timeout",
        )
    return oai.BadRequest(f"the generation was aborted: {why}", status=500, code="aborted")


def tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


class MessageReply:
    """One ``/v1/messages`` reply: ``body`` for a whole one; ``MessageStream`` for a stream."""

    def __init__(self, parsing: OutputParsing, model: str, stop_sequences: list[str] | None) -> None:
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.model = model
        self.stop_sequences = list(stop_sequences or [])
        self.choice = ChatChoice(parsing)
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0

    def count(self, meta: ChunkMeta) -> None:
        """The counts so far (each chunk carries its request's)."""
        if meta.prompt_tokens is not None:
            self.prompt_tokens = meta.prompt_tokens
        if meta.cached_tokens is not None:
            self.cached_tokens = meta.cached_tokens
        if meta.completion_tokens is not None:
            self.output_tokens = meta.completion_tokens

    def usage(self) -> dict[str, Any]:
        return {
            "input_tokens": self.prompt_tokens - self.cached_tokens,
            "output_tokens": self.output_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.cached_tokens,
        }

    def stop_reason(self, chunk: GenerateChunk) -> tuple[str, str | None]:
        """(``stop_reason``, ``stop_sequence``) of a finished (not aborted) chunk."""
        reason = chunk.finish_reason or {}
        if reason.get("type") == "length":
            return "max_tokens", None
        if self.choice.has_calls:
            return "tool_use", None
        matched = reason.get("matched")
        if isinstance(matched, str) and matched in self.stop_sequences:
            return "stop_sequence", matched
        return "end_turn", None

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self.usage(),
        }

    def body(self, chunk: GenerateChunk) -> dict[str, Any]:
        """The whole message of the finished chunk; raises the error of an aborted one."""
        self.count(chunk.meta)
        error = aborted(chunk)
        if error is not None:
            raise error
        parsed = self.choice.message(chunk.text)
        content: list[dict[str, Any]] = []
        if parsed.get("reasoning_content"):
            content.append({"type": "thinking", "thinking": parsed["reasoning_content"], "signature": ""})
        if parsed.get("content"):
            content.append({"type": "text", "text": parsed["content"]})
        for call in parsed.get("tool_calls") or []:
            function = call["function"]
            content.append(
                {
                    "type": "tool_use",
                    "id": tool_use_id(),
                    "name": function["name"],
                    "input": json.loads(function["arguments"]),
                }
            )
        return self.message(content, self.stop_reason(chunk))


class MessageStream(MessageReply):
    """The events of a streamed reply, chunk by chunk (see the module docstring)."""

    def __init__(self, parsing: OutputParsing, model: str, stop_sequences: list[str] | None) -> None:
        super().__init__(parsing, model, stop_sequences)
        self.started = False
        self.index = -1  # the open block's index (-1: none yet)
        self.open: str | None = None  # the open block's type

    def events(self, chunk: GenerateChunk) -> list[dict[str, Any]]:
        """The events one chunk makes (none while a parser holds its text back)."""
        self.count(chunk.meta)
        out: list[dict[str, Any]] = []
        if not self.started:
            self.started = True
            out.append({"type": "message_start", "message": self.message([], (None, None))})
            out.append({"type": "ping"})
        delta = self.choice.delta(chunk.text, chunk.finished)
        if delta.get("reasoning_content"):
            out += self._piece("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            out += self._piece("text", {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            function = call["function"]
            if "id" in call:  # a new call: its own block
                out += self._close()
                self.index += 1
                self.open = "tool_use"
                block = {"type": "tool_use", "id": tool_use_id(), "name": function["name"], "input": {}}
                out.append({"type": "content_block_start", "index": self.index, "content_block": block})
            if function.get("arguments"):
                out.append(
                    {
                        "type": "content_block_delta",
                        "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": function["arguments"]},
                    }
                )
        if chunk.finished:
            error = aborted(chunk)
            if error is not None:
                out.append(self.error(error.status, error.message, error.code))
                return out
            out += self._close()
            reason, sequence = self.stop_reason(chunk)
            out.append(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self.usage(),
                }
            )
            out.append({"type": "message_stop"})
        return out

    def _piece(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A piece of a text or thinking block: the block opened first unless it is the open one."""
        out: list[dict[str, Any]] = []
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            out.append({"type": "content_block_start", "index": self.index, "content_block": block})
        out.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return out

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    @staticmethod
    def error(status: int, message: str, code: str) -> dict[str, Any]:
        """The ``error`` event of a failure after the stream's 200 went out."""
        return anthropic_error(status, message, code, None)
