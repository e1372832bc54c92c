"""Ollama's replies for ``/api/chat`` and ``/api/generate``: one JSON object, or an NDJSON stream (one
object a line: each new piece with ``done`` false, then one ``done`` true object with the counts and
timings), and Ollama's error body ``{"error": "..."}``.

The text goes through the OpenAI path's ``ChatChoice`` (tokenizer_proc/openai_reply.py), so that the
reasoning parser fills ``thinking`` and the tool-call parser ``tool_calls`` exactly as they fill
``reasoning_content`` and ``tool_calls`` there; whole and streamed give the same message. Ollama sends
a tool call whole (its ``arguments`` an object, not JSON text), so a stream holds a call back until
the next call starts or the reply ends.

The durations are measured (nanoseconds, as Ollama's): ``load_duration`` from the request's arrival to
its acceptance (reading, checking and tokenizing it: the model is always loaded), ``prompt_eval_duration``
from then to the first output, ``eval_duration`` from the first output to the last.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from typing import Any, Callable, Literal

import msgspec

from runtime.protocol.messages import GenerateChunk
from tokenizer_proc.openai_reply import ChatChoice, OutputParsing, finish_reason

Kind = Literal["chat", "generate"]
NDJSON = "application/x-ndjson"
_encode = msgspec.json.Encoder().encode


def ollama_error(status: int, message: str, code: str, param: str | None) -> dict[str, Any]:
    """Ollama's error body (``ErrorShape``): the message alone, which names the field itself."""
    return {"error": message}


def ndjson(obj: Any) -> bytes:
    """One line of an NDJSON stream."""
    return _encode(obj) + b"\n"


def rfc3339(at: float | None = None) -> str:
    """A time as Ollama writes it (RFC 3339, UTC, with a ``Z``); now when ``at`` is None."""
    moment = datetime.now(timezone.utc) if at is None else datetime.fromtimestamp(at, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


class Timing:
    """The four moments of one request, on a nanosecond clock (``clock``: injectable for tests)."""

    def __init__(self, clock: Callable[[], int] = time.perf_counter_ns) -> None:
        self.clock = clock
        self.arrived = clock()
        self.accepted: int | None = None
        self.first: int | None = None
        self.last: int | None = None

    def accept(self) -> None:
        """The request was accepted (validated, tokenized and queued)."""
        self.accepted = self.clock()

    def saw(self, chunk: GenerateChunk) -> None:
        now = self.clock()
        if self.first is None and (chunk.output_ids or chunk.text or chunk.finished):
            self.first = now
        if chunk.finished:
            self.last = now

    def durations(self) -> dict[str, int]:
        accepted = self.accepted if self.accepted is not None else self.arrived
        last = self.last if self.last is not None else self.clock()
        first = self.first if self.first is not None else last
        return {
            "total_duration": last - self.arrived,
            "load_duration": accepted - self.arrived,
            "prompt_eval_duration": first - accepted,
            "eval_duration": last - first,
        }


def ollama_calls(calls: list[tuple[str, str]], first_index: int = 0) -> tuple[list[dict[str, Any]], str]:
    """Parsed calls (name, arguments JSON text) as Ollama's ``tool_calls``; a call whose arguments are
    not a JSON object (cut short) is given back as text, since Ollama's clients read an object."""
    out: list[dict[str, Any]] = []
    text = ""
    for i, (name, arguments) in enumerate(calls, first_index):
        try:
            value = json.loads(arguments) if arguments else {}
        except ValueError:
            value = None
        if isinstance(value, dict):
            out.append({"function": {"index": i, "name": name, "arguments": value}})
        else:
            text += arguments
    return out, text


class _StreamedCalls:
    """A stream's tool-call deltas (OpenAI's shape, from ``ChatChoice.delta``) put back into whole
    calls: a call is whole once the next one starts, or the reply ends."""

    def __init__(self) -> None:
        self.open: dict[int, tuple[str, list[str]]] = {}

    def add(self, deltas: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
        whole: list[tuple[int, str, str]] = []
        for delta in deltas:
            index, function = delta["index"], delta["function"]
            if index not in self.open:
                whole += self._close(lambda i: i < index)
                self.open[index] = (function.get("name") or "", [])
            self.open[index][1].append(function.get("arguments") or "")
        return whole

    def finish(self) -> list[tuple[int, str, str]]:
        return self._close(lambda i: True)

    def _close(self, which: Callable[[int], bool]) -> list[tuple[int, str, str]]:
        done = sorted(i for i in self.open if which(i))
        return [(i, self.open[i][0], "".join(self.open.pop(i)[1])) for i in done]


class OllamaReply:
    """The reply of one ``/api/chat`` or ``/api/generate`` request (``model``: the name the client
    sent, which Ollama echoes)."""

    def __init__(self, kind: Kind, model: str, parsing: OutputParsing, timing: Timing) -> None:
        self.kind = kind
        self.model = model
        self.timing = timing
        self.choice = ChatChoice(parsing)
        self.pieces: list[str] = []
        self.calls = _StreamedCalls()
        self.last: GenerateChunk | None = None

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": rfc3339()}

    def _body(self, content: str, thinking: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """The text fields: ``message`` on a chat, ``response`` (+ ``thinking``) on a generate."""
        if self.kind == "generate":
            return {"response": content, **({"thinking": thinking} if thinking else {})}
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {"message": message}

    def _done(self) -> dict[str, Any]:
        """The final fields: why it stopped, the counts and the timings."""
        assert self.last is not None
        meta = self.last.meta
        return {
            "done": True,
            "done_reason": finish_reason(self.last) or "stop",
            **self.timing.durations(),
            "prompt_eval_count": meta.prompt_tokens or 0,
            "eval_count": meta.completion_tokens or 0,
        }

    # ------------------------------------------------------------------ one body

    def add(self, chunk: GenerateChunk) -> None:
        """One streamed chunk of the request (the server always streams: the timings need it)."""
        self.timing.saw(chunk)
        self.pieces.append(chunk.text)
        if chunk.finished:
            self.last = chunk

    def body(self) -> dict[str, Any]:
        """The whole reply, once the last chunk was added."""
        message = self.choice.message("".join(self.pieces))
        content = message["content"] or ""
        calls, text = ollama_calls(
            [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        )
        return {
            **self._head(),
            **self._body(content + text, message.get("reasoning_content") or "", calls),
            **self._done(),
        }

    # ------------------------------------------------------------------ stream

    def stream_objects(self, chunk: GenerateChunk) -> list[dict[str, Any]]:
        """The stream's objects for one chunk: a piece (``done`` false) when it has something to
        show, and after the last chunk the ``done`` object."""
        self.timing.saw(chunk)
        delta = self.choice.delta(chunk.text, chunk.finished)
        whole = self.calls.add(delta.get("tool_calls", []))
        if chunk.finished:
            whole += self.calls.finish()
            self.last = chunk
        calls: list[dict[str, Any]] = []
        content = delta.get("content", "")
        for index, name, arguments in whole:
            found, text = ollama_calls([(name, arguments)], index)
            calls += found
            content += text
        thinking = delta.get("reasoning_content", "")
        out = []
        if content or thinking or calls:
            out.append({**self._head(), **self._body(content, thinking, calls), "done": False})
        if chunk.finished:
            out.append({**self._head(), **self._body("", "", []), **self._done()})
        return out


def load_reply(kind: Kind, model: str) -> dict[str, Any]:
    """Ollama's answer to a request with nothing to generate from (its "load the model" call): the
    model is loaded for the server's whole life, so it is loaded now."""
    text: dict[str, Any] = {"response": ""} if kind == "generate" else {"message": {"role": "assistant", "content": ""}}
    return {"model": model, "created_at": rfc3339(), **text, "done": True, "done_reason": "load"}
