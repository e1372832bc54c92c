"""Responses API replies (no server): the Response object's output items (message, function_call,
reasoning), its status (completed, incomplete) and usage, and the stream's typed events in the
documented order, each validated by the installed openai SDK's own models; the SDK's
``responses.stream`` accumulator reassembles the stream into the whole reply."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent

from runtime.protocol.messages import ChunkMeta, GenerateChunk
from tokenizer_proc.openai_reply import OutputParsing
from tokenizer_proc.openai_tools import NamedToolChoice, Tool, plan_tools
from tokenizer_proc.responses_protocol import ResponsesRequest
from tokenizer_proc.responses_reply import ResponsesReply

_UNION = typing.get_args(ResponseStreamEvent)[0]
EVENT_MODELS = {typing.get_args(m.model_fields["type"].annotation)[0]: m for m in typing.get_args(_UNION)}
WEATHER = Tool.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
)
ECHOED = ResponsesRequest.model_validate({"model": "m", "input": "x"}).echoed()
TEXT_ORDER = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def parsing(choice: Any = None, parser: str | None = None, reasoning: str | None = None) -> OutputParsing:
    tools = [WEATHER] if choice is not None else None
    plan = plan_tools(tools, choice, True, parser)
    return OutputParsing(plan, parser, reasoning, constrained=bool(plan.constraint))


def chunk(text: str, finished: bool, done: int, reason: str = "stop") -> GenerateChunk:
    meta = ChunkMeta(prompt_tokens=11, completion_tokens=done, cached_tokens=4)
    return GenerateChunk("r", text, [], finished, {"type": reason} if finished else None, meta)


def whole(how: OutputParsing, text: str, reason: str = "stop") -> dict[str, Any]:
    reply = ResponsesReply(ECHOED, "m", how, lambda t: len(t.split()))
    reply.add(chunk(text, True, 9, reason))
    body = reply.body()
    Response.model_validate(body)  # the SDK's model, validated (not merely constructed)
    return body


def streamed(how: OutputParsing, pieces: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    reply = ResponsesReply(ECHOED, "m", how, lambda t: len(t.split()))
    events = reply.opening_events()
    for i, piece in enumerate(pieces):
        events += reply.feed(chunk(piece, i == len(pieces) - 1, i + 1, reason))
    for event in events:
        EVENT_MODELS[event["type"]].model_validate(event)
    return json.loads(json.dumps(events))  # as the client reads them (and no later mutation shows)


def reassembled(events: list[dict[str, Any]]) -> Any:
    """What the SDK's ``client.responses.stream(...).get_final_response()`` makes of the events."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for event in events:
        state.handle_event(EVENT_MODELS[event["type"]].model_validate(event))  # type: ignore[arg-type]
    assert state._completed_response is not None
    return state._completed_response


def without_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def test_a_text_reply_is_one_message_item_with_the_usage() -> None:
    body = whole(parsing(), "Hello world")
    assert body["object"] == "response" and body["id"].startswith("resp_") and body["status"] == "completed"
    [message] = body["output"]
    assert message["id"].startswith("msg_")
    assert {k: v for k, v in message.items() if k != "id"} == {
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "Hello world", "annotations": []}],
    }
    assert body["output_text"] == Response.model_validate(body).output_text == "Hello world"
    assert body["usage"] == {
        "input_tokens": 11,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 9,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 20,
    }
    assert body["error"] is None and body["incomplete_details"] is None
    assert body["tool_choice"] == "auto" and body["tools"] == [] and body["parallel_tool_calls"] is True


def test_the_text_stream_follows_the_documented_order_and_equals_the_whole_reply() -> None:
    pieces = ["Hel", "lo", " world"]
    events = streamed(parsing(), pieces)
    types = [e["type"] for e in events]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == pieces
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]  # output_text.delta*
    assert collapsed == TEXT_ORDER
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2])
    assert events[-4]["text"] == "Hello world"
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output_text"] == "Hello world"
    assert without_ids(final["output"]) == without_ids(whole(parsing(), "Hello world")["output"])
    sdk = reassembled(events)
    assert sdk.output_text == "Hello world" and sdk.id == events[0]["response"]["id"]


def test_reasoning_is_an_item_with_a_summary_and_content_before_the_message() -> None:
    how = parsing(reasoning="qwen3")
    body = whole(how, "<think>\nIt is sunny.\n</think>\n\nSunny today.")
    reasoning, message = body["output"]
    assert reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == [{"type": "summary_text", "text": "It is sunny."}]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "It is sunny."}]
    assert message["content"][0]["text"] == "Sunny today." == body["output_text"]
    assert body["usage"]["output_tokens_details"]["reasoning_tokens"] == 3  # the test's counter: words
    events = streamed(how, ["<thi", "nk>\nIt is", " sunny.\n</th", "ink>\n\nSunny", " today."])
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    types = [e["type"] for e in events]
    reasoning_done = types.index("response.output_item.done")
    assert types[2:5] == [
        "response.output_item.added",
        "response.reasoning_summary_part.added",
        "response.content_part.added",
    ]
    assert types[reasoning_done - 4 : reasoning_done] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.reasoning_summary_text.done",
        "response.reasoning_summary_part.done",
    ]
    summary = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    raw = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert summary == raw == "It is sunny."
    assert reassembled(events).output_text == "Sunny today."


def test_required_tool_calls_are_function_call_items() -> None:
    how = parsing("required")
    text = '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_weather", "arguments": {"city": "Nice"}}]'
    body = whole(how, text)
    assert [o["type"] for o in body["output"]] == ["function_call", "function_call"]
    first = body["output"][0]
    assert first["id"].startswith("fc_") and first["call_id"].startswith("call_") and first["status"] == "completed"
    assert (first["name"], json.loads(first["arguments"])) == ("get_weather", {"city": "Paris"})
    assert body["output_text"] == ""
    events = streamed(how, [text[:20], text[20:]])
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(e["arguments"])["city"] for e in done] == ["Paris", "Nice"]
    sdk = reassembled(events)
    assert [json.loads(o.arguments)["city"] for o in sdk.output] == ["Paris", "Nice"]


def test_a_named_function_streams_its_arguments_as_they_come() -> None:
    how = parsing(NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}}))
    pieces = ['{"city"', ': "Pa', 'ris"}']
    events = streamed(how, pieces)
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [a["item"]["type"] for a in added] == ["function_call"] and added[0]["item"]["name"] == "get_weather"
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == pieces
    [call] = events[-1]["response"]["output"]
    assert json.loads(call["arguments"]) == {"city": "Paris"}
    assert without_ids([call]) == without_ids(whole(how, "".join(pieces))["output"])


def test_parsed_calls_follow_the_text_before_them() -> None:
    how = parsing("auto", parser="hermes")
    text = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = whole(how, text)
    assert [o["type"] for o in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"].strip() == "Sure."
    events = streamed(how, [text[i : i + 7] for i in range(0, len(text), 7)])
    assert without_ids(events[-1]["response"]["output"]) == without_ids(body["output"])


def test_a_reply_cut_by_max_output_tokens_is_incomplete() -> None:
    body = whole(parsing(), "Once upon", reason="length")
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete" and body["output_text"] == "Once upon"
    events = streamed(parsing(), ["Once", " upon"], reason="length")
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["type"] == "response.output_item.done" and events[-2]["item"]["status"] == "incomplete"


def test_an_empty_output_is_an_empty_message() -> None:
    assert whole(parsing(), "")["output"][0]["content"] == [{"type": "output_text", "text": "", "annotations": []}]
    events = streamed(parsing(), [""])
    assert [e["type"] for e in events] == [t for t in TEXT_ORDER if t != "response.output_text.delta"]


def test_a_failure_mid_stream_is_response_failed_with_the_error() -> None:
    reply = ResponsesReply(ECHOED, "m", parsing())
    reply.opening_events()
    reply.feed(chunk("partial", False, 1))
    events = reply.failed("internal", "the scheduler died")
    for event in events:
        EVENT_MODELS[event["type"]].model_validate(event)
    assert [e["type"] for e in events] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]
    assert [e["sequence_number"] for e in events] == [5, 6, 7, 8]  # after created, in_progress and 3 of the text
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["output_text"] == "partial"
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["error"] == {"code": "server_error", "message": "internal: the scheduler died"}
    assert reply.failed("too_many_requests", "slow down")[0]["response"]["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.parametrize(
    "body",
    [
        {"instructions": "be brief", "max_output_tokens": 5, "temperature": 0.0, "top_p": 0.9},
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "required"},
        {"text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}}},
        {"reasoning": {"effort": "high", "summary": "detailed"}, "previous_response_id": "resp_1", "store": False},
    ],
)
def test_the_echoed_request_fields_are_what_the_sdk_reads(body: dict[str, Any]) -> None:
    echoed = ResponsesRequest.model_validate({"model": "m", "input": "x", **body}).echoed()
    reply = ResponsesReply(echoed, "m", parsing())
    reply.add(chunk("ok", True, 1))
    parsed = Response.model_validate(reply.body()).model_dump(mode="json", by_alias=True, exclude_none=True)
    assert {name: parsed[name] for name in body} == body
