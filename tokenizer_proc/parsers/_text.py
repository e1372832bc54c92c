"""Small string scanners shared by the tool-call and reasoning parsers.

Why a module of its own: both parsers stream, and streaming needs the same two answers
over and over: "could the text held so far be the start of a marker?" (so a partial
``<tool_`` or ``</thi`` is never sent before it is decided) and "where does the JSON value
starting here end?" (string-aware, so a ``}`` or a ``</tool_call>`` inside a JSON string
does not end a call early). Keeping them here keeps each parser module about its format.
"""

from __future__ import annotations


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


def json_value_end(text: str, pos: int) -> int | None:
    """Index just after the JSON object or array that opens at ``text[pos]`` (a ``{`` or ``[``).

    Brackets are counted outside JSON strings only (escapes honoured), so a ``}`` or a
    closing tag inside a string value is not mistaken for the end. ``None`` when the value is
    not closed within ``text``: a stream must wait for more, a whole output is malformed.
    Mismatched bracket kinds are not diagnosed here; ``json.loads`` rejects them afterwards.
    """
    depth = 0
    in_string = False
    escaped = False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{" or c == "[":
            depth += 1
        elif c == "}" or c == "]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
