"""Small string scanners shared by the tool-call and reasoning parsers.

Why a module of its own: both parsers stream, and streaming needs the same two answers
over and over: "could the text held so far be the start of a marker?" (so a partial
``<tool_`` or ``</thi`` is never sent before it is decided) and "where does the JSON value
starting here end?" (string-aware, so a ``}`` or a ``</tool_call>`` inside a JSON string
does not end a call early). Keeping them here keeps each parser module about its format.
"""

from __future__ import annotations

import re


def held_back_len(text: str, marker: str) -> int:
    """Length of the longest proper suffix of ``text`` that is a prefix of ``marker``.

    That many characters at the end of a stream's buffer must wait for the next fragment:
    they may turn out to be the marker. A complete marker is not counted (the caller has
    already looked for it with ``str.find``).
    """
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def skip_ws(text: str, pos: int) -> int:
    """Index of the first non-whitespace character of ``text`` at or after ``pos`` (or its length)."""
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    return pos


# The characters that matter to bracket matching, outside and inside a JSON string.
_OUTSIDE_STRING = re.compile(r'["{}\[\]]')
_INSIDE_STRING = re.compile(r'["\\]')

# Where a bracket scan stands: (next index, depth, inside a string, after a backslash).
_ScanState = tuple[int, int, bool, bool]


def _scan(text: str, state: _ScanState) -> tuple[int | None, _ScanState]:
    """Continue a bracket scan over ``text``: (index after the closing bracket or None, new state).

    Jumps from one significant character to the next with a regex, so long string values
    cost little.
    """
    i, depth, in_string, escaped = state
    n = len(text)
    while i < n:
        if escaped:
            escaped = False
            i += 1
        elif in_string:
            m = _INSIDE_STRING.search(text, i)
            if m is None:
                return None, (n, depth, True, False)
            i = m.start()
            if text[i] == "\\":
                escaped = True
            else:
                in_string = False
            i += 1
        else:
            m = _OUTSIDE_STRING.search(text, i)
            if m is None:
                return None, (n, depth, False, False)
            i = m.start()
            c = text[i]
            i += 1
            if c == '"':
                in_string = True
            elif c == "{" or c == "[":
                depth += 1
            else:
                depth -= 1
                if depth == 0:
                    return i, (i, 0, False, False)
    return None, (i, depth, in_string, escaped)


def json_value_end(text: str, pos: int) -> int | None:
    """Index just after the JSON object or array that opens at ``text[pos]`` (a ``{`` or ``[``).

    Brackets are counted outside JSON strings only (escapes honoured), so a ``}`` or a
    closing tag inside a string value is not mistaken for the end. ``None`` when the value is
    not closed within ``text``: a stream must wait for more, a whole output is malformed.
    Mismatched bracket kinds are not diagnosed here; ``json.loads`` rejects them afterwards.
    """
    return _scan(text, (pos, 0, False, False))[0]


class JsonEndFinder:
    """``json_value_end`` for a stream's growing buffer, resuming where the last look stopped.

    Why: a call is only complete when its last bracket arrives; rescanning the call from its
    start on every token would make a long call cost quadratic time. Valid while the buffer
    only grows at its end; ``reset`` when its head is consumed (positions shift).
    """

    def __init__(self) -> None:
        self._scans: dict[int, _ScanState] = {}
        self._ends: dict[int, int | None] = {}

    def reset(self) -> None:
        """Forget every scan: the buffer's positions have changed."""
        self._scans.clear()
        self._ends.clear()

    def find(self, text: str, pos: int) -> int | None:
        """As ``json_value_end(text, pos)``, for ``text`` that extends the last one seen."""
        end = self._ends.get(pos)
        if end is not None:
            return end
        end, state = _scan(text, self._scans.get(pos, (pos, 0, False, False)))
        self._scans[pos] = state
        if end is not None:
            self._ends[pos] = end
        return end
