"""The OpenAI request models and their translation into GenerateReq (no server): batches
of prompts, field names in errors, what is refused, and the metric gauges' arithmetic."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from tokenizer_proc import openai_protocol as oai
from tokenizer_proc.http_server import _loc_path
from tokenizer_proc.metrics import Metrics


def completion(**body: Any) -> oai.CompletionRequest:
    return oai.CompletionRequest.model_validate_json(json.dumps({"model": "m", **body}))


def test_prompts_become_one_request_each_with_the_sampling_params() -> None:
    reqs = completion(prompt=["a", "b"], max_tokens=5, temperature=0, stop="x", n=2, logprobs=3,
                      ignore_eos=True, top_k=4).generate_reqs()
    assert [r.text for r in reqs] == ["a", "b"] and reqs[0].rid != reqs[1].rid
    assert reqs[0].sampling_params == {"n": 2, "max_new_tokens": 5, "temperature": 0.0, "stop": "x", "top_k": 4,
                                       "ignore_eos": True}
    assert reqs[0].return_logprob and reqs[0].top_logprobs_num == 3
    assert [r.input_ids for r in completion(prompt=[1, 2]).generate_reqs()] == [[1, 2]]
    assert [r.input_ids for r in completion(prompt=[[1], [2, 3]]).generate_reqs()] == [[1], [2, 3]]
    # OpenAI's default max_tokens for completions; chat leaves it to the server (fit to the context)
    assert completion(prompt="a").generate_reqs()[0].sampling_params == {"n": 1, "max_new_tokens": 16}
    chat = oai.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.generate_reqs()[0].sampling_params == {"n": 1}
    assert chat.generate_reqs()[0].messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"prompt": "a", "echo": True}, "echo"),
    ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
])
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
    m.set_scheduler_gauges({"num_running": 3, "num_queued": 2, "max_total_tokens": 100, "available_tokens": 60,
                            "evictable_tokens": 15, "cache_hit_rate": 0.5})
    text = m.render().decode()
    assert 'tinyserve:token_usage{model_name="m"} 0.25' in text
    assert 'tinyserve:num_running_reqs{model_name="m"} 3.0' in text
    assert "_created" not in text


def test_constraints_are_checked_before_queueing_and_refused_without_a_grammar_backend() -> None:
    """The tokenizer's RequestBuilder: a constraint that parses goes through, one that does not is
    refused naming its kind, and ``--grammar-backend none`` refuses every constrained request."""
    import pytest

    from runtime.messages import GenerateReq
    from tokenizer_proc.request_builder import ModelLimits, Rejected, RequestBuilder

    limits = ModelLimits(vocab_size=100, context_len=1000, max_req_input_len=500, max_total_tokens=1000)
    builder = RequestBuilder(tokenizer=None, limits=limits)
    ok = GenerateReq(rid="a", input_ids=[1, 2], sampling_params={"regex": "[ab]+", "n": 2})
    built = builder.build(ok)
    assert [r.sampling_params.regex for r in built] == ["[ab]+", "[ab]+"]
    with pytest.raises(Rejected) as bad:
        builder.build(GenerateReq(rid="b", input_ids=[1], sampling_params={"ebnf": "root ::= foo"}))
    assert bad.value.param == "ebnf" and "Rule \"foo\" is not defined" in bad.value.message
    off = RequestBuilder(tokenizer=None, limits=limits, grammar_backend="none")
    with pytest.raises(Rejected) as refused:
        off.build(ok)
    assert refused.value.param == "regex" and "--grammar-backend none" in refused.value.message
    assert off.build(GenerateReq(rid="c", input_ids=[1]))  # unconstrained requests are served
