"""Ollama's replies without a server: the whole body and the NDJSON stream of the same chunks (the
stream's pieces with ``done`` false join to the body's text, then exactly one ``done`` true object with
the counts, as Ollama documents), the measured durations, ``thinking`` and whole ``tool_calls`` (their
arguments objects) read by the parsers from a recorded Qwen3-style text cut at every offset, and the
error body."""

from __future__ import annotations

import json
from itertools import count
from typing import Any

import pytest

from runtime.protocol.messages import ChunkMeta, GenerateChunk
from tokenizer_proc.ollama_reply import (
    OllamaReply,
    Timing,
    load_reply,
    ndjson,
    ollama_calls,
    ollama_error,
)
from tokenizer_proc.openai_reply import OutputParsing
from tokenizer_proc.openai_tools import ToolPlan

NONE = OutputParsing(ToolPlan("none", None, (), {}))
TOOLS = OutputParsing(ToolPlan("parse", [], ("get_weather", "get_time"), {}), "hermes", "qwen3")
CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_2 = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET", "hours": 3}}\n</tool_call>'
RECORDED = "<think>\nthe user wants weather\n</think>\n\nChecking.\n" + CALL_1 + "\n" + CALL_2
COUNTS = ChunkMeta(prompt_tokens=11, completion_tokens=4)


def chunks(pieces: list[str], reason: str = "stop") -> list[GenerateChunk]:
    """A stream's chunks: one per piece, the last finished with the counts."""
    out = [GenerateChunk("r", p, [i], False) for i, p in enumerate(pieces[:-1])]
    finish = {"type": reason, "matched": 2}
    return out + [GenerateChunk("r", pieces[-1], [len(pieces)], True, finish, ChunkMeta(11, 4, finish_reason=finish))]


def ticking() -> Timing:
    """A clock that advances 10 ns per reading."""
    clock = count(0, 10)
    return Timing(lambda: next(clock))


def whole(kind: Any, pieces: list[str], parsing: OutputParsing = NONE, reason: str = "stop") -> dict[str, Any]:
    reply = OllamaReply(kind, "smollm2:latest", parsing, ticking())
    reply.timing.accept()
    for chunk in chunks(pieces, reason):
        reply.add(chunk)
    return reply.body()


def streamed(kind: Any, pieces: list[str], parsing: OutputParsing = NONE, reason: str = "stop") -> list[dict[str, Any]]:
    reply = OllamaReply(kind, "smollm2:latest", parsing, ticking())
    reply.timing.accept()
    return [obj for chunk in chunks(pieces, reason) for obj in reply.stream_objects(chunk)]


def test_chat_body() -> None:
    body = whole("chat", ["The sky", " is", " blue."])
    assert body["model"] == "smollm2:latest" and body["created_at"].endswith("Z")
    assert body["message"] == {"role": "assistant", "content": "The sky is blue."}
    assert body["done"] is True and body["done_reason"] == "stop"
    assert body["prompt_eval_count"] == 11 and body["eval_count"] == 4
    assert "response" not in body and "context" not in body


def test_durations_are_measured_and_add_up() -> None:
    body = whole("chat", ["a", "b", "c"])
    # clock readings: arrival 0, accepted 10, chunks at 20, 30, 40 (the first output at 20)
    assert body["load_duration"] == 10 and body["prompt_eval_duration"] == 10 and body["eval_duration"] == 20
    parts = body["load_duration"] + body["prompt_eval_duration"] + body["eval_duration"]
    assert body["total_duration"] == parts == 40


def test_length() -> None:
    assert whole("generate", ["x", "y"], reason="length")["done_reason"] == "length"


@pytest.mark.parametrize("kind, field", [("chat", "message"), ("generate", "response")])
def test_the_stream_is_pieces_then_one_done_object(kind: str, field: str) -> None:
    pieces = ["Once", " upon", " a", " time"]
    objects = streamed(kind, pieces)
    *body, last = objects
    assert all(o["done"] is False for o in body) and last["done"] is True
    assert set(last) >= {"done_reason", "total_duration", "load_duration", "prompt_eval_count", "eval_count"}
    assert all("done_reason" not in o and "eval_count" not in o for o in body)
    texts = [o["message"]["content"] if field == "message" else o["response"] for o in body]
    assert "".join(texts) == "Once upon a time" == text_of(whole(kind, pieces))
    done_text = last["message"] if field == "message" else last["response"]
    assert done_text in ({"role": "assistant", "content": ""}, "")
    assert last["eval_count"] == 4 and last["prompt_eval_count"] == 11
    # the lines as sent: one JSON object each
    lines = b"".join(ndjson(o) for o in objects).split(b"\n")
    assert lines[-1] == b"" and [json.loads(line) for line in lines[:-1]] == objects


def text_of(body: dict[str, Any]) -> str:
    return str(body["message"]["content"] if "message" in body else body["response"])


def test_generate_body() -> None:
    body = whole("generate", ["4", "2"])
    assert body["response"] == "42" and "message" not in body and body["done"] is True


def test_thinking_and_tool_calls_whole() -> None:
    message = whole("chat", [RECORDED], TOOLS)["message"]
    assert message["thinking"] == "the user wants weather"
    assert message["content"] == "Checking.\n"
    assert message["tool_calls"] == [
        {"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Oslo"}}},
        {"function": {"index": 1, "name": "get_time", "arguments": {"zone": "CET", "hours": 3}}},
    ]


def merged(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat stream's pieces put together, as a client does."""
    out: dict[str, Any] = {"content": "", "thinking": "", "tool_calls": []}
    for obj in objects:
        message = obj["message"]
        out["content"] += message.get("content", "")
        out["thinking"] += message.get("thinking", "")
        out["tool_calls"] += message.get("tool_calls", [])
    return out


@pytest.mark.parametrize("cut", range(0, len(RECORDED) + 1, 7))
def test_a_stream_cut_anywhere_gives_the_same_message(cut: int) -> None:
    pieces = [p for p in (RECORDED[:cut], RECORDED[cut:]) if p]
    message = whole("chat", [RECORDED], TOOLS)["message"]
    got = merged(streamed("chat", pieces, TOOLS))
    assert got == {"content": message["content"], "thinking": message["thinking"], "tool_calls": message["tool_calls"]}


def test_a_call_streams_whole_once_the_next_starts() -> None:
    pieces = ["Checking.\n", CALL_1, "\n" + CALL_2, ""]
    objects = streamed("chat", pieces, OutputParsing(TOOLS.tools, "hermes"))
    with_calls = [(i, o["message"]["tool_calls"]) for i, o in enumerate(objects) if "tool_calls" in o["message"]]
    assert [[c["function"]["name"] for c in calls] for _, calls in with_calls] == [["get_weather"], ["get_time"]]
    assert with_calls[0][0] < with_calls[1][0] and objects[-1]["done"] is True
    assert all(isinstance(c["function"]["arguments"], dict) for _, calls in with_calls for c in calls)


def test_calls_whose_arguments_are_not_an_object_stay_text() -> None:
    calls, text = ollama_calls([("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "CE')])
    assert calls == [{"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Oslo"}}}]
    assert text == '{"zone": "CE'


def test_error_body_and_load_reply() -> None:
    assert ollama_error(404, 'model "x" not found, try pulling it first', "model_not_found", "model") == {
        "error": 'model "x" not found, try pulling it first'
    }
    load = load_reply("generate", "m")
    assert load["done"] is True and load["done_reason"] == "load" and load["response"] == ""
    assert load_reply("chat", "m")["message"] == {"role": "assistant", "content": ""}
