"""The OpenAI request models and their translation into GenerateReq (no server): batches
of prompts, field names in errors, what is refused and what is ignored, tools and what they ask
of decoding, and the metric gauges' arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http.body import loc_path as _loc_path
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.native_protocol import NativeGenerateReq


def completion(**body: Any) -> oai.CompletionRequest:
    return oai.CompletionRequest.model_validate_json(json.dumps({"model": "m", **body}))


def test_prompts_become_one_request_each_with_the_sampling_params() -> None:
    reqs = completion(
        prompt=["a", "b"], max_tokens=5, temperature=0, stop="x", n=2, logprobs=3, ignore_eos=True, top_k=4
    ).generate_reqs()
    assert [r.text for r in reqs] == ["a", "b"] and reqs[0].rid != reqs[1].rid
    assert reqs[0].sampling_params == {
        "n": 2,
        "max_new_tokens": 5,
        "temperature": 0.0,
        "stop": "x",
        "top_k": 4,
        "ignore_eos": True,
    }
    assert reqs[0].return_logprob and reqs[0].top_logprobs_num == 3
    assert [r.input_ids for r in completion(prompt=[1, 2]).generate_reqs()] == [[1, 2]]
    assert [r.input_ids for r in completion(prompt=[[1], [2, 3]]).generate_reqs()] == [[1], [2, 3]]
    # OpenAI's default max_tokens for completions; chat leaves it to the server (fit to the context)
    assert completion(prompt="a").generate_reqs()[0].sampling_params == {"n": 1, "max_new_tokens": 16}
    chat = oai.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.generate_reqs()[0].sampling_params == {"n": 1}
    assert chat.generate_reqs()[0].messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "a", "suffix": "z"}, "suffix"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": "a", "functions": [{"name": "f"}]}, "functions"),
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": []}, "prompt"),
    ],
)
def test_unsupported_or_inconsistent_fields_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(oai.BadRequest) as exc:
        completion(**body).generate_reqs()
    assert exc.value.param == param and exc.value.status == 400


def test_validation_errors_name_the_field_path() -> None:
    with pytest.raises(ValidationError) as exc:
        oai.ChatCompletionRequest.model_validate_json('{"model": "m", "messages": [{"content": "x"}]}')
    assert _loc_path(exc.value.errors()[0]["loc"]) == "messages[0].role"
    with pytest.raises(ValidationError) as exc:
        completion(prompt=5)
    assert _loc_path(exc.value.errors()[0]["loc"]) == "prompt"
    with pytest.raises(ValidationError):  # strict: a string is never a number
        completion(prompt="a", temperature="0.5")


def test_server_names_map_back_to_openai_names() -> None:
    assert oai.openai_param("max_new_tokens", chat=False) == "max_tokens"
    assert oai.openai_param("max_new_tokens", chat=True) == "max_completion_tokens"
    assert oai.openai_param("top_logprobs_num", chat=False) == "logprobs"
    assert oai.openai_param("top_logprobs_num", chat=True) == "top_logprobs"
    assert oai.openai_param("temperature", chat=True) == "temperature"


def test_kv_usage_gauge_from_a_dp_controllers_sums() -> None:
    m = Metrics("m")
    m.set_scheduler_gauges(
        {
            "num_running": 3,
            "num_queued": 2,
            "max_total_tokens": 100,
            "available_tokens": 60,
            "evictable_tokens": 15,
            "cache_hit_rate": 0.5,
        }
    )
    text = m.render().decode()
    assert 'tinyserve:token_usage{model_name="m"} 0.25' in text
    assert 'tinyserve:num_running_reqs{model_name="m"} 3.0' in text
    assert "_created" not in text


def test_constraints_are_checked_before_queueing_and_refused_without_a_grammar_backend() -> None:
    """The tokenizer's RequestBuilder: a constraint that parses goes through, one that does not is
    refused naming its kind, and ``--grammar-backend none`` refuses every constrained request."""
    import pytest

    from runtime.protocol.messages import GenerateReq
    from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder

    limits = ModelLimits(vocab_size=100, context_len=1000, max_req_input_len=500, max_total_tokens=1000)
    builder = RequestBuilder(tokenizer=None, limits=limits)
    ok = GenerateReq(rid="a", input_ids=[1, 2], sampling_params={"regex": "[ab]+", "n": 2})
    built = builder.build(ok)
    assert [r.sampling_params.regex for r in built] == ["[ab]+", "[ab]+"]
    with pytest.raises(Rejected) as bad:
        builder.build(GenerateReq(rid="b", input_ids=[1], sampling_params={"ebnf": "root ::= foo"}))
    assert bad.value.param == "ebnf" and 'Rule "foo" is not defined' in bad.value.message
    off = RequestBuilder(tokenizer=None, limits=limits, grammar_backend="none")
    with pytest.raises(Rejected) as refused:
        off.build(ok)
    assert refused.value.param == "regex" and "--grammar-backend none" in refused.value.message
    assert off.build(GenerateReq(rid="c", input_ids=[1]))  # unconstrained requests are served


def chat_request(**body: Any) -> oai.ChatCompletionRequest:
    return oai.ChatCompletionRequest.model_validate_json(
        json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})
    )


def test_unknown_fields_are_ignored_with_one_warning_per_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger=oai.__name__):
        for _ in range(3):
            req = chat_request(
                brand_new_field=1, another_one={"x": 2}, user="u", metadata={"a": "b"}, store=True, stream_options=None
            )
            assert req.generate_reqs()[0].sampling_params == {"n": 1}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2 and any("'brand_new_field'" in w for w in warned)
    assert not any("'user'" in w or "'metadata'" in w for w in warned)  # known, accepted and ignored
    with pytest.raises(oai.BadRequest) as exc:
        chat_request(audio={"voice": "x"})
    assert exc.value.param == "audio"
    with pytest.raises(ValidationError):  # types stay strict
        chat_request(max_tokens="3")


def test_echo_with_logprobs_asks_for_the_prompts_logprobs() -> None:
    [with_logprobs] = completion(prompt="a", echo=True, logprobs=2, max_tokens=0).generate_reqs()
    assert with_logprobs.logprob_start_len == 0 and with_logprobs.return_logprob
    assert with_logprobs.sampling_params["max_new_tokens"] == 0
    assert completion(prompt="a", echo=True).generate_reqs()[0].logprob_start_len == -1
    assert completion(prompt="a", logprobs=2).generate_reqs()[0].logprob_start_len == -1


def test_logit_bias_and_stream_options_pass_through() -> None:
    req = chat_request(
        logit_bias={"5": -100.0}, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert req.generate_reqs()[0].sampling_params == {"n": 1, "logit_bias": {"5": -100.0}}
    assert req.include_usage and req.continuous_usage


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "clock"}}  # no parameters: any object


def test_tool_choice_decides_the_constraint_and_how_calls_are_read() -> None:
    from tokenizer_proc.openai_tools import constrained_calls

    auto = chat_request(tools=[WEATHER]).tool_plan("hermes")
    assert auto.mode == "parse" and auto.constraint == {} and auto.names == ("weather",)
    [req] = chat_request(tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}).generate_reqs(auto)
    assert req.tools == [WEATHER] and req.chat_template_kwargs == {"enable_thinking": False}
    assert chat_request(tools=[WEATHER]).tool_plan(None).mode == "none"  # no parser: the text as it is
    assert chat_request(tools=[WEATHER], tool_choice="none").tool_plan("hermes").mode == "none"
    assert chat_request(tools=[WEATHER]).tool_plan("mistral").keep_special_tokens  # [TOOL_CALLS] is special

    required = chat_request(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    plan = required.tool_plan(None)
    schema = json.loads(plan.constraint["json_schema"])
    assert schema["type"] == "array" and schema["minItems"] == schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "weather"}, {"const": "clock"}]
    assert required.generate_reqs(plan)[0].sampling_params["json_schema"] == plan.constraint["json_schema"]
    calls = constrained_calls(
        plan, '[{"name": "weather", "arguments": {"city": "Oslo"}}, {"name": "clock", "arguments": {}}]'
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls or []] == [("weather", {"city": "Oslo"}), ("clock", {})]
    assert constrained_calls(plan, '[{"name": "weather", "argu') is None  # cut by max_tokens

    named = chat_request(tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "weather"}})
    plan = named.tool_plan(None)
    assert plan.mode == "named" and json.loads(plan.constraint["json_schema"]) == WEATHER["function"]["parameters"]
    [call] = constrained_calls(plan, '{"city": "Lima"}') or []
    assert (call.name, json.loads(call.arguments)) == ("weather", {"city": "Lima"})


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),  # auto asked for, no parser
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "two words"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_inconsistent_tools_are_refused_by_name(body: dict[str, Any], param: str) -> None:
    with pytest.raises(oai.BadRequest) as exc:
        req = chat_request(**body)
        req.generate_reqs(req.tool_plan(None))
    assert exc.value.param == param


def test_assistant_tool_calls_reach_the_template_with_object_arguments() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}}
    req = oai.ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            ],
        }
    )
    messages = req.generate_reqs()[0].messages or []
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}
    assert messages[1]["content"] == "" and messages[2]["tool_call_id"] == "call_1"


def test_server_deadline_fields() -> None:
    assert completion(prompt="a").generate_reqs()[0].deadline_s is None
    assert completion(prompt="a", timeout=2).generate_reqs()[0].deadline_s == 2.0
    assert completion(prompt="a", timeout=2, deadline_s=0.5).generate_reqs()[0].deadline_s == 0.5
    chat = oai.ChatCompletionRequest.model_validate(
        {"model": "m", "timeout": 1.5, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert chat.generate_reqs()[0].deadline_s == 1.5
    native = NativeGenerateReq.model_validate_json('{"text": "a", "deadline_s": 3}')
    assert native.generate_reqs()[0][0].deadline_s == 3.0


def test_overloaded_is_503_with_retry_after() -> None:
    from tokenizer_proc.http.errors import STATUS_OF_CODE, error_response

    response = error_response(STATUS_OF_CODE["overloaded"], "full", "overloaded")
    assert response.status_code == 503 and response.headers["retry-after"] == "1"
    assert json.loads(response.body)["error"]["code"] == "overloaded"
    assert "retry-after" not in error_response(503, "x", "out_of_memory").headers


def test_refusals_are_counted_by_reason() -> None:
    m = Metrics("m")
    m.refused_request("overloaded")
    assert 'tinyserve:requests_refused_total{model_name="m",reason="overloaded"} 1.0' in m.render().decode()


def test_priority_travels_from_every_body_to_each_scheduler_request() -> None:
    """``priority`` (SGLang's extra field) reaches the GenerateReq from both OpenAI bodies and
    /generate, and every sample's TokenizedGenerateReq; a bool is not an int, and a value past 64
    bits (which the scheduler's frame could not carry) is refused naming the field."""
    from runtime.protocol.messages import GenerateReq
    from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder

    assert [r.priority for r in completion(prompt=["a", "b"], priority=3).generate_reqs()] == [3, 3]
    assert completion(prompt="a").generate_reqs()[0].priority == 0
    assert chat_request(priority=-2).generate_reqs()[0].priority == -2
    native, _ = NativeGenerateReq.model_validate({"text": ["a", "b"], "priority": 7}).generate_reqs()
    assert [r.priority for r in native] == [7, 7]
    with pytest.raises(ValidationError):
        completion(prompt="a", priority=True)
    with pytest.raises(ValidationError):
        NativeGenerateReq.model_validate({"text": "a", "priority": "1"})
    limits = ModelLimits(vocab_size=100, context_len=1000, max_req_input_len=500, max_total_tokens=1000)
    builder = RequestBuilder(tokenizer=None, limits=limits)
    built = builder.build(GenerateReq(rid="a", input_ids=[1, 2], sampling_params={"n": 2}, priority=5))
    assert [r.priority for r in built] == [5, 5]
    with pytest.raises(Rejected) as bad:
        builder.build(GenerateReq(rid="b", input_ids=[1], priority=2**63))
    assert bad.value.param == "priority"
