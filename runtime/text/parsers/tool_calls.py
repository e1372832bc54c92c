"""Tool-call parsers: split a model's output into content and OpenAI ``tool_calls``.

Why: the chat endpoint offers ``tools``, the model answers with calls written in its own
format (Hermes/Qwen ``<tool_call>`` blocks, Llama 3 bare JSON, Mistral ``[TOOL_CALLS]``),
and the client expects ``message.tool_calls`` (or, streamed, ``delta.tool_calls``) with the
remaining text as ``content``.

One design serves the whole reply and the stream alike, so the two can never disagree: a
format only writes ``_step(buf, at_end)``, which decides what the text at the head of the
buffer is (content, a call, or a malformed call that is content after all) or answers
"not decided yet". With ``at_end=False`` it may decide only what no later text could
change; with ``at_end=True`` (the whole output, or ``finish``) it must decide everything.
``parse`` runs the steps over the whole text at once, ``feed``/``finish`` run them as the
text arrives; the tests cut every canned output at every offset to hold this.

A call is emitted only once it is complete, so a malformed or unknown call can still go
back to being content verbatim. Whitespace-only content in a reply with calls (the
newlines around ``<tool_call>`` blocks) is dropped; a reply without calls keeps its text
exactly.
"""

from __future__ import annotations

import json
import logging
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Collection, Final

from runtime.text.parsers._text import JsonEndFinder, held_back_len, skip_ws

logger = logging.getLogger(__name__)


@dataclass
class ToolCall:
    """One parsed call: the tool's name and the JSON text of its arguments object."""

    name: str
    arguments: str


@dataclass
class ToolCallDelta:
    """OpenAI's streaming shape for (part of) one call of this reply.

    ``name`` is set on a call's first delta only; ``arguments`` fragments concatenate to the
    call's arguments JSON text.
    """

    index: int
    name: str | None = None
    arguments: str = ""


class _Malformed:
    """Marker type: the call at the head of the buffer is not a call (it is content)."""


_MALFORMED: Final = _Malformed()
_INVALID_JSON: Final = object()

# What ``_step`` answers: (characters consumed, content text, calls), or None = not decided yet.
_Step = tuple[int, str, list[ToolCall]]


def _load_json(text: str) -> object:
    """``json.loads``, or ``_INVALID_JSON`` for text that does not parse (never raises)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID_JSON


def _content_step(buf: str, marker: str, at_end: bool) -> _Step | None:
    """Content up to the next ``marker`` (the caller has checked ``buf`` does not start with it).

    While streaming, a tail of ``buf`` that could be the start of the marker is held back.
    """
    i = buf.find(marker)
    if i == -1:
        i = len(buf) if at_end else len(buf) - held_back_len(buf, marker)
    if i == 0:
        return None
    return i, buf[:i], []


def _marked_step(
    buf: str, marker: str, at_end: bool, read: Callable[[str, bool], tuple[int, list[ToolCall]] | _Malformed | None]
) -> _Step | None:
    """A format whose calls follow a marker: content up to the marker, then the calls ``read``
    finds at the head of ``buf``. When they are malformed only the marker becomes content; the
    rest follows as ordinary content, so the text ends up verbatim."""
    if not buf.startswith(marker):
        return _content_step(buf, marker, at_end)
    found = read(buf, at_end)
    if found is None:
        return None
    if isinstance(found, _Malformed):
        logger.debug("malformed %s call kept as content", marker)
        return len(marker), marker, []
    consumed, calls = found
    return consumed, "", calls


class ToolCallParser(ABC):
    """Base of the formats: the content/call bookkeeping shared by ``parse`` and streaming.

    A parser instance serves one reply: ``feed`` its text fragments, then ``finish`` once.
    ``parse`` does not touch the instance's stream state.
    """

    name: ClassVar[str]
    # False when the format's markers are special tokens the detokenizer would otherwise
    # drop: the detokenizer must keep them for the parser to see them.
    skip_special_tokens: ClassVar[bool] = True

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        """``tool_names``: the tools offered; a call to another name is content. None: any name."""
        self.tool_names: frozenset[str] | None = None if tool_names is None else frozenset(tool_names)
        self._buf = ""
        self._calls_sent = 0
        # Whitespace at the start of the current content run (since the last call), held back
        # until a non-space shows the run is real content, or a call shows it is not.
        self._held_ws = ""
        self._run_has_text = False
        self._json_end = JsonEndFinder()  # for the formats: where a JSON value in ``_buf`` ends

    # -- public API ------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Whole output -> (content, calls)."""
        whole = type(self)(self.tool_names)
        return whole._advance(text, at_end=True)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        """Next text fragment -> (content now safe to send, deltas of the calls now complete)."""
        content, calls = self._advance(delta, at_end=False)
        return content, self._deltas(calls)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of stream: decide and flush whatever was held back."""
        content, calls = self._advance("", at_end=True)
        return content, self._deltas(calls)

    # -- for the formats -------------------------------------------------------------

    @abstractmethod
    def _step(self, buf: str, at_end: bool) -> _Step | None:
        """Decide the head of ``buf``: (consumed, content, calls), or None while undecided.

        Must consume at least one character when it answers, and must answer whenever
        ``at_end`` is true and ``buf`` is not empty.
        """

    def _make_call(self, obj: object) -> ToolCall | None:
        """A ``ToolCall`` from a decoded ``{"name": ..., "arguments": {...}}``, or None if it is not one.

        ``parameters`` (Llama's key) is accepted for ``arguments``; missing arguments are ``{}``.
        """
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None
        if self.tool_names is not None and name not in self.tool_names:
            logger.debug("%s: call to unknown tool %r kept as content", self.name, name)
            return None
        args: object = {}
        for key in ("arguments", "parameters"):
            if key in obj:
                args = obj[key]
                break
        if not isinstance(args, dict):
            return None
        return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))

    # -- bookkeeping -----------------------------------------------------------------

    def _advance(self, text: str, at_end: bool) -> tuple[str, list[ToolCall]]:
        """Append ``text`` and run the format's steps until it waits: (content, calls) decided."""
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while self._buf:
            step = self._step(self._buf, at_end)
            if step is None:
                break
            consumed, step_text, step_calls = step
            if consumed <= 0:
                raise AssertionError(f"{type(self).__name__}._step consumed nothing")
            self._buf = self._buf[consumed:]
            self._json_end.reset()
            if step_text:
                self._add_content(step_text, out)
            if step_calls:
                calls.extend(step_calls)
                self._calls_sent += len(step_calls)
                self._held_ws = ""  # whitespace-only content before a call is dropped
                self._run_has_text = False
        if at_end:
            if self._buf:
                raise AssertionError(f"{type(self).__name__}._step left text undecided at the end")
            if self._calls_sent == 0:
                out.append(self._held_ws)  # no calls: the reply keeps its text verbatim
            self._held_ws = ""
        return "".join(out), calls

    def _add_content(self, text: str, out: list[str]) -> None:
        """Send ``text`` as content, holding a run's whitespace-only start (a call may follow)."""
        if self._run_has_text:
            out.append(text)
            return
        self._held_ws += text
        if not self._held_ws.isspace():
            out.append(self._held_ws)
            self._held_ws = ""
            self._run_has_text = True

    def _deltas(self, calls: list[ToolCall]) -> list[ToolCallDelta]:
        """OpenAI's stream shape: per call, a delta naming it, then one with all its arguments."""
        deltas: list[ToolCallDelta] = []
        first = self._calls_sent - len(calls)
        for i, call in enumerate(calls):
            deltas.append(ToolCallDelta(index=first + i, name=call.name))
            deltas.append(ToolCallDelta(index=first + i, arguments=call.arguments))
        return deltas


class HermesToolCallParser(ToolCallParser):
    """Hermes / Qwen 2.5 / Qwen 3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

    Any number of blocks, with content before, between and after them. The closing tag is
    optional at the very end (models often stop at EOS right after the JSON).
    """

    name = "hermes"
    OPEN: ClassVar[str] = "<tool_call>"
    CLOSE: ClassVar[str] = "</tool_call>"

    def _step(self, buf: str, at_end: bool) -> _Step | None:
        return _marked_step(buf, self.OPEN, at_end, self._block)

    def _block(self, buf: str, at_end: bool) -> tuple[int, list[ToolCall]] | _Malformed | None:
        """The block at the head of ``buf`` (which starts with ``OPEN``)."""
        pos = skip_ws(buf, len(self.OPEN))
        if pos == len(buf):
            return _MALFORMED if at_end else None
        if buf[pos] != "{":
            return _MALFORMED
        end = self._json_end.find(buf, pos)
        if end is None:
            return _MALFORMED if at_end else None
        after = skip_ws(buf, end)
        tail = buf[after:]
        if tail.startswith(self.CLOSE):
            consumed = after + len(self.CLOSE)
        elif not at_end and self.CLOSE.startswith(tail):
            return None  # the closing tag (or EOS) may still come
        elif at_end and not tail:
            consumed = len(buf)  # unterminated at EOS: the JSON alone decides
        else:
            return _MALFORMED
        call = self._make_call(_load_json(buf[pos:end]))
        if call is None:
            return _MALFORMED
        return consumed, [call]


class Llama3ToolCallParser(ToolCallParser):
    """Llama 3.x JSON calls: ``{"name": ..., "parameters": {...}}``, ``;``-separated.

    Optionally after ``<|python_tag|>``. It is a call only when the whole output (after
    leading whitespace and the tag) is such calls; otherwise the whole output is content.
    That can only be known at the end, so a stream holds everything that could still be
    calls until it ends (or until a character shows it is content).
    """

    name = "llama3"
    skip_special_tokens = False
    TAG: ClassVar[str] = "<|python_tag|>"

    def __init__(self, tool_names: Collection[str] | None = None) -> None:
        super().__init__(tool_names)
        self._is_content = False

    def _step(self, buf: str, at_end: bool) -> _Step | None:
        if self._is_content:
            return len(buf), buf, []
        verdict = self._judge(buf, at_end)
        if verdict is None:
            return None
        if isinstance(verdict, _Malformed):
            self._is_content = True
            return len(buf), buf, []
        return len(buf), "", verdict

    def _judge(self, buf: str, at_end: bool) -> list[ToolCall] | _Malformed | None:
        """Calls, content (``_MALFORMED``), or None while the output could still be either."""
        pos = skip_ws(buf, 0)
        rest = buf[pos:]
        if rest.startswith(self.TAG):
            pos += len(self.TAG)
        elif self.TAG.startswith(rest):
            return _MALFORMED if at_end else None
        calls: list[ToolCall] = []
        while True:
            pos = skip_ws(buf, pos)
            if pos == len(buf):
                if not at_end:
                    return None
                return calls if calls else _MALFORMED
            if buf[pos] != "{":
                return _MALFORMED
            end = self._json_end.find(buf, pos)
            if end is None:
                return _MALFORMED if at_end else None
            call = self._make_call(_load_json(buf[pos:end]))
            if call is None:
                return _MALFORMED
            calls.append(call)
            pos = skip_ws(buf, end)
            if pos == len(buf):
                return calls if at_end else None
            if buf[pos] != ";":
                return _MALFORMED
            pos += 1


class MistralToolCallParser(ToolCallParser):
    """Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

    Also the newer ``[TOOL_CALLS]name[ARGS]{...}`` form (one call per marker). Content before
    the marker is content; a marker not followed by valid calls is content verbatim.
    """

    name = "mistral"
    skip_special_tokens = False
    MARKER: ClassVar[str] = "[TOOL_CALLS]"
    ARGS: ClassVar[str] = "[ARGS]"
    _NAME: ClassVar[re.Pattern[str]] = re.compile(r"[A-Za-z0-9_.\-]+")

    def _step(self, buf: str, at_end: bool) -> _Step | None:
        return _marked_step(buf, self.MARKER, at_end, self._calls)

    def _calls(self, buf: str, at_end: bool) -> tuple[int, list[ToolCall]] | _Malformed | None:
        """The calls after the marker at the head of ``buf``."""
        pos = skip_ws(buf, len(self.MARKER))
        if pos == len(buf):
            return _MALFORMED if at_end else None
        if buf[pos] in "[{":
            end = self._json_end.find(buf, pos)
            if end is None:
                return _MALFORMED if at_end else None
            value = _load_json(buf[pos:end])
            items = value if isinstance(value, list) else [value]
            calls = [self._make_call(item) for item in items]
            if not calls or any(call is None for call in calls):
                return _MALFORMED
            return end, [call for call in calls if call is not None]
        match = self._NAME.match(buf, pos)
        if match is None:
            return _MALFORMED
        tail = buf[match.end() :]
        if not tail.startswith(self.ARGS):
            return None if not at_end and self.ARGS.startswith(tail) else _MALFORMED
        pos = skip_ws(buf, match.end() + len(self.ARGS))
        if pos == len(buf):
            return _MALFORMED if at_end else None
        if buf[pos] != "{":
            return _MALFORMED
        end = self._json_end.find(buf, pos)
        if end is None:
            return _MALFORMED if at_end else None
        call = self._make_call({"name": match.group(), "arguments": _load_json(buf[pos:end])})
        if call is None:
            return _MALFORMED
        return end, [call]


TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "qwen": HermesToolCallParser,
    "qwen25": HermesToolCallParser,
    "qwen3": HermesToolCallParser,
    "llama3": Llama3ToolCallParser,
    "llama": Llama3ToolCallParser,
    "mistral": MistralToolCallParser,
}


def make_tool_call_parser(name: str, tool_names: Collection[str] | None = None) -> ToolCallParser:
    """A fresh parser for one reply; ``ValueError`` naming the choices for an unknown ``name``."""
    try:
        cls = TOOL_CALL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(TOOL_CALL_PARSERS))}"
        ) from None
    return cls(tool_names)
