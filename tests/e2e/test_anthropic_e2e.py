"""Anthropic's Messages API end to end with the official ``anthropic`` SDK (what Claude Code's own
client is built like) against the session's default-model server (``smollm2_server``), greedy:

* ``messages.create`` answers a trained model's question right, under any model name, and a stream
  (``messages.stream``) puts together the same message, its raw events in the documented order;
* a stop sequence taken from that answer ends the next one there, named as the stop reason;
* a forced tool call (``tool_choice`` type ``tool``) whose ``input`` validates against the tool's
  schema, streamed the same; its ``tool_result`` sent back is answered in text;
* ``messages.count_tokens`` equals the prompt the server counted for the same request
  (``input_tokens`` + ``cache_read_input_tokens``);
* a refusal is ``anthropic.BadRequestError`` naming the field, a wrong key ``AuthenticationError``;
* on the tiny Qwen3 server (``--reasoning-parser qwen3``), ``thinking`` blocks whole and streamed,
  and ``thinking`` disabled keeping everything text (a random model: ``regex`` forces the format).

Each test ends with the memory invariant (every request done, the KV pool whole)."""

from __future__ import annotations

import re
from typing import Any

import anthropic
import jsonschema
import pytest

from runtime.client import Client
from tests.support.real_model import API_KEY, SERVED_NAME
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, assert_idle_and_nothing_leaked
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.server_fixtures", "tests.support.real_model"]

MODEL = "claude-local"  # any name is served by the one model (Claude Code sends its own ids)
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}  # today's SDK has no temperature argument
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
RAW_EVENTS = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}
THINKING = r"<think>[a-z]{2,5}</think>[a-z]{2,5}"


def connect(server: Client, key: str) -> anthropic.Anthropic:
    address = server.server.http_address  # type: ignore[attr-defined]
    assert address is not None
    return anthropic.Anthropic(base_url=address, api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S)


@pytest.fixture(scope="module")
def claude(smollm2_server: ServedClient) -> anthropic.Anthropic:
    return connect(smollm2_server, API_KEY)


def streamed(client: anthropic.Anthropic, **kwargs: Any) -> tuple[Any, list[str]]:
    """The message ``messages.stream`` put together, and its raw events' types in order."""
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream if event.type in RAW_EVENTS]
        return stream.get_final_message(), kinds


def prompt_tokens(message: Any) -> int:
    return int(message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0))


def test_a_message_whole_and_streamed(claude: anthropic.Anthropic, smollm2_server: ServedClient) -> None:
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 16, "messages": FRANCE, **GREEDY}
    whole = claude.messages.create(**ask)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == SERVED_NAME
    [block] = whole.content
    assert block.type == "text" and "Paris" in block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert 0 < whole.usage.output_tokens <= 16 and whole.usage.cache_creation_input_tokens == 0

    final, kinds = streamed(claude, **ask)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    assert prompt_tokens(final) == prompt_tokens(whole)
    deltas = len(kinds) - 5
    assert deltas >= 1 and kinds == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]

    counted = claude.messages.count_tokens(model=MODEL, messages=FRANCE)  # type: ignore[arg-type]
    assert counted.input_tokens == prompt_tokens(whole)

    # a stop sequence taken from the answer ends the next one right before it
    words = block.text.split()
    stop = " " + words[min(2, len(words) - 1)]
    cut = claude.messages.create(**{**ask, "stop_sequences": [stop, "never written"]})
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == block.text[: block.text.index(stop)]
    assert_idle_and_nothing_leaked(smollm2_server)


def test_a_forced_tool_call_and_its_result(claude: anthropic.Anthropic, smollm2_server: ServedClient) -> None:
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": WEATHER_ASK,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        **GREEDY,
    }
    first = claude.messages.create(**ask)
    assert first.stop_reason == "tool_use"
    [call] = first.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    assert call.input["city"] == "Paris"  # a trained model fills it in from the question

    final, kinds = streamed(claude, **ask)
    [streamed_call] = final.content
    assert (streamed_call.name, streamed_call.input, final.stop_reason) == (call.name, call.input, "tool_use")
    assert kinds[1] == "content_block_start" and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]

    history = [
        *WEATHER_ASK,
        {"role": "assistant", "content": [call.model_dump(exclude_none=True)]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "It is 18 degrees and sunny."}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=24,
        messages=history,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "none"},
        **GREEDY,
    )
    [text] = answer.content
    assert text.type == "text" and text.text and answer.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])  # type: ignore[arg-type, list-item]
    assert counted.input_tokens == prompt_tokens(answer) > prompt_tokens(first)
    assert_idle_and_nothing_leaked(smollm2_server)


def test_refusals_are_the_sdks_errors_naming_the_field(
    claude: anthropic.Anthropic, smollm2_server: ServedClient
) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(
            model=MODEL,
            max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],  # type: ignore[list-item]
        )
    assert exc.value.status_code == 400
    assert isinstance(exc.value.body, dict) and exc.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in exc.value.message and "image" in exc.value.message
    with pytest.raises(anthropic.BadRequestError, match="temperature"):
        claude.messages.create(model=MODEL, max_tokens=8, messages=FRANCE, extra_body={"temperature": -1})  # type: ignore[arg-type]
    with pytest.raises(anthropic.AuthenticationError):
        connect(smollm2_server, "wrong-key").messages.create(model=MODEL, max_tokens=8, messages=FRANCE)  # type: ignore[arg-type]
    assert_idle_and_nothing_leaked(smollm2_server)


def test_thinking_blocks_through_the_reasoning_parser(qwen3_server: Client) -> None:
    client = connect(qwen3_server, "unused")
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 24,
        "messages": FRANCE,
        "thinking": {"type": "enabled", "budget_tokens": 16},
        "extra_body": {"temperature": 0, "regex": THINKING},
    }
    whole = client.messages.create(**ask)
    [thought, text] = whole.content
    assert thought.type == "thinking" and thought.signature == "" and text.type == "text"
    assert re.fullmatch(THINKING, f"<think>{thought.thinking}</think>{text.text}")
    final, kinds = streamed(client, **ask)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert kinds.count("content_block_start") == 2

    off = client.messages.create(**{**ask, "thinking": {"type": "disabled"}})
    [only] = off.content  # the template closed the thinking; the parser keeps the reply text
    assert only.type == "text" and re.fullmatch(THINKING, only.text)
    assert prompt_tokens(off) > prompt_tokens(whole)
    assert_idle_and_nothing_leaked(qwen3_server)
