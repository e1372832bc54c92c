"""OpenAI's Responses API end to end, through the official openai SDK (``client.responses``) on the
session's default-model server (SmolLM2-135M-Instruct, CPU, fp32), greedy:

* a text reply, the same request streamed (``stream=True``: the typed events in their documented
  order) and through the SDK's ``client.responses.stream`` helper, which reassembles the final
  response from the events: the same text all three ways;
* a named function (constrained decoding): a ``function_call`` item whose arguments are valid
  for the tool's schema; its output sent back as a ``function_call_output`` item continuing the
  response by ``previous_response_id`` gives a text answer;
* ``previous_response_id``: the follow-up's prompt holds the earlier turn (its input tokens grow
  by at least the earlier input and output); retrieve and delete, then a 404;

and on the tiny Qwen3 server (``--reasoning-parser qwen3``; a random model, so a ``regex`` forces
``<think>...</think>``), the reasoning as a ``reasoning`` item, whole and streamed alike. Every test
ends with the KV pool whole (the memory invariant).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from runtime.client import Client
from tests.support.real_model import API_KEY, CLIENT_TIMEOUT_S, SERVED_NAME
from tests.support.server_fixtures import assert_idle_and_nothing_leaked
from tests.support.server_process import ServedClient
from tests.unit.tokenizer_proc.test_responses_reply import TEXT_ORDER

pytest_plugins = ["tests.support.server_fixtures", "tests.support.real_model"]

GREEDY: dict[str, Any] = {"temperature": 0, "max_output_tokens": 16}
ASK = "What is the capital of France? Answer in one sentence."
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now.", "parameters": CITY}


@pytest.fixture(scope="module")
def client(smollm2_server: ServedClient) -> openai.OpenAI:
    assert smollm2_server.server.http_address is not None
    return openai.OpenAI(
        base_url=smollm2_server.server.http_address + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def test_text_whole_streamed_and_through_the_stream_helper_agree(
    client: openai.OpenAI, smollm2_server: ServedClient
) -> None:
    whole = client.responses.create(model=SERVED_NAME, input=ASK, instructions="Be brief.", **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == SERVED_NAME
    assert whole.status in ("completed", "incomplete") and whole.output_text.strip()
    assert whole.output[-1].type == "message" and whole.output[-1].content[0].type == "output_text"
    assert whole.usage is not None and whole.usage.output_tokens <= 16
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details is not None and whole.incomplete_details.reason == "max_output_tokens"

    events = list(
        client.responses.create(model=SERVED_NAME, input=ASK, instructions="Be brief.", stream=True, **GREEDY)
    )
    types = [e.type for e in events]
    collapsed = [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]
    assert collapsed == [*TEXT_ORDER[:-1], f"response.{whole.status}"]  # (the documented order, its end the status)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-1].response.output_text

    with client.responses.stream(model=SERVED_NAME, input=ASK, instructions="Be brief.", **GREEDY) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status
    assert_idle_and_nothing_leaked(smollm2_server)


def test_a_named_function_call_and_its_output_continue_the_response(
    client: openai.OpenAI, smollm2_server: ServedClient
) -> None:
    ask = "What is the weather in Paris?"
    first = client.responses.create(
        model=SERVED_NAME,
        input=ask,
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=24,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, CITY)
    assert first.status == "completed" and first.output_text == ""

    streamed = list(
        client.responses.create(
            model=SERVED_NAME,
            input=ask,
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=24,
            stream=True,
        )
    )
    assert "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta") == call.arguments

    answer = client.responses.create(
        model=SERVED_NAME,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny."}],
        tools=[WEATHER],
        tool_choice="none",
        **GREEDY,
    )
    assert [o.type for o in answer.output] == ["message"] and answer.output_text.strip()
    assert answer.usage is not None and first.usage is not None
    assert answer.usage.input_tokens > first.usage.input_tokens  # SmolLM2's template shows the tool's output
    assert_idle_and_nothing_leaked(smollm2_server)


def test_previous_response_id_sees_the_earlier_turn_then_retrieve_and_delete(
    client: openai.OpenAI, smollm2_server: ServedClient
) -> None:
    first = client.responses.create(model=SERVED_NAME, input="My name is Ada. Say hello to me.", **GREEDY)
    alone = client.responses.create(model=SERVED_NAME, input="What is my name?", store=False, **GREEDY)
    second = client.responses.create(
        model=SERVED_NAME, previous_response_id=first.id, input="What is my name?", **GREEDY
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None and alone.usage is not None
    # the follow-up's prompt is the earlier prompt, its answer, then the question asked alone
    assert second.usage.input_tokens >= first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens - alone.usage.input_tokens >= first.usage.output_tokens

    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text and got.usage == second.usage
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(alone.id)  # store=False
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError, match="previous_response_id"):
        client.responses.create(model=SERVED_NAME, previous_response_id=second.id, input="Again?", **GREEDY)
    with pytest.raises(openai.BadRequestError, match=r"input\[0\]\.content\[0\]"):
        client.responses.create(
            model=SERVED_NAME,
            input=[{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}],
        )
    assert_idle_and_nothing_leaked(smollm2_server)


def test_reasoning_is_a_reasoning_item_whole_and_streamed(qwen3_server: Client) -> None:
    assert qwen3_server.server.http_address is not None
    qwen = openai.OpenAI(
        base_url=qwen3_server.server.http_address + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )
    model = qwen.models.list().data[0].id
    ask: dict[str, Any] = {
        "model": model,
        "input": "Think, then answer.",
        "reasoning": {"effort": "low", "summary": "auto"},
        "temperature": 0,
        "max_output_tokens": 40,
        "extra_body": {"regex": r"<think>[a-z]{2,5}( [a-z]{2,5})?</think>[a-z]{2,5}"},
    }
    whole = qwen.responses.create(**ask)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and message.type == "message"
    thought = reasoning.summary[0].text
    assert thought and reasoning.content is not None and reasoning.content[0].text == thought
    assert "<think>" not in whole.output_text and "</think>" not in thought
    assert (
        whole.usage is not None and 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    )

    events = list(qwen.responses.create(stream=True, **ask))
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (summary, text) == (thought, whole.output_text)
    assert events[-1].type == "response.completed"
    assert_idle_and_nothing_leaked(qwen3_server)
