"""The Responses API request (no server): its input items as the chat template's messages
(instructions, function_call and function_call_output turns, reasoning dropped), its translation
into the chat path's GenerateReq (sampling, text.format, tools and tool_choice as constraints), and
its refusals, each naming the field as this API calls it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.openai_reply import OutputParsing
from tokenizer_proc.responses_protocol import ResponsesRequest, responses_errors, responses_param

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def request(**body: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate_json(json.dumps({"model": "m", **body}))


def messages(**body: Any) -> list[dict[str, Any]]:
    req = request(**body)
    reqs = req.chat_request(req.input_items()).generate_reqs()
    assert reqs[0].messages is not None
    return reqs[0].messages


def generate_req(parser: str | None = None, **body: Any) -> Any:
    req = request(**body)
    chat = req.chat_request(req.input_items())
    with responses_errors():
        return chat.generate_reqs(chat.tool_plan(parser))[0]


def test_a_string_input_is_one_user_message_after_the_instructions() -> None:
    assert messages(input="Hi there") == [{"role": "user", "content": "Hi there"}]
    assert messages(input="Hi", instructions="Answer in French.") == [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
    ]


def test_items_become_the_templates_messages() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Paris?"}],
        },
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "think"}]},
        # what an earlier reply's output looks like when the SDK sends it back
        {
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_a",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call", "call_id": "call_b", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "20 C"}]},
        {"type": "function_call", "call_id": "call_c", "name": "get_weather", "arguments": '{"city": "Nice"}'},
    ]
    assert messages(input=items, tools=[WEATHER]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [  # the template reads the arguments as an object (message_for_template)
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Lyon"}},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "call_b", "content": "20 C"},
        {  # a call after a tool's output is a new assistant turn
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "call_c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nice"}}}
            ],
        },
    ]


def test_sampling_fields_and_text_format_reach_the_generate_request() -> None:
    req = generate_req(input="x", max_output_tokens=7, temperature=0, top_p=0.5, stream=True)
    assert req.sampling_params == {"n": 1, "max_new_tokens": 7, "temperature": 0.0, "top_p": 0.5}
    assert req.stream
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    assert json.loads(generate_req(input="x", text=fmt).sampling_params["json_schema"]) == schema
    assert generate_req(input="x", text={"format": {"type": "json_object"}}).sampling_params["json_schema"] == (
        oai.JSON_OBJECT_SCHEMA
    )
    assert "json_schema" not in generate_req(input="x", text={"format": {"type": "text"}}).sampling_params
    # SGLang's extensions pass through (extra_body), e.g. the regex the e2e tests force formats with
    assert generate_req(input="x", regex="a+", top_k=3).sampling_params == {"n": 1, "regex": "a+", "top_k": 3}


def test_tools_and_tool_choice_become_the_chat_plan() -> None:
    template_tool = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
    required = generate_req(input="x", tools=[WEATHER], tool_choice="required")
    assert required.tools == [template_tool]
    calls = json.loads(required.sampling_params["json_schema"])  # constrained: an array of calls
    assert calls["items"]["properties"]["name"] == {"const": "get_weather"} and "maxItems" not in calls
    single = generate_req(input="x", tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.sampling_params["json_schema"])["maxItems"] == 1
    named = generate_req(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    assert json.loads(named.sampling_params["json_schema"]) == WEATHER["parameters"]
    none = generate_req(input="x", tools=[WEATHER], tool_choice="none")
    assert none.tools == [template_tool] and "json_schema" not in none.sampling_params
    body = request(input="x", tools=[WEATHER], tool_choice="auto")
    assert body.chat_request(body.input_items()).tool_plan("hermes").mode == "parse"


def test_the_chat_parsing_sees_the_reasoning_switches() -> None:
    body = request(input="x", separate_reasoning=False, chat_template_kwargs={"enable_thinking": False})
    chat = body.chat_request(body.input_items())
    assert not chat.separate_reasoning and not chat.enable_thinking
    assert isinstance(OutputParsing(chat.tool_plan(None)), OutputParsing)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        (
            {
                "input": [
                    {"role": "user", "content": "a"},
                    {"role": "user", "content": [{"type": "input_text", "text": "b"}, {"type": "input_file"}]},
                ]
            },
            "input[1].content[1]",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image"}]}]},
            "input[0].output[0]",
        ),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}}]},
            "input[0].arguments",
        ),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tools": [{**WEATHER, "name": "has space"}]}, "tools[0].name"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
        ({"input": []}, "input"),
        ({}, "input"),
    ],
)
def test_refusals_name_the_field_as_the_responses_api_does(body: dict[str, Any], param: str) -> None:
    with pytest.raises(oai.BadRequest) as exc:
        generate_req(**body)
    assert exc.value.param == param and exc.value.status == 400
    assert param.split("[")[0].split(".")[0] in exc.value.message
    assert "function.name" not in exc.value.message and "messages" not in exc.value.message


@pytest.mark.parametrize("field, value", [("background", True), ("conversation", "conv_1"), ("top_logprobs", 3)])
def test_known_fields_the_server_cannot_honour_are_refused_by_name(field: str, value: Any) -> None:
    with pytest.raises(oai.BadRequest) as exc:
        request(input="x", **{field: value})
    assert exc.value.param == field


def test_fields_clients_send_are_accepted() -> None:
    """What the SDK, Codex and the Agents SDK send beside the prompt: accepted (echoed or ignored)."""
    body = request(
        input="x",
        store=False,
        metadata={"k": "v"},
        user="u",
        truncation="auto",
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "low", "summary": "auto"},
        prompt_cache_key="abc",
        background=False,
        stream_options={"include_obfuscation": False},
    )
    echoed = body.echoed()
    assert echoed["store"] is False and echoed["metadata"] == {"k": "v"} and echoed["truncation"] == "auto"
    assert echoed["reasoning"] == {"effort": "low", "summary": "auto"}
    assert echoed["tool_choice"] == "auto" and echoed["tools"] == [] and echoed["text"] == {"format": {"type": "text"}}


def test_a_chat_refusal_is_worded_in_this_apis_names() -> None:
    schema = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}
    with pytest.raises(oai.BadRequest) as exc:
        generate_req(input="x", tools=[WEATHER], tool_choice="required", text=schema)
    assert exc.value.param == "tool_choice" and "text.format" in exc.value.message
    assert "response_format" not in exc.value.message
    assert responses_param("max_new_tokens") == "max_output_tokens"
    assert responses_param("json_schema") == "text.format"
    assert responses_param("temperature") == "temperature"
