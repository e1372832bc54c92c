"""Tool-call parsers on canned model outputs: the whole reply, and the same reply streamed.

What the chat endpoint relies on: ``parse`` finds exactly the calls the model wrote (name and
arguments JSON text) and leaves the rest as content; a malformed call, or a call to a tool
that was not offered, is content verbatim; and streaming the output in any fragments gives
the same content (concatenated) and the same calls (assembled from the deltas) as ``parse``,
without ever sending part of a marker as content. Each canned output is streamed cut at
every offset into two pieces, and one character at a time.
"""

from __future__ import annotations

import json
import time

import pytest

from runtime.text.parsers import (
    TOOL_CALL_PARSERS,
    HermesToolCallParser,
    Llama3ToolCallParser,
    MistralToolCallParser,
    ToolCall,
    ToolCallDelta,
    make_tool_call_parser,
)

TOOLS = ["get_weather", "search", "noop"]


def call(name: str, args: dict) -> ToolCall:
    return ToolCall(name=name, arguments=json.dumps(args, ensure_ascii=False))


W_PARIS = call("get_weather", {"city": "Paris"})
W_ZURICH = ToolCall("get_weather", '{"city": "Zürich", "note": "東京 ☂"}')
SEARCH_NESTED = call("search", {"q": "a } b { c", "opts": {"k": [1, {"x": None}], "deep": {"e": True}}})
SEARCH_TAG = call("search", {"q": "</tool_call> and <tool_call>"})
NOOP = call("noop", {})

HERMES_CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
HERMES_BAD_JSON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'

# (format, output, content, calls) -- the expected values are written out, not derived.
CASES: list[tuple[str, str, str, list[ToolCall]]] = [
    # -- hermes ------------------------------------------------------------------------
    ("hermes", "The weather is nice.", "The weather is nice.", []),
    ("hermes", "  two spaces, then text\n\n", "  two spaces, then text\n\n", []),
    ("hermes", "\n\n", "\n\n", []),
    ("hermes", "", "", []),
    ("hermes", "a < b and <tool> is not <tool_call", "a < b and <tool> is not <tool_call", []),
    ("hermes", HERMES_CALL_PARIS, "", [W_PARIS]),
    ("hermes", "\n" + HERMES_CALL_PARIS + "\n", "", [W_PARIS]),
    ("hermes", "Let me check.\n" + HERMES_CALL_PARIS, "Let me check.\n", [W_PARIS]),
    ("hermes", HERMES_CALL_PARIS + "\n\n" + HERMES_CALL_PARIS + "\n", "", [W_PARIS, W_PARIS]),
    ("hermes", HERMES_CALL_PARIS + "\nDone: it is sunny.", "\nDone: it is sunny.", [W_PARIS]),
    (
        "hermes",
        'Before<tool_call>{"name":"noop","arguments":{}}</tool_call>mid\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n',
        "Beforemid\n",
        [NOOP, W_PARIS],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "note": "東京 ☂"}}\n</tool_call>',
        "",
        [W_ZURICH],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"q": "a } b { c", "opts": {"k": [1, {"x": null}],'
        ' "deep": {"e": true}}}}\n</tool_call>',
        "",
        [SEARCH_NESTED],
    ),
    (
        "hermes",
        '<tool_call>{"name": "search", "arguments": {"q": "</tool_call> and <tool_call>"}}</tool_call>',
        "",
        [SEARCH_TAG],
    ),
    (
        "hermes",
        '<tool_call>{"name": "search", "arguments": {"q": "a \\"quoted\\" } brace"}}</tool_call>',
        "",
        [ToolCall("search", '{"q": "a \\"quoted\\" } brace"}')],
    ),
    # a string ending in an escaped backslash: its closing quote is not escaped
    (
        "hermes",
        '<tool_call>{"name": "search", "arguments": {"q": "C:\\\\", "r": "}"}}</tool_call>',
        "",
        [ToolCall("search", '{"q": "C:\\\\", "r": "}"}')],
    ),
    # missing "arguments" means no arguments
    ("hermes", '<tool_call>{"name": "noop"}</tool_call>', "", [NOOP]),
    # unterminated at EOS: the JSON alone decides
    ("hermes", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "Sure.\n", [W_PARIS]),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    ("hermes", "<tool_call>", "<tool_call>", []),
    ("hermes", "text <tool_call>\n", "text <tool_call>\n", []),
    (
        "hermes",
        '<tool_call>{"name": "noop", "arguments": {}} trailing',
        '<tool_call>{"name": "noop", "arguments": {}} trailing',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "noop", "arguments": {}}</tool_',
        '<tool_call>{"name": "noop", "arguments": {}}</tool_',
        [],
    ),
    # malformed blocks stay verbatim; the good ones around them are still calls
    ("hermes", HERMES_BAD_JSON, HERMES_BAD_JSON, []),
    ("hermes", HERMES_BAD_JSON + "\n" + HERMES_CALL_PARIS, HERMES_BAD_JSON + "\n", [W_PARIS]),
    ("hermes", HERMES_CALL_PARIS + "\n" + HERMES_BAD_JSON, "\n" + HERMES_BAD_JSON, [W_PARIS]),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        "hermes",
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "noop", "arguments": "{}"}</tool_call>',
        '<tool_call>{"name": "noop", "arguments": "{}"}</tool_call>',
        [],
    ),
    ("hermes", '<tool_call>["noop"]</tool_call>', '<tool_call>["noop"]</tool_call>', []),
    (
        "hermes",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    (
        "hermes",
        '<tool_call>{"name": "noop", "arguments": {}</tool_call> then\n' + HERMES_CALL_PARIS,
        '<tool_call>{"name": "noop", "arguments": {}</tool_call> then\n',
        [W_PARIS],
    ),
    # -- llama3 ------------------------------------------------------------------------
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [W_PARIS]),
    ("llama3", '\n <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}\n', "", [W_PARIS]),
    ("llama3", '{"name": "get_weather", "arguments": {"city": "Zürich", "note": "東京 ☂"}}', "", [W_ZURICH]),
    (
        "llama3",
        '<|python_tag|>{"name": "noop", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Paris"}};',
        "",
        [NOOP, W_PARIS],
    ),
    (
        "llama3",
        '{"name": "search", "parameters": {"q": "a } b { c", "opts": {"k": [1, {"x": null}], "deep": {"e": true}}}}',
        "",
        [SEARCH_NESTED],
    ),
    ("llama3", "It is sunny in Paris.", "It is sunny in Paris.", []),
    ("llama3", "", "", []),
    ("llama3", " \n", " \n", []),
    ("llama3", '<|python_tag|>print("hi")', '<|python_tag|>print("hi")', []),
    ("llama3", "<|python_tag|>", "<|python_tag|>", []),
    ("llama3", "<|python", "<|python", []),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}} is what I would call.',
        '{"name": "get_weather", "parameters": {"city": "Paris"}} is what I would call.',
        [],
    ),
    ("llama3", 'Call: {"name": "noop", "parameters": {}}', 'Call: {"name": "noop", "parameters": {}}', []),
    (
        "llama3",
        '{"name": "noop", "parameters": {}}; {"name": "rm_rf", "parameters": {}}',
        '{"name": "noop", "parameters": {}}; {"name": "rm_rf", "parameters": {}}',
        [],
    ),
    ("llama3", '{"name": "noop", "parameters": {}', '{"name": "noop", "parameters": {}', []),
    ("llama3", '{"name": "noop", "parameters": []}', '{"name": "noop", "parameters": []}', []),
    ("llama3", '{"city": "Paris"}', '{"city": "Paris"}', []),
    # -- mistral -----------------------------------------------------------------------
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', "", [W_PARIS]),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "noop", "arguments": {}}, {"name": "get_weather", "arguments": '
        '{"city": "Zürich", "note": "東京 ☂"}}]',
        "",
        [NOOP, W_ZURICH],
    ),
    (
        "mistral",
        'Checking.\n[TOOL_CALLS] [{"name": "search", "arguments": {"q": "a } b { c", "opts": '
        '{"k": [1, {"x": null}], "deep": {"e": true}}}}]\n',
        "Checking.\n",
        [SEARCH_NESTED],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "search", "arguments": {"q": "]} [TOOL_CALLS] ["}}]',
        "",
        [call("search", {"q": "]} [TOOL_CALLS] ["})],
    ),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [W_PARIS]),
    (
        "mistral",
        '[TOOL_CALLS]noop[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "note": "東京 ☂"}',
        "",
        [NOOP, W_ZURICH],
    ),
    ("mistral", "No tools needed [TOOL] here [", "No tools needed [TOOL] here [", []),
    ("mistral", "", "", []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par',
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Par',
        [],
    ),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "noop", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]',
        '[TOOL_CALLS] [{"name": "noop", "arguments": {}}, {"name": "rm_rf", "arguments": {}}]',
        [],
    ),
    ("mistral", "[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
    ("mistral", "[TOOL_CALLS] [not json]", "[TOOL_CALLS] [not json]", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARGS]oops", "[TOOL_CALLS]get_weather[ARGS]oops", []),
    ("mistral", "[TOOL_CALLS]get weather", "[TOOL_CALLS]get weather", []),
    ("mistral", "[TOOL_CALLS]get_weather[ARG", "[TOOL_CALLS]get_weather[ARG", []),
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "bad"}] and [TOOL_CALLS] [{"name": "noop"}]',
        '[TOOL_CALLS] [{"name": "bad"}] and ',
        [NOOP],
    ),
]


def _case_id(case: tuple[str, str, str, list[ToolCall]]) -> str:
    fmt, text, _, _ = case
    return f"{fmt}:{text[:40]!r}"


def stream(fmt: str, pieces: list[str]) -> tuple[str, list[ToolCall]]:
    """Feed ``pieces`` then finish; the content concatenated and the calls assembled from deltas.

    Also checks the deltas' shape: indices 0, 1, ... in order, the name on each call's
    first delta only.
    """
    parser = make_tool_call_parser(fmt, TOOLS)
    content: list[str] = []
    deltas: list[ToolCallDelta] = []
    for piece in pieces:
        text, new = parser.feed(piece)
        content.append(text)
        deltas.extend(new)
    text, new = parser.finish()
    content.append(text)
    deltas.extend(new)
    calls: list[ToolCall] = []
    for delta in deltas:
        if delta.index == len(calls):
            assert delta.name is not None, "a call's first delta names the tool"
            calls.append(ToolCall(name=delta.name, arguments=delta.arguments))
        else:
            assert delta.index == len(calls) - 1, "deltas come call by call, in index order"
            assert delta.name is None, "only a call's first delta has the name"
            calls[-1].arguments += delta.arguments
    return "".join(content), calls


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_parse_whole_output(case: tuple[str, str, str, list[ToolCall]]) -> None:
    fmt, text, content, calls = case
    assert make_tool_call_parser(fmt, TOOLS).parse(text) == (content, calls)


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_streamed_equals_whole_at_every_cut(case: tuple[str, str, str, list[ToolCall]]) -> None:
    fmt, text, content, calls = case
    for cut in range(len(text) + 1):
        assert stream(fmt, [text[:cut], text[cut:]]) == (content, calls), f"cut at {cut}: {text[:cut]!r}"
    assert stream(fmt, list(text)) == (content, calls), "one character at a time"


@pytest.mark.parametrize("fmt, marker", [("hermes", "<tool_call>"), ("mistral", "[TOOL_CALLS]")])
def test_partial_marker_is_never_sent(fmt: str, marker: str) -> None:
    """Content up to the marker goes out at once; no prefix of the marker does until decided."""
    parser = make_tool_call_parser(fmt, TOOLS)
    assert parser.feed("Hello ") == ("Hello ", [])
    for i in range(1, len(marker) + 1):
        assert parser.feed(marker[i - 1]) == ("", []), f"sent part of {marker[:i]!r}"
    assert parser.feed(" -- no call follows") == (marker + " -- no call follows", [])
    assert parser.finish() == ("", [])


def test_partial_marker_turns_out_to_be_content() -> None:
    parser = make_tool_call_parser("hermes", TOOLS)
    assert parser.feed("x <tool_") == ("x ", [])
    assert parser.feed("box> y") == ("<tool_box> y", [])
    assert parser.finish() == ("", [])


def test_call_deltas_name_first_then_arguments() -> None:
    parser = make_tool_call_parser("hermes", TOOLS)
    content, deltas = parser.feed("Hi " + HERMES_CALL_PARIS + HERMES_CALL_PARIS)
    assert content == "Hi "
    assert deltas == [
        ToolCallDelta(index=0, name="get_weather"),
        ToolCallDelta(index=0, arguments='{"city": "Paris"}'),
        ToolCallDelta(index=1, name="get_weather"),
        ToolCallDelta(index=1, arguments='{"city": "Paris"}'),
    ]
    assert parser.finish() == ("", [])


def test_call_is_sent_when_complete_not_at_finish() -> None:
    parser = make_tool_call_parser("mistral", TOOLS)
    assert parser.feed('[TOOL_CALLS] [{"name": "noop", "arguments": {}}') == ("", [])
    assert parser.feed("]") == ("", [ToolCallDelta(0, "noop"), ToolCallDelta(0, None, "{}")])


def test_any_tool_name_when_tools_not_given() -> None:
    text = '<tool_call>{"name": "rm_rf", "arguments": {"path": "/"}}</tool_call>'
    assert make_tool_call_parser("hermes", None).parse(text) == ("", [ToolCall("rm_rf", '{"path": "/"}')])
    assert make_tool_call_parser("hermes", ["noop"]).parse(text) == (text, [])


def test_registry_and_aliases() -> None:
    for alias in ("hermes", "qwen", "qwen25", "qwen3"):
        assert TOOL_CALL_PARSERS[alias] is HermesToolCallParser
    assert TOOL_CALL_PARSERS["llama"] is TOOL_CALL_PARSERS["llama3"] is Llama3ToolCallParser
    assert TOOL_CALL_PARSERS["mistral"] is MistralToolCallParser
    assert HermesToolCallParser.skip_special_tokens is True
    assert Llama3ToolCallParser.skip_special_tokens is False
    assert MistralToolCallParser.skip_special_tokens is False
    assert isinstance(make_tool_call_parser("qwen", TOOLS), HermesToolCallParser)


def test_unknown_parser_name_lists_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown tool-call parser 'gpt'.*hermes.*llama3.*mistral"):
        make_tool_call_parser("gpt", TOOLS)


def test_parse_does_not_disturb_a_stream() -> None:
    parser = make_tool_call_parser("hermes", TOOLS)
    assert parser.feed("Hi <tool") == ("Hi ", [])
    assert parser.parse(HERMES_CALL_PARIS) == ("", [W_PARIS])
    assert parser.feed("_call>") == ("", [])
    assert parser.finish() == ("<tool_call>", [])


@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_long_call_streams_in_linear_time(fmt: str) -> None:
    """A 40 KB call fed two characters at a time: rescanning it per fragment would take seconds."""
    args = {"code": 'print({"a": "}"})\n' * 2000}
    text = {
        "hermes": "<tool_call>" + json.dumps({"name": "search", "arguments": args}) + "</tool_call>",
        "llama3": json.dumps({"name": "search", "parameters": args}),
        "mistral": "[TOOL_CALLS]" + json.dumps([{"name": "search", "arguments": args}]),
    }[fmt]
    started = time.perf_counter()
    assert stream(fmt, [text[i : i + 2] for i in range(0, len(text), 2)]) == ("", [call("search", args)])
    assert time.perf_counter() - started < 2.0
