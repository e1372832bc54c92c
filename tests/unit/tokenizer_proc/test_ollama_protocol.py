"""Ollama's request bodies onto the server's ``GenerateReq``, without a server: ``options`` mapped to
sampling parameters (the runner's ones ignored, the samplers this server lacks refused unless off),
``format`` as "json" or a schema, ``think``, tool definitions and a tool round trip's messages,
``/api/generate``'s prompt rendered as a chat or sent raw, and the refusals, each naming the field as
Ollama's body calls it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from runtime.protocol.field_refs import FieldRef
from runtime.protocol.messages import GenerateReq
from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import loc_path
from tokenizer_proc.ollama_protocol import (
    ChatBody,
    GenerateBody,
    ShowBody,
    names_model,
    ollama_name,
    ollama_names,
    raw_prompt,
)

HI = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def chat_req(body: dict[str, Any], reasoning_parser: str | None = None, tool_parser: str | None = None) -> GenerateReq:
    request = ChatBody.model_validate_json(json.dumps({"model": "m", "messages": HI, **body}))
    chat = request.openai_request(reasoning_parser)
    [req] = chat.generate_reqs(chat.tool_plan(tool_parser))
    return req


def generate_req(body: dict[str, Any], reasoning_parser: str | None = None) -> GenerateReq:
    request = GenerateBody.model_validate_json(json.dumps({"model": "m", **body}))
    chat, raw = request.openai_request(reasoning_parser)
    [req] = chat.generate_reqs()
    return req if raw is None else raw_prompt(req, raw)


def refusal(make: Any, *args: Any) -> oai.BadRequest:
    with pytest.raises(oai.BadRequest) as info:
        make(*args)
    return info.value


def test_options_map_to_sampling_params() -> None:
    options = {
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "num_predict": 12,
        "stop": ["\n\n", "User:"],
        "seed": 7,
        "repeat_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        # the runner's: accepted, not passed on
        "num_ctx": 4096,
        "num_thread": 8,
        "num_gpu": 99,
        "use_mmap": True,
        "mirostat": 0,  # off: accepted
        "typical_p": 1.0,
    }
    req = chat_req({"options": options})
    assert req.sampling_params == {
        "n": 1,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "max_new_tokens": 12,
        "stop": ["\n\n", "User:"],
        "seed": 7,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    assert req.messages == HI and req.stream  # streamed inside the server: the timings need it
    assert req.chat_template_kwargs is None and req.tools is None


@pytest.mark.parametrize("num_predict", [-1, -2, None])
def test_no_limit_leaves_the_servers_default(num_predict: int | None) -> None:
    options = {} if num_predict is None else {"num_predict": num_predict}
    assert "max_new_tokens" not in (chat_req({"options": options}).sampling_params or {})


@pytest.mark.parametrize(
    "options, field",
    [
        ({"num_predict": -3}, "options.num_predict"),
        ({"mirostat": 2}, "options.mirostat"),
        ({"tfs_z": 0.5}, "options.tfs_z"),
        ({"typical_p": 0.7}, "options.typical_p"),
    ],
)
def test_options_it_cannot_honour_are_refused_naming_them(options: dict[str, Any], field: str) -> None:
    exc = refusal(chat_req, {"options": options})
    assert exc.param == field and exc.message.startswith(field) and exc.status == 400


def test_a_mistyped_option_is_refused_naming_it() -> None:
    """Types stay strict: the route's body reader words this error as ``options.temperature: ...``."""
    with pytest.raises(ValidationError) as info:
        chat_req({"options": {"temperature": "hot"}})
    assert loc_path(info.value.errors()[0]["loc"]) == "options.temperature"


def test_sglang_constraints_ride_in_options() -> None:
    req = chat_req({"options": {"regex": "(yes|no)", "temperature": 0}})
    assert req.sampling_params is not None and req.sampling_params["regex"] == "(yes|no)"


def test_format_json_and_schema() -> None:
    assert chat_req({"format": "json"}).sampling_params == {"n": 1, "json_schema": oai.JSON_OBJECT_SCHEMA}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    params = chat_req({"format": schema}).sampling_params or {}
    assert json.loads(params["json_schema"]) == schema
    assert "json_schema" not in (chat_req({"format": ""}).sampling_params or {})
    exc = refusal(chat_req, {"format": "yaml"})
    assert exc.param == "format" and "yaml" in exc.message


def test_think() -> None:
    off = chat_req({"think": False}, "qwen3")
    assert off.chat_template_kwargs == {"enable_thinking": False}
    for think in (True, "high", None):
        assert chat_req({"think": think}, "qwen3").chat_template_kwargs is None
    exc = refusal(chat_req, {"think": True})  # no --reasoning-parser
    assert exc.param == "think" and "does not support thinking" in exc.message
    assert refusal(chat_req, {"think": "very"}, "qwen3").param == "think"
    # off: the reasoning is not split out (Ollama puts nothing in ``thinking``)
    body = ChatBody.model_validate_json(json.dumps({"model": "m", "messages": HI, "think": False}))
    assert not body.openai_request("qwen3").separate_reasoning
    body = ChatBody.model_validate_json(json.dumps({"model": "m", "messages": HI}))
    assert body.openai_request("qwen3").separate_reasoning


def test_tools_and_a_tool_round_trip() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": "",
            "thinking": "look it up",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "-3 C", "tool_name": "get_weather"},
    ]
    req = chat_req({"messages": messages, "tools": [WEATHER]}, tool_parser="hermes")
    assert req.tools == [WEATHER]
    assert req.messages is not None
    system, user, assistant, tool = req.messages
    assert system == {"role": "system", "content": "Be brief."} and user["content"] == "Weather in Oslo?"
    assert assistant["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]
    assert assistant["reasoning_content"] == "look it up"
    assert tool == {"role": "tool", "content": "-3 C", "tool_name": "get_weather", "name": "get_weather"}
    # Ollama's type defaults to function; an empty list (what the client sends) is no tools
    untyped = chat_req({"tools": [{"function": WEATHER["function"]}]})
    assert untyped.tools == [WEATHER]
    assert chat_req({"tools": []}).tools is None


def test_images_are_refused_naming_the_message() -> None:
    exc = refusal(chat_req, {"messages": [{"role": "user", "content": "what is it?", "images": ["aGk="]}]})
    assert exc.param == "messages[0].images"


def test_generate_renders_the_prompt_as_a_chat() -> None:
    req = generate_req({"prompt": "Why is the sky blue?", "system": "Be brief.", "options": {"num_predict": 5}})
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    assert req.text is None and req.sampling_params == {"n": 1, "max_new_tokens": 5}


def test_raw_generate_sends_the_prompt_as_text() -> None:
    req = generate_req({"prompt": "<|im_start|>user\nhi", "raw": True, "format": "json"})
    assert req.text == "<|im_start|>user\nhi" and req.messages is None and req.tools is None
    assert req.sampling_params == {"n": 1, "json_schema": oai.JSON_OBJECT_SCHEMA}
    assert refusal(generate_req, {"prompt": "x", "raw": True, "system": "s"}).param == "system"
    assert refusal(generate_req, {"prompt": "x", "raw": True, "think": True}, "qwen3").param == "think"


@pytest.mark.parametrize(
    "field, value", [("template", "{{ .Prompt }}"), ("suffix", "}"), ("images", ["aGk="]), ("context", [1, 2])]
)
def test_generate_fields_it_cannot_honour_are_refused(field: str, value: Any) -> None:
    exc = refusal(generate_req, {"prompt": "x", field: value})
    assert exc.param == field and exc.message.startswith(field + ":")


def test_empty_values_of_refused_fields_pass() -> None:
    """What a client sends by default (an empty suffix, the context it got back) is no request for them."""
    req = generate_req({"prompt": "x", "suffix": "", "context": [], "logprobs": False, "keep_alive": "5m"})
    assert req.messages == [{"role": "user", "content": "x"}]


def test_load_call() -> None:
    assert GenerateBody.model_validate_json('{"model": "m"}').loads_only
    assert GenerateBody.model_validate_json('{"model": "m", "prompt": ""}').loads_only
    assert not GenerateBody.model_validate_json('{"model": "m", "prompt": "x"}').loads_only


def test_stream_is_on_unless_turned_off() -> None:
    assert ChatBody.model_validate_json('{"model": "m"}').stream
    assert not ChatBody.model_validate_json('{"model": "m", "stream": false}').stream


def test_model_names() -> None:
    assert ollama_name("smollm2") == "smollm2:latest" and ollama_name("qwen3:0.6b") == "qwen3:0.6b"
    assert ollama_name("/models/a:b/x") == "/models/a:b/x:latest"
    for name in ("smollm2", "smollm2:latest", "smollm2:q4", "/ckpt/folder"):
        assert names_model(name, "smollm2", "/ckpt/folder"), name
    for name in ("llama3", "smollm2x:latest", "latest"):
        assert not names_model(name, "smollm2", "/ckpt/folder"), name
    assert ShowBody.model_validate_json('{"name": "old"}').model_name == "old"


def test_refusals_of_the_shared_path_name_ollamas_fields() -> None:
    chat, generate = ollama_names(True), ollama_names(False)
    assert chat(FieldRef("max_new_tokens")) == "options.num_predict"
    assert chat(FieldRef("repetition_penalty", True)) == "options.repeat_penalty"
    assert chat(FieldRef("temperature", True)) == "options.temperature"
    assert chat(FieldRef("json_schema", True)) == "format"
    assert chat(FieldRef("input_ids")) == "messages" and generate(FieldRef("input_ids")) == "prompt"
