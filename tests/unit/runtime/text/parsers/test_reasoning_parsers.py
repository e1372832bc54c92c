"""Reasoning parsers on canned model outputs: the whole reply, and the same reply streamed.

What the chat endpoint relies on: the reasoning is exactly the text between ``<think>`` and
``</think>`` (stripped), the content is what follows (without its leading whitespace), an
output that ends inside the reasoning is all reasoning, and an output that does not open
the reasoning (when the template did not) is content verbatim. Streamed in any fragments
(cut at every offset, and one character at a time) the concatenated fragments equal
``parse``'s answer, whitespace stripping included, and no part of a tag is ever sent.
"""

from __future__ import annotations

import pytest

from runtime.text.parsers import (
    REASONING_PARSERS,
    NoReasoningParser,
    ReasoningParser,
    make_reasoning_parser,
)

# (parser name, output, reasoning, content) -- the expected values are written out.
CASES: list[tuple[str, str, str | None, str]] = [
    # -- qwen3: reasoning only when the output opens <think> -------------------------
    ("qwen3", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("qwen3", "\n  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>\n\n</think>\n\nHi", "", "Hi"),
    ("qwen3", "<think></think>", "", ""),
    ("qwen3", "<think>  multi\n\nline   reasoning \n", "multi\n\nline   reasoning", ""),
    ("qwen3", "<think>cut off in the tag </thi", "cut off in the tag </thi", ""),
    ("qwen3", "<think>x</think>  y </think> z\n", "x", "y </think> z\n"),
    ("qwen3", "<think>a < b, </tag> and </thinking> </think>c", "a < b, </tag> and </thinking>", "c"),
    ("qwen3", "<think>Zürich 東京 ☂ \u3000</think>\u3000答え", "Zürich 東京 ☂", "答え"),
    ("qwen3", "  Plain answer, no thinking.\n", None, "  Plain answer, no thinking.\n"),
    ("qwen3", "", None, ""),
    ("qwen3", " \n", None, " \n"),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "  <think", None, "  <think"),
    ("qwen3", "<thinking>no</thinking>", None, "<thinking>no</thinking>"),
    ("qwen3", "Answer first <think>then</think>", None, "Answer first <think>then</think>"),
    ("qwen3", "reasoning?</think>content", None, "reasoning?</think>content"),
    # -- forced: the template opened <think>, the output starts inside it -------------
    ("deepseek-r1", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek-r1", "<think>\nLet me think.\n</think>\n\nThe answer is 4.", "Let me think.", "The answer is 4."),
    ("deepseek-r1", "\n\n  still thinking when it stopped", "still thinking when it stopped", ""),
    ("deepseek-r1", "</think>Direct answer.", "", "Direct answer."),
    ("deepseek-r1", "", "", ""),
    ("deepseek-r1", "<thi", "<thi", ""),
    ("deepseek-r1", " x \t</think>\t y", "x", "y"),
    ("qwen3-thinking", "Hmm. 東京?</think>\n\nTokyo.\n\n", "Hmm. 東京?", "Tokyo.\n\n"),
    ("qwen3-thinking", "<think>\n</think>\n", "", ""),
]


def _case_id(case: tuple[str, str, str | None, str]) -> str:
    return f"{case[0]}:{case[1][:40]!r}"


def stream(name: str, pieces: list[str]) -> tuple[str, str]:
    """Feed ``pieces`` then finish: (reasoning, content), each concatenated."""
    parser = make_reasoning_parser(name)
    reasoning: list[str] = []
    content: list[str] = []
    for piece in [*pieces, None]:
        r, c = parser.feed(piece) if piece is not None else parser.finish()
        reasoning.append(r)
        content.append(c)
    return "".join(reasoning), "".join(content)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_parse_whole_output(case: tuple[str, str, str | None, str]) -> None:
    name, text, reasoning, content = case
    assert make_reasoning_parser(name).parse(text) == (reasoning, content)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_streamed_equals_whole_at_every_cut(case: tuple[str, str, str | None, str]) -> None:
    name, text, reasoning, content = case
    expected = (reasoning or "", content)
    for cut in range(len(text) + 1):
        assert stream(name, [text[:cut], text[cut:]]) == expected, f"cut at {cut}: {text[:cut]!r}"
    assert stream(name, list(text)) == expected, "one character at a time"


def test_partial_end_tag_is_held_back() -> None:
    parser = make_reasoning_parser("qwen3")
    assert parser.feed("<think>") == ("", "")
    assert parser.feed("step one") == ("step one", "")
    assert parser.feed(" </thi") == ("", "")  # the space and the partial tag wait
    assert parser.feed("nk>\n") == ("", "")
    assert parser.feed("Answer") == ("", "Answer")
    assert parser.finish() == ("", "")


def test_partial_end_tag_that_is_not_one_goes_out_as_reasoning() -> None:
    parser = make_reasoning_parser("deepseek-r1")
    assert parser.feed("a </thi") == ("a", "")
    assert parser.feed("s is not it") == (" </this is not it", "")
    assert parser.finish() == ("", "")


def test_leading_start_tag_is_decided_before_anything_is_sent() -> None:
    parser = make_reasoning_parser("qwen3")
    assert parser.feed(" <thi") == ("", "")
    assert parser.feed("s is text") == ("", " <this is text")
    assert parser.finish() == ("", "")


def test_custom_tags() -> None:
    parser = ReasoningParser(start="[R]", end="[/R]")
    assert parser.parse("[R] why [/R] what") == ("why", "what")
    assert parser.parse("what") == (None, "what")


def test_enable_thinking_false_makes_everything_content_for_qwen3() -> None:
    parser = make_reasoning_parser("qwen3", enable_thinking=False)
    assert isinstance(parser, NoReasoningParser)
    text = "<think>x</think>y"
    assert parser.parse(text) == (None, text)
    assert parser.feed("<think>x") == ("", "<think>x")
    assert parser.feed("</think>y") == ("", "</think>y")
    assert parser.finish() == ("", "")


def test_enable_thinking_false_does_not_stop_always_thinking_models() -> None:
    parser = make_reasoning_parser("deepseek-r1", enable_thinking=False)
    assert parser.parse("x</think>y") == ("x", "y")


def test_registry() -> None:
    assert set(REASONING_PARSERS) == {"qwen3", "qwen3-thinking", "deepseek-r1"}
    assert make_reasoning_parser("qwen3").force_reasoning is False
    assert make_reasoning_parser("qwen3-thinking").force_reasoning is True
    assert make_reasoning_parser("deepseek-r1").force_reasoning is True
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'.*deepseek-r1.*qwen3"):
        make_reasoning_parser("o1")
    with pytest.raises(ValueError):
        ReasoningParser(start="")
