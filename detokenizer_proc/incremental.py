"""Incremental detokenization of one request's output, with stop-string hold-back.

Why windows: decoding token by token is wrong for byte-level and sentencepiece
tokenizers (a character may span tokens; a leading space depends on the previous
token). Like vLLM and SGLang we decode two overlapping windows that start at the
same token, ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``: their
difference is the new text, and a tail ending in U+FFFD (an incomplete UTF-8
character) is held back until the next token completes it.

Stop strings are detected by the scheduler, which finishes the request. Here we
only make sure a stop string never leaks: while streaming, any suffix that could be
the start of a stop string is held back; at finish the text is cut at the first
occurrence of the matched stop string (unless ``no_stop_trim``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


@dataclass
class DecodeState:
    """Per-request detokenizer state; freed when the request finishes."""

    skip_special_tokens: bool = True
    stop_strs: tuple[str, ...] = ()
    no_stop_trim: bool = False
    ids: list[int] = field(default_factory=list)  # output ids whose text is (or will be) decoded
    prefix_offset: int = 0  # start of the context window
    read_offset: int = 0  # ids before this are in ``text``
    text: str = ""  # complete characters decoded so far
    sent: int = 0  # characters of ``text`` already handed out

    def step(self, tok: Decoder, new_ids: Sequence[int], finished: bool, finish_reason: dict[str, Any] | None) -> str:
        """Absorb ``new_ids``; return the text that may be sent now (possibly "")."""
        if finished and _matched_stop_token(finish_reason) and not self.no_stop_trim and new_ids:
            new_ids = new_ids[:-1]  # the matched stop token is not part of the text
        self.ids.extend(new_ids)
        self._decode_new(tok, flush=finished)
        text = self.text
        if finished:
            end = len(text)
            matched = (finish_reason or {}).get("matched")
            if (
                (finish_reason or {}).get("type") == "stop"
                and isinstance(matched, str)
                and matched
                and not self.no_stop_trim
            ):
                cut = text.find(matched)
                if cut != -1:
                    end = cut
        else:
            end = len(text) - self._holdback(text)
        if end <= self.sent:
            return ""
        delta = text[self.sent : end]
        self.sent = end
        return delta

    def _decode_new(self, tok: Decoder, flush: bool) -> None:
        if self.read_offset >= len(self.ids):
            return
        skip = self.skip_special_tokens
        prefix_text = tok.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        new_text = tok.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if not flush and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return  # nothing new, or the tail is an incomplete character: wait for more ids
        self.text += new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)

    def _holdback(self, text: str) -> int:
        """How many trailing characters must wait because a stop string may start there
        (or, defensively, does occur in the unsent part)."""
        hold = 0
        for stop in self.stop_strs:
            start = max(self.sent - len(stop) + 1, 0)
            found = text.find(stop, start)
            if found != -1:
                hold = max(hold, len(text) - found)
                continue
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold


def _matched_stop_token(finish_reason: dict[str, Any] | None) -> bool:
    if not finish_reason or finish_reason.get("type") != "stop":
        return False
    matched = finish_reason.get("matched")
    return isinstance(matched, int) and not isinstance(matched, bool)
