"""Anthropic's Messages request translated onto the OpenAI chat request and its GenerateReq (no
server): system prompts, tool_use / tool_result turns, each tool_choice form, thinking, stop
sequences, sampling fields obeyed when given and left to the model's defaults when not, and the
refusals, each naming the field as Anthropic's body calls it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import GenerateReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.anthropic_protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_names,
    anthropic_wording,
)
from tokenizer_proc.openai_tools import ToolPlan

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "cache_control": {"type": "ephemeral"},
}
CLOCK = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def body(**fields: Any) -> MessagesRequest:
    return MessagesRequest.model_validate_json(
        json.dumps({"model": "claude-sonnet-4-5", "max_tokens": 16, "messages": ASK, **fields})
    )


def translate(parser: str | None = None, **fields: Any) -> tuple[GenerateReq, ToolPlan]:
    """The one GenerateReq a body becomes, and its tool plan against ``parser``."""
    with anthropic_wording():
        chat = body(**fields).chat_request()
        plan = chat.tool_plan(parser)
        [req] = chat.generate_reqs(plan)
    return req, plan


def refusal(parser: str | None = None, **fields: Any) -> oai.BadRequest:
    with pytest.raises(oai.BadRequest) as exc:
        translate(parser, **fields)
    assert exc.value.status == 400
    return exc.value


def test_a_plain_request_leaves_sampling_to_the_model_defaults() -> None:
    req, plan = translate()
    assert req.messages == [{"role": "user", "content": "What is the weather in Paris?"}]
    # no temperature, top_p or top_k: the model's sampling defaults apply (today's SDK sends none)
    assert req.sampling_params == {"n": 1, "max_new_tokens": 16}
    assert req.tools is None and req.chat_template_kwargs is None and not req.stream
    assert plan.mode == "none"


def test_sampling_fields_and_stop_sequences_are_obeyed_when_given() -> None:
    req, _ = translate(
        temperature=0, top_p=0.5, top_k=3, stop_sequences=["END", "\n\n"], stream=True, metadata={"user_id": "u"}
    )
    assert req.sampling_params == {
        "n": 1,
        "max_new_tokens": 16,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 3,
        "stop": ["END", "\n\n"],
    }
    assert req.stream
    # SGLang's extensions as on /v1/chat/completions (the e2e tests force formats with regex)
    req, _ = translate(regex="[a-z]+", seed=7, deadline_s=5.0)
    assert req.sampling_params is not None and req.sampling_params["regex"] == "[a-z]+"
    assert req.sampling_params["seed"] == 7 and req.deadline_s == 5.0


def test_system_as_text_or_blocks_and_text_blocks_joined() -> None:
    req, _ = translate(system="Be brief.")
    assert req.messages is not None and req.messages[0] == {"role": "system", "content": "Be brief."}
    blocks = [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind.", "cache_control": {}}]
    user = [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Hello"}]
    req, _ = translate(system=blocks, messages=[{"role": "user", "content": user}])
    assert req.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": "<reminder>\nHello"},
    ]


def test_tool_use_and_tool_result_turns_become_the_templates_messages() -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 degrees"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "no clock"}, {"type": "text", "text": "here"}],
                    "is_error": True,
                },
                {"type": "text", "text": "And so?"},
            ],
        },
    ]
    req, _ = translate(messages=history, tools=[WEATHER, CLOCK])
    assert req.messages is not None
    assert req.messages[1] == {
        "role": "assistant",
        "content": "Checking.",
        "reasoning_content": "look it up",
        # the template receives the arguments as an object (message_for_template)
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_time", "arguments": {}}},
        ],
    }
    assert req.messages[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "toolu_2", "name": "get_time", "content": "no clock\nhere", "is_error": True},
        {"role": "user", "content": "And so?"},
    ]
    assert req.tools == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city now.",
                "parameters": WEATHER["input_schema"],
            },
        },
        {"type": "function", "function": {"name": "get_time", "parameters": CLOCK["input_schema"]}},
    ]


def test_consecutive_turns_of_one_role_are_one_turn() -> None:
    turns = [
        {"role": "user", "content": "one"},
        {"role": "user", "content": [{"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "three"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
    ]
    req, _ = translate(messages=turns, tools=[CLOCK])
    assert req.messages is not None
    assert [(m["role"], m["content"]) for m in req.messages] == [
        ("user", "one\ntwo"),
        ("assistant", "three"),
        ("tool", ""),
    ]
    assert req.messages[1]["tool_calls"][0]["id"] == "t"


@pytest.mark.parametrize(
    "choice, parser, mode, named",
    [
        ({"type": "auto"}, "hermes", "parse", None),
        ({"type": "any"}, None, "required", None),
        ({"type": "tool", "name": "get_time"}, None, "named", "get_time"),
        ({"type": "none"}, None, "none", None),
    ],
)
def test_tool_choice_forms(choice: dict[str, Any], parser: str | None, mode: str, named: str | None) -> None:
    req, plan = translate(parser, tools=[WEATHER, CLOCK], tool_choice=choice)
    assert plan.mode == mode and plan.named == named
    assert req.tools is not None and len(req.tools) == 2
    constrained = mode in ("required", "named")
    assert req.sampling_params is not None and ("json_schema" in req.sampling_params) == constrained
    if named:  # decoding follows the named tool's input_schema
        assert json.loads(req.sampling_params["json_schema"]) == CLOCK["input_schema"]


def test_disable_parallel_tool_use_allows_one_call() -> None:
    def schema(choice: dict[str, Any]) -> dict[str, Any]:
        req, _ = translate(tools=[WEATHER, CLOCK], tool_choice=choice)
        assert req.sampling_params is not None
        return dict(json.loads(req.sampling_params["json_schema"]))

    assert schema({"type": "any", "disable_parallel_tool_use": True})["maxItems"] == 1
    assert "maxItems" not in schema({"type": "any"})


@pytest.mark.parametrize(
    "thinking, enabled",
    [
        ({"type": "enabled", "budget_tokens": 1024}, True),
        ({"type": "adaptive"}, True),
        ({"type": "disabled"}, False),
    ],
)
def test_thinking_sets_the_templates_enable_thinking(thinking: dict[str, Any], enabled: bool) -> None:
    req, _ = translate(thinking=thinking, chat_template_kwargs={"custom": 1})
    assert req.chat_template_kwargs == {"custom": 1, "enable_thinking": enabled}
    assert body(thinking=thinking).chat_request().enable_thinking is enabled  # what the reasoning parser is told


def test_output_config_format_constrains_the_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for fields in ({"output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "low"}},):
        req, _ = translate(**fields)
        assert req.sampling_params is not None and json.loads(req.sampling_params["json_schema"]) == schema
    req, _ = translate(output_format={"type": "json_schema", "schema": schema})
    assert req.sampling_params is not None and json.loads(req.sampling_params["json_schema"]) == schema


@pytest.mark.parametrize(
    "fields, param, words",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]}]},
            "messages[0].content[1]",
            "image blocks are not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}],
                    }
                ]
            },
            "messages[0].content[0].content[0]",
            "document blocks",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text",
            "string",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x"}]}]},
            "messages[1].content[0].input",
            "required",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": "The answer is"}]}, "messages[1]", "prefill"),
        ({"messages": [{"role": "user", "content": []}]}, "messages[0].content", "empty"),
        ({"system": [{"type": "image"}]}, "system[0].type", "'text'"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type", "server tool"),
        ({"tools": [{"name": "x"}]}, "tools[0].input_schema", "required"),
        ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name", "letters, digits"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name", "required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "x"}}, "tool_choice", "tool 'x' is not among"),
        ({"tools": [WEATHER], "tool_choice": {"type": "auto"}}, "tool_choice", "'any' or a named tool"),
        ({"tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
        ({"tool_choice": {"type": "some"}}, "tool_choice.type", "'auto'"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "any"}, "regex": "x"},
            "tool_choice",
            "tool_choice 'any' constrains the output",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "get_weather"},
                "output_config": {"format": {"type": "json_schema", "schema": {}}},
            },
            "tool_choice",
            "tool 'get_weather' constrains the output; it cannot be combined with output_config.format",
        ),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens", "required"),
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers", "not supported"),
    ],
)
def test_refusals_name_the_field_as_anthropic_does(fields: dict[str, Any], param: str, words: str) -> None:
    exc = refusal(**fields)
    assert exc.param == param and param in exc.message, exc.message
    assert words in exc.message, exc.message


def test_max_tokens_is_required_as_anthropic_has_it() -> None:
    with pytest.raises(Exception) as exc:
        MessagesRequest.model_validate_json(json.dumps({"model": "m", "messages": ASK}))
    assert "max_tokens" in str(exc.value)
    # count_tokens takes the same body without it
    CountTokensRequest.model_validate_json(json.dumps({"model": "m", "messages": ASK})).chat_request()


def test_the_shared_paths_refusals_use_anthropics_names() -> None:
    assert anthropic_names(FieldRef("max_new_tokens")) == "max_tokens"
    assert anthropic_names(FieldRef("stop", sampling=True)) == "stop_sequences"
    assert anthropic_names(FieldRef("prompt")) == "messages"
    assert anthropic_names(FieldRef("temperature", sampling=True)) == "temperature"
