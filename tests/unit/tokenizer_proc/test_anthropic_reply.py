"""Anthropic's replies built from the server's chunks (no server): the whole message's blocks, stop
reasons and usage; the stream's events in the documented order (message_start, then per block
content_block_start / content_block_delta* / content_block_stop with indices in order, message_delta,
message_stop) putting back the same blocks as the whole reply for every way of cutting the text; an
aborted generation as an error; and the error body for each status."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.protocol.messages import ChunkMeta, GenerateChunk
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.anthropic_reply import MessageReply, MessageStream, anthropic_error, sse_event
from tokenizer_proc.openai_reply import OutputParsing
from tokenizer_proc.openai_tools import ToolPlan

NAMES = ("get_weather", "get_time")
PARSE = ToolPlan("parse", [], NAMES, {})
NAMED = ToolPlan("named", [], NAMES, {"json_schema": "{}"}, named="get_weather")
REQUIRED = ToolPlan("required", [], NAMES, {"json_schema": "{}"})
NONE = ToolPlan("none", None, (), {})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
STOP = {"type": "stop", "matched": 2}  # EOS

# (what, parsing, text, finish reason, the message's blocks without tool ids, its stop reason)
CASES: list[tuple[str, OutputParsing, str, dict[str, Any], list[dict[str, Any]], str]] = [
    (
        "text",
        OutputParsing(NONE),
        "Paris is the capital.",
        STOP,
        [{"type": "text", "text": "Paris is the capital."}],
        "end_turn",
    ),
    (
        "thinking, text, then a call",
        OutputParsing(PARSE, "hermes", "qwen3"),
        "<think>\nlook it up\n</think>\n\nSure.\n" + CALL,
        STOP,
        [
            {"type": "thinking", "thinking": "look it up", "signature": ""},
            {"type": "text", "text": "Sure.\n"},
            {"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo"}},
        ],
        "tool_use",
    ),
    (
        "a named tool: the output is its input",
        OutputParsing(NAMED, constrained=True),
        '{"city": "Lima", "days": [1, 2]}',
        STOP,
        [{"type": "tool_use", "name": "get_weather", "input": {"city": "Lima", "days": [1, 2]}}],
        "tool_use",
    ),
    (
        "any: a list of calls",
        OutputParsing(REQUIRED, constrained=True),
        '[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {}}]',
        STOP,
        [
            {"type": "tool_use", "name": "get_weather", "input": {"city": "Rome"}},
            {"type": "tool_use", "name": "get_time", "input": {}},
        ],
        "tool_use",
    ),
    (
        "cut short",
        OutputParsing(NONE),
        "Paris is",
        {"type": "length", "length": 3},
        [{"type": "text", "text": "Paris is"}],
        "max_tokens",
    ),
    ("nothing written", OutputParsing(NONE), "", STOP, [], "end_turn"),
]


def meta(completion: int) -> ChunkMeta:
    return ChunkMeta(prompt_tokens=30, cached_tokens=12, completion_tokens=completion)


def finished(text: str, reason: dict[str, Any]) -> GenerateChunk:
    return GenerateChunk("r", text, [], True, reason, meta(7))


def pieces(text: str, size: int, reason: dict[str, Any]) -> list[GenerateChunk]:
    """The text as a stream's chunks of ``size`` characters (the last one finished)."""
    cuts = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    return [
        GenerateChunk("r", piece, [], i == len(cuts) - 1, reason if i == len(cuts) - 1 else None, meta(i + 1))
        for i, piece in enumerate(cuts)
    ]


def without_ids(content: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for block in content:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
    return [{k: v for k, v in block.items() if k != "id"} for block in content]


def check_order(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The documented sequence, checked event by event; the blocks the events put together (a
    tool's input from its partial_json, as the SDK does)."""
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"], kinds
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["role"] == "assistant"
    assert kinds[-2:] == ["message_delta", "message_stop"], kinds
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    open_index: int | None = None
    for event in events[2:-2]:
        if event["type"] == "content_block_start":
            assert open_index is None and event["index"] == len(blocks), kinds
            open_index = event["index"]
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            assert event["index"] == open_index, kinds
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                assert block["type"] == "text" and delta["text"]
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert block["type"] == "thinking" and delta["thinking"]
                block["thinking"] += delta["thinking"]
            else:
                assert delta["type"] == "input_json_delta" and block["type"] == "tool_use"
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
        else:
            assert event["type"] == "content_block_stop" and event["index"] == open_index, kinds
            open_index = None
    assert open_index is None
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    for block in blocks:  # a text block opens only when text arrives
        assert block.get("text", "x") and block.get("thinking", "x")
    return blocks


@pytest.mark.parametrize("what, parsing, text, reason, blocks, stop", CASES, ids=[c[0] for c in CASES])
def test_whole_and_streamed_replies_have_the_same_blocks(
    what: str, parsing: OutputParsing, text: str, reason: dict[str, Any], blocks: list[dict[str, Any]], stop: str
) -> None:
    body = MessageReply(parsing, "served", None).body(finished(text, reason))
    assert body["id"].startswith("msg_") and body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "served"
    assert without_ids(body["content"]) == blocks
    assert (body["stop_reason"], body["stop_sequence"]) == (stop, None)
    assert body["usage"] == {
        "input_tokens": 18,
        "output_tokens": 7,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 12,
    }
    for size in range(1, len(text) + 2):
        stream = MessageStream(parsing, "served", None)
        chunks = pieces(text, size, reason)
        events = [e for chunk in chunks for e in stream.events(chunk)]
        assert without_ids(check_order(events)) == blocks, size
        delta = events[-2]
        assert delta["delta"] == {"stop_reason": stop, "stop_sequence": None}
        assert delta["usage"]["output_tokens"] == len(chunks)
        assert events[0]["message"]["usage"]["input_tokens"] == 18
        assert events[0]["message"]["id"] == stream.id


def test_a_stop_sequence_is_named() -> None:
    reply = MessageReply(OutputParsing(NONE), "m", ["END", "\n\n"])
    body = reply.body(finished("Paris", {"type": "stop", "matched": "END"}))
    assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "END")
    # a stop string of the model's own (not one the request gave) is the end of its turn
    body = reply.body(finished("Paris", {"type": "stop", "matched": "<|im_end|>"}))
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    stream = MessageStream(OutputParsing(NONE), "m", ["END"])
    events = stream.events(finished("Paris", {"type": "stop", "matched": "END"}))
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


def test_an_aborted_generation_is_an_error() -> None:
    timeout = {"type": "abort", "message": "timeout"}
    with pytest.raises(oai.BadRequest) as exc:
        MessageReply(OutputParsing(NONE), "m", None).body(finished("Par", timeout))
    assert exc.value.status == 504 and "deadline" in exc.value.message
    stream = MessageStream(OutputParsing(NONE), "m", None)
    events = [e for c in pieces("Paris", 2, {"type": "abort", "message": "server stopped"}) for e in stream.events(c)]
    assert [e["type"] for e in events[-2:]] == ["content_block_delta", "error"]
    assert events[-1] == {
        "type": "error",
        "error": {"type": "api_error", "message": "the generation was aborted: server stopped"},
    }


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (503, "overloaded_error"),
        (529, "overloaded_error"),
        (500, "api_error"),
    ],
)
def test_the_error_body_is_anthropics(status: int, kind: str) -> None:
    assert anthropic_error(status, "went wrong", "code", None) == {
        "type": "error",
        "error": {"type": kind, "message": "went wrong"},
    }


def test_the_error_message_names_the_field() -> None:
    named = anthropic_error(400, "messages[0].content[1]: image blocks are not supported", "invalid_request", "x")
    assert named["error"]["message"] == "x: messages[0].content[1]: image blocks are not supported"
    kept = anthropic_error(400, "top_p: must be in (0, 1]", "invalid_request", "top_p")
    assert kept["error"]["message"] == "top_p: must be in (0, 1]"


def test_events_are_framed_with_their_type() -> None:
    frame = sse_event({"type": "message_stop"})
    assert frame == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
