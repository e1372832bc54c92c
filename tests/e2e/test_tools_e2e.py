"""Tool calling, reasoning output and the lenient OpenAI surface, end to end with the openai SDK
against the session's tiny Qwen3 server (``qwen3_server``: a Qwen3-style template with tools and
thinking, ``--tool-call-parser hermes``, ``--reasoning-parser qwen3``; CPU, fp32).

A random tiny model never writes a tool call or a ``<think>`` block by itself, so the tests make
it: ``tool_choice`` required / named constrains decoding to a call (that is the feature), and
for the parsers a ``regex`` (SGLang's extra field) forces the model's text into the format the
parser reads. Each kind of reply is checked whole and streamed (the same calls, content and
reasoning either way), and:

* a tool round trip: a required call whose arguments validate against the tool's schema, the
  call and the tool's result sent back in ``messages``, a final answer without calls; again on
  the default model (SmolLM2, whose template knows no tools), which fills the call in right;
* a named function streams its name first, then its arguments in fragments;
* ``chat_template_kwargs`` reaches the template (``enable_thinking``) and the reasoning parser;
* unknown fields are ignored, known unsupported ones refused naming the field;
* ``logit_bias`` forces and bans tokens; ``echo`` with ``logprobs`` (lm-evaluation-harness's
  loglikelihood request) returns the prompt's logprobs, equal to transformers' log-softmax;
* ``stream_options.continuous_usage_stats`` puts the usage so far on every chunk.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from typing import Any, Callable

import jsonschema
import openai
import pytest
import torch

from runtime.client import Client
from tests.support.real_model import API_KEY as REAL_MODEL_KEY
from tests.support.real_model import SERVED_NAME
from tests.support.server_fixtures import CLIENT_TIMEOUT_S
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.server_fixtures", "tests.support.real_model"]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a zone.",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "maxLength": 6},
                "hours": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["zone", "hours"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 0}
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "unit": "c"\}\}\n</tool_call>'
)
THINKING = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>[a-z]{2,6}( [a-z]{2,6}){1,3}"


@pytest.fixture(scope="module")
def oai(qwen3_server: Client) -> openai.OpenAI:
    assert qwen3_server.server.http_address is not None
    return openai.OpenAI(
        base_url=qwen3_server.server.http_address + "/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S
    )


def model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def chat(oai: openai.OpenAI, **kwargs: Any) -> Any:
    return oai.chat.completions.create(model=model(oai), **{"messages": ASK, "max_tokens": 120, **GREEDY, **kwargs})


def streamed(oai: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A chat stream's deltas put back together: content, reasoning, calls (by index), finish."""
    out: dict[str, Any] = {"content": "", "reasoning": "", "calls": {}, "finish": None, "call_deltas": []}
    for event in chat(oai, stream=True, **kwargs):
        for choice in event.choices:
            delta = choice.delta
            out["content"] += delta.content or ""
            out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
            for call in delta.tool_calls or []:
                out["call_deltas"].append(call)
                entry = out["calls"].setdefault(call.index, {"id": None, "name": None, "arguments": ""})
                if call.id is not None:
                    assert entry["id"] is None, "a call's id comes once"
                    entry["id"], entry["name"] = call.id, call.function.name
                out["calls"][call.index]["arguments"] += call.function.arguments or ""
            if choice.finish_reason is not None:
                out["finish"] = choice.finish_reason
    return out


def calls_of(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


# ---------------------------------------------------------------------- tool calls


def test_required_tool_call_round_trip(oai: openai.OpenAI) -> None:
    first = chat(oai, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])

    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    final = chat(oai, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert final.choices[0].message.tool_calls is None
    assert isinstance(final.choices[0].message.content, str)
    assert final.choices[0].finish_reason in ("stop", "length")
    # the template rendered the call and the tool's answer into the second prompt
    no_tools = chat(oai, max_tokens=1)
    assert final.usage.prompt_tokens > first.usage.prompt_tokens > no_tools.usage.prompt_tokens


def test_required_tool_calls_streamed_equal_whole_and_follow_the_schemas(oai: openai.OpenAI) -> None:
    for seed in range(3):
        kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": seed}
        whole = chat(oai, **kwargs).choices[0]
        stream = streamed(oai, **kwargs)
        assert calls_of(whole.message) and stream["finish"] == whole.finish_reason == "tool_calls"
        assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(stream["calls"].items())] == calls_of(
            whole.message
        )
        for name, arguments in calls_of(whole.message):
            jsonschema.validate(arguments, SCHEMAS[name])


def test_named_tool_choice_streams_the_name_then_argument_fragments(oai: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    whole = chat(oai, tools=TOOLS, tool_choice=named)
    [(name, arguments)] = calls_of(whole.choices[0].message)
    assert name == "get_time" and whole.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(arguments, SCHEMAS["get_time"])
    stream = streamed(oai, tools=TOOLS, tool_choice=named)
    first, *rest = stream["call_deltas"]
    assert first.function.name == "get_time" and first.id is not None
    assert rest and all(d.id is None and d.function.name is None for d in rest)  # then fragments only
    assert json.loads(stream["calls"][0]["arguments"]) == arguments and stream["content"] == ""


def test_auto_tool_choice_reads_hermes_calls_whole_and_streamed(oai: openai.OpenAI) -> None:
    regex = {"extra_body": {"regex": r"Sure\. " + HERMES_CALL}}
    whole = chat(oai, tools=TOOLS, **regex).choices[0]
    [(name, arguments)] = calls_of(whole.message)
    assert name == "get_weather" and set(arguments) == {"city", "unit"} and arguments["unit"] == "c"
    assert whole.message.content == "Sure. " and whole.finish_reason == "tool_calls"
    stream = streamed(oai, tools=TOOLS, **regex)
    assert stream["content"] == "Sure. " and stream["finish"] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in stream["calls"].values()] == [(name, arguments)]


def test_a_call_to_an_unknown_tool_stays_text(oai: openai.OpenAI) -> None:
    regex = HERMES_CALL.replace("get_weather", "launch_rocket")
    whole = chat(oai, tools=TOOLS, extra_body={"regex": regex}).choices[0]
    assert whole.message.tool_calls is None and whole.finish_reason == "stop"
    assert re.fullmatch(regex, whole.message.content)
    assert streamed(oai, tools=TOOLS, extra_body={"regex": regex})["content"] == whole.message.content


# ---------------------------------------------------------------------- reasoning


def test_reasoning_is_split_whole_and_streamed(oai: openai.OpenAI) -> None:
    raw = chat(oai, extra_body={"regex": THINKING, "separate_reasoning": False}).choices[0].message
    assert getattr(raw, "reasoning_content", None) is None and raw.content.startswith("<think>")
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", raw.content).groups()
    split = chat(oai, extra_body={"regex": THINKING}).choices[0].message
    assert (split.reasoning_content, split.content) == (thought, answer)
    stream = streamed(oai, extra_body={"regex": THINKING})
    assert (stream["reasoning"], stream["content"]) == (thought, answer)


def test_chat_template_kwargs_reach_the_template_and_the_parser(oai: openai.OpenAI) -> None:
    on = chat(oai, extra_body={"regex": THINKING})
    off = chat(oai, extra_body={"regex": THINKING, "chat_template_kwargs": {"enable_thinking": False}})
    # Qwen3's template closes an empty <think> block when thinking is off; the parser then keeps
    # whatever the model writes as content
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert off.choices[0].message.content.startswith("<think>")
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs"):
        chat(oai, extra_body={"chat_template_kwargs": {"tokenize": True}})


# ---------------------------------------------------------------------- a lenient protocol


def raw_post(oai: openai.OpenAI, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST to ``/v1`` + path (``/../generate``: the server's native endpoint)."""
    base = str(oai.base_url).rstrip("/")
    url = base.removesuffix("/v1") + path[3:] if path.startswith("/..") else base + path
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_unknown_fields_are_ignored_and_unsupported_ones_refused_by_name(oai: openai.OpenAI) -> None:
    r = chat(
        oai,
        max_tokens=2,
        user="u1",
        metadata={"k": "v"},
        store=False,
        extra_body={"a_field_from_the_future": {"x": 1}, "service_tier": "auto"},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    for field, value in (
        ("audio", {"voice": "alloy", "format": "wav"}),
        ("functions", [{"name": "f"}]),
        ("modalities", ["text", "audio"]),
    ):
        status, body = raw_post(oai, "/chat/completions", {"model": model(oai), "messages": ASK, field: value})
        assert status == 400 and body["error"]["param"] == field, body
    status, body = raw_post(oai, "/completions", {"model": model(oai), "prompt": "a", "suffix": "b"})
    assert status == 400 and body["error"]["param"] == "suffix"
    status, body = raw_post(
        oai,
        "/chat/completions",
        {
            "model": model(oai),
            "messages": ASK,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert status == 400 and body["error"]["param"] == "tool_choice"


def test_logit_bias_forces_and_bans_tokens(oai: openai.OpenAI) -> None:
    def ids(**params: Any) -> list[int]:  # through SGLang's /generate: token ids in the reply
        status, body = raw_post(
            oai,
            "/../generate",
            {"text": "Hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, **params}},
        )
        assert status == 200, body
        return body["output_ids"]

    def tokens(**kwargs: Any) -> list[str]:
        r = oai.completions.create(
            model=model(oai),
            prompt="Hello",
            max_tokens=5,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
            **kwargs,
        )
        return r.choices[0].logprobs.tokens

    plain = ids()
    forced = 77 if plain[0] != 77 else 78
    assert ids(logit_bias={str(forced): 100}) == [forced] * 5
    assert ids(logit_bias={str(plain[0]): -100})[0] != plain[0]
    # the OpenAI field is the same parameter
    assert len(set(tokens(logit_bias={str(forced): 100}))) == 1
    assert tokens(logit_bias={str(forced): 100}) != tokens()


def test_echo_with_logprobs_gives_the_prompts_logprobs(oai: openai.OpenAI, hf_reference: Callable[[str], Any]) -> None:
    hf_model, tokenizer = hf_reference("qwen3")
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for max_tokens in (0, 1):  # lm-evaluation-harness sends 1 and drops the last token; 0 also works
        r = oai.completions.create(
            model=model(oai), prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1, temperature=0
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(tokenizer.decode(prompt))
        assert len(lp.token_logprobs) == len(prompt) + max_tokens and lp.token_logprobs[0] is None
        got = torch.tensor(lp.token_logprobs[1 : len(prompt)])
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
        for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
            assert max(top.values()) >= value - 1e-5
    text = oai.completions.create(model=model(oai), prompt="Say it", max_tokens=2, echo=True, temperature=0)
    assert text.choices[0].text.startswith("Say it")


def test_continuous_usage_stats_count_every_chunk(oai: openai.OpenAI) -> None:
    events = list(
        chat(
            oai,
            stream=True,
            max_tokens=10,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [e.usage.completion_tokens for e in events if e.choices]
    assert counts == sorted(counts) and counts[-1] == 10 and len(set(counts)) > 1
    assert events[-1].usage.completion_tokens == 10 and not events[-1].choices


def test_real_model_tool_round_trip(smollm2_server: ServedClient) -> None:
    """SmolLM2's template shows it no tools; the constraint alone makes its answer a call, and a
    trained model fills the arguments in from the question."""
    assert smollm2_server.server.http_address is not None
    client = openai.OpenAI(
        base_url=smollm2_server.server.http_address + "/v1",
        api_key=REAL_MODEL_KEY,
        max_retries=0,
        timeout=CLIENT_TIMEOUT_S,
    )
    weather_only = [
        {
            "type": "function",
            "function": {
                **WEATHER["function"],
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20}},
                    "required": ["city"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    first = client.chat.completions.create(
        model=SERVED_NAME, messages=ASK, tools=weather_only, tool_choice="required", max_tokens=40, temperature=0
    )
    [(name, arguments)] = calls_of(first.choices[0].message)
    assert name == "get_weather" and arguments["city"] == "Paris"
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "It is 18 degrees and sunny in Paris."},
    ]
    final = client.chat.completions.create(
        model=SERVED_NAME, messages=history, tools=weather_only, tool_choice="none", max_tokens=24, temperature=0
    )
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content


def test_the_zmq_client_hands_tools_and_template_kwargs_to_the_template(qwen3_server: Client) -> None:
    def prompt_tokens(**kwargs: Any) -> int:
        r = qwen3_server.generate(messages=ASK, sampling_params={"max_new_tokens": 1}, **kwargs)
        return int(r["meta"]["prompt_tokens"])

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS) > plain
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > plain
    with pytest.raises(ValueError, match="with messages"):
        qwen3_server.generate("text", tools=TOOLS)
