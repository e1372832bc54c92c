"""Reasoning parsers: split a thinking model's output into ``reasoning_content`` and ``content``.

Why: Qwen 3, DeepSeek-R1 and their kin write their chain of thought between ``<think>`` and
``</think>`` before the answer; OpenAI-style clients expect it apart from the answer
(``message.reasoning_content``, streamed as ``delta.reasoning_content``).

Rules (the same whole and streamed): the reasoning is the text after the start tag up to the
end tag, stripped of surrounding whitespace; the content is what follows the end tag, without
its leading whitespace. An output that ends inside the reasoning is all reasoning. Whether
the output starts inside the reasoning depends on the chat template: ``force_reasoning``
says the template already opened ``<think>`` in the prompt (a leading ``<think>`` in the
output is still stripped); otherwise there is reasoning only when the output starts (after
whitespace) with the start tag.

``parse`` is written directly with string operations and ``feed``/``finish`` as a small state
machine; the tests hold them equal with the output cut at every offset.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable

from runtime.text.parsers._text import held_back_len

logger = logging.getLogger(__name__)

# Stream states.
_OPENING = "opening"  # deciding whether the output opens with the start tag
_REASONING = "reasoning"
_CONTENT_LEAD = "content_lead"  # after the end tag: dropping the content's leading whitespace
_CONTENT = "content"


class ReasoningParser:
    """Splits reasoning from content, for a whole output (``parse``) or a stream (``feed``/``finish``).

    An instance serves one reply's stream; ``parse`` does not touch its stream state.
    """

    def __init__(self, start: str = "<think>", end: str = "</think>", force_reasoning: bool = False) -> None:
        if not start or not end:
            raise ValueError("reasoning start and end tags must not be empty")
        self.start = start
        self.end = end
        self.force_reasoning = force_reasoning
        self._buf = ""
        self._state = _OPENING
        # Nothing of the reasoning sent yet: its leading whitespace is still being dropped.
        self._reasoning_started = False

    def parse(self, text: str) -> tuple[str | None, str]:
        """Whole output -> (reasoning, or None when the output had no reasoning part; content)."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif self.force_reasoning:
            body = stripped
        else:
            return None, text
        i = body.find(self.end)
        if i == -1:
            return body.strip(), ""
        return body[:i].strip(), body[i + len(self.end) :].lstrip()

    def feed(self, delta: str) -> tuple[str, str]:
        """Next text fragment -> (reasoning fragment, content fragment) now safe to send."""
        self._buf += delta
        return self._advance(at_end=False)

    def finish(self) -> tuple[str, str]:
        """End of stream: flush what was held back (a partial tag, trailing whitespace)."""
        return self._advance(at_end=True)

    def _advance(self, at_end: bool) -> tuple[str, str]:
        reasoning = ""
        content = ""
        if self._state == _OPENING:
            stripped = self._buf.lstrip()
            if stripped.startswith(self.start):
                self._buf = stripped[len(self.start) :]
                self._state = _REASONING
            elif not at_end and self.start.startswith(stripped):
                return "", ""  # only whitespace and part of the start tag so far
            elif self.force_reasoning:
                self._buf = stripped
                self._state = _REASONING
            else:
                self._state = _CONTENT  # no reasoning: the text is content verbatim
        if self._state == _REASONING:
            reasoning = self._reasoning_piece(at_end)
        if self._state == _CONTENT_LEAD:
            self._buf = self._buf.lstrip()
            if self._buf:
                self._state = _CONTENT
        if self._state == _CONTENT:
            content, self._buf = self._buf, ""
        return reasoning, content

    def _reasoning_piece(self, at_end: bool) -> str:
        """The reasoning now safe to send; moves to ``_CONTENT_LEAD`` at the end tag.

        Held back: a tail that may be the start of the end tag, and trailing whitespace
        (it is dropped if the end tag follows it).
        """
        if not self._reasoning_started:
            self._buf = self._buf.lstrip()
        i = self._buf.find(self.end)
        if i != -1:
            piece = self._buf[:i].rstrip()
            self._buf = self._buf[i + len(self.end) :]
            self._state = _CONTENT_LEAD
        elif at_end:
            piece, self._buf = self._buf.rstrip(), ""
            logger.debug("output ended inside the reasoning")
        else:
            safe = len(self._buf) - held_back_len(self._buf, self.end)
            piece = self._buf[:safe].rstrip()
            self._buf = self._buf[len(piece) :]
        if piece:
            self._reasoning_started = True
        return piece


class NoReasoningParser(ReasoningParser):
    """Everything is content: thinking was turned off (``enable_thinking: false``)."""

    def parse(self, text: str) -> tuple[str | None, str]:
        """Whole output -> (None, the output)."""
        return None, text

    def feed(self, delta: str) -> tuple[str, str]:
        """The fragment, as content."""
        return "", delta

    def finish(self) -> tuple[str, str]:
        """Nothing is ever held back."""
        return "", ""


REASONING_PARSERS: dict[str, Callable[[], ReasoningParser]] = {
    # Qwen 3 hybrid: thinks only when it opens <think> itself.
    "qwen3": functools.partial(ReasoningParser, force_reasoning=False),
    # The template opened <think> in the prompt: the output starts inside the reasoning.
    "qwen3-thinking": functools.partial(ReasoningParser, force_reasoning=True),
    "deepseek-r1": functools.partial(ReasoningParser, force_reasoning=True),
}

# Models whose chat template honours ``enable_thinking``; the others always think.
_HONOURS_ENABLE_THINKING = frozenset({"qwen3"})


def make_reasoning_parser(name: str, enable_thinking: bool = True) -> ReasoningParser:
    """A fresh parser for one reply; ``ValueError`` naming the choices for an unknown ``name``.

    ``enable_thinking`` is the request's ``chat_template_kwargs["enable_thinking"]``: False
    gives a parser that makes everything content, for the models whose template honours it.
    """
    try:
        factory = REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None
    if not enable_thinking and name in _HONOURS_ENABLE_THINKING:
        return NoReasoningParser()
    return factory()
