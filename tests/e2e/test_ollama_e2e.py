"""Ollama's API end to end through Ollama's own Python client (``ollama.Client``), against the session's
real default model (``smollm2_server``) and, for the tool-call and reasoning parsers, the tiny Qwen3
server (``qwen3_server``: ``--tool-call-parser hermes --reasoning-parser qwen3``).

* ``/api/chat`` and ``/api/generate``, greedy: whole and streamed give the same text; a chat gives the
  OpenAI route's text for the same request (one request path); ``generate`` renders its prompt as a
  user message, so it answers as a chat of that message does; ``raw`` sends the prompt untouched;
  the counts and measured durations are there and add up;
* ``format`` with a JSON schema: the output validates;
* ``client.list()``, ``client.show()``, ``client.ps()``, ``/api/version`` and ``HEAD /``;
* an unknown model is ``ollama.ResponseError`` with status 404, whole or streamed; no key, 401;
* on Qwen3: a hermes tool call (the text forced by ``options.regex``, SGLang's constraint, which
  Ollama's body has no field for) read into ``tool_calls`` with an ``arguments`` object, whole and
  streamed, then sent back with the tool's result; ``think`` true and false.

Every test ends with the memory invariant (``assert_idle_and_nothing_leaked``)."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Any, Iterator

import jsonschema
import ollama
import pytest

from runtime.client import Client
from tests.support.real_model import API_KEY, SERVED_NAME
from tests.support.server_fixtures import CLIENT_TIMEOUT_S, assert_idle_and_nothing_leaked, http_json
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.server_fixtures", "tests.support.real_model"]

GREEDY = {"temperature": 0, "num_predict": 12}
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
HERMES_CALL = (
    r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", "unit": "c"\}\}\n</tool_call>'
)
THINKING = r"<think>[a-z]{2,6}( [a-z]{2,6}){1,3}</think>[a-z]{2,6}( [a-z]{2,6}){1,3}"
QWEN_OPTIONS = {"temperature": 0, "seed": 0, "num_predict": 120}


@pytest.fixture(scope="module")
def real(smollm2_server: ServedClient) -> Iterator[ollama.Client]:
    assert smollm2_server.server.http_address is not None
    with ollama.Client(
        host=smollm2_server.server.http_address,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=CLIENT_TIMEOUT_S,
    ) as client:
        yield client


@pytest.fixture(scope="module")
def qwen(qwen3_server: Client) -> Iterator[ollama.Client]:
    address = qwen3_server.server.http_address  # type: ignore[attr-defined]
    with ollama.Client(host=address, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(autouse=True)
def nothing_leaked(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test, the memory invariant on the server it used."""
    yield
    for fixture, server in (("real", "smollm2_server"), ("qwen", "qwen3_server")):
        if fixture in request.fixturenames:
            assert_idle_and_nothing_leaked(request.getfixturevalue(server))


def joined_chat(parts: Iterator[Any]) -> tuple[str, str, list[Any], Any]:
    """A chat stream put together: content, thinking, tool calls, and the ``done`` part."""
    content, thinking, calls, last = "", "", [], None
    for part in parts:
        assert last is None, "nothing follows the done part"
        content += part.message.content or ""
        thinking += part.message.thinking or ""
        calls += part.message.tool_calls or []
        if part.done:
            last = part
    assert last is not None
    return content, thinking, calls, last


def check_counts(reply: Any, most: int) -> None:
    assert reply.done and reply.done_reason in ("stop", "length")
    assert reply.prompt_eval_count > 0 and 0 < reply.eval_count <= most
    parts = reply.load_duration + reply.prompt_eval_duration + reply.eval_duration
    assert reply.eval_duration > 0 and reply.total_duration == parts


def test_chat_whole_and_streamed(real: ollama.Client, smollm2_server: ServedClient) -> None:
    whole = real.chat(model=SERVED_NAME, messages=FRANCE, options=GREEDY)
    assert whole.model == SERVED_NAME and whole.message.role == "assistant"
    assert "Paris" in whole.message.content
    check_counts(whole, GREEDY["num_predict"])
    content, _, _, last = joined_chat(
        real.chat(model=SERVED_NAME + ":latest", messages=FRANCE, options=GREEDY, stream=True)
    )
    assert content == whole.message.content
    assert (last.eval_count, last.prompt_eval_count) == (whole.eval_count, whole.prompt_eval_count)
    # the OpenAI route's answer to the same request: one request path
    status, openai = http_json(
        smollm2_server,
        "POST",
        "/v1/chat/completions",
        {"model": SERVED_NAME, "messages": FRANCE, "temperature": 0, "max_tokens": 12},
        key=API_KEY,
    )
    assert status == 200 and openai["choices"][0]["message"]["content"] == whole.message.content


def test_generate_whole_streamed_and_raw(real: ollama.Client) -> None:
    question = FRANCE[0]["content"]
    whole = real.generate(model=SERVED_NAME, prompt=question, options=GREEDY)
    check_counts(whole, GREEDY["num_predict"])
    # the prompt is a user message rendered with the chat template, as Ollama does
    assert whole.response == real.chat(model=SERVED_NAME, messages=FRANCE, options=GREEDY).message.content
    streamed = list(real.generate(model=SERVED_NAME, prompt=question, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == whole.response
    assert [p.done for p in streamed] == [False] * (len(streamed) - 1) + [True]
    raw = real.generate(model=SERVED_NAME, prompt="The capital of Japan is", raw=True, options=GREEDY)
    assert "Tokyo" in raw.response and raw.prompt_eval_count < whole.prompt_eval_count  # no template around it
    loaded = real.generate(model=SERVED_NAME)
    assert loaded.done and loaded.done_reason == "load" and loaded.response == ""


def test_format_schema(real: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"capital": {"type": "string", "maxLength": 12}},
        "required": ["capital"],
        "additionalProperties": False,
    }
    reply = real.chat(model=SERVED_NAME, messages=FRANCE, format=schema, options={"temperature": 0, "num_predict": 24})
    assert reply.done_reason == "stop"
    jsonschema.validate(json.loads(reply.message.content), schema)


def test_model_routes(real: ollama.Client, smollm2_server: ServedClient) -> None:
    [listed] = real.list().models
    assert listed.model == SERVED_NAME + ":latest" and listed.size and listed.size > 0
    assert listed.details is not None and listed.details.family == "llama" and listed.details.format == "gguf"
    assert listed.details.parameter_size and listed.details.parameter_size.endswith("M")
    shown = real.show(SERVED_NAME)
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert shown.modelinfo["llama.context_length"] > 0 and shown.capabilities == ["completion"]
    assert shown.template  # the chat template the prompts are rendered with
    [loaded] = real.ps().models
    assert loaded.model == listed.model and loaded.size_vram == 0 and loaded.expires_at is not None
    status, version = http_json(smollm2_server, "GET", "/api/version", key=None)
    assert status == 200 and re.fullmatch(r"\d+\.\d+\.\d+", version["version"])
    head = urllib.request.Request(f"{smollm2_server.server.http_address}/", method="HEAD")
    with urllib.request.urlopen(head, timeout=CLIENT_TIMEOUT_S) as alive:
        assert alive.status == 200


def test_unknown_model_and_missing_key(real: ollama.Client, smollm2_server: ServedClient) -> None:
    with pytest.raises(ollama.ResponseError) as whole:
        real.chat(model="llama3.2", messages=FRANCE, options=GREEDY)
    assert whole.value.status_code == 404 and whole.value.error == 'model "llama3.2" not found, try pulling it first'
    with pytest.raises(ollama.ResponseError) as streamed:
        list(real.generate(model="llama3.2", prompt="hi", stream=True))
    assert streamed.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as refused:
        real.chat(model=SERVED_NAME, messages=FRANCE, options={"num_predict": 100_000})
    assert refused.value.status_code == 400 and "options.num_predict" in refused.value.error
    with ollama.Client(host=smollm2_server.server.http_address) as keyless:
        with pytest.raises(ollama.ResponseError) as unauthorized:
            keyless.list()
    assert unauthorized.value.status_code == 401


def test_tool_call_round_trip_on_qwen3(qwen: ollama.Client) -> None:
    model = qwen.list().models[0].model
    assert model is not None and "tools" in (qwen.show(model).capabilities or [])
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    options = {**QWEN_OPTIONS, "regex": r"Sure\. " + HERMES_CALL}
    whole = qwen.chat(model=model, messages=ask, tools=[WEATHER], options=options)
    [call] = whole.message.tool_calls or []
    arguments = dict(call.function.arguments)
    assert call.function.name == "get_weather" and re.fullmatch("[a-z]{2,8}", arguments["city"])
    assert arguments["unit"] == "c" and whole.message.content == "Sure. " and whole.done_reason == "stop"
    content, _, calls, _ = joined_chat(
        qwen.chat(model=model, messages=ask, tools=[WEATHER], options=options, stream=True)
    )
    assert content == "Sure. " and [(c.function.name, dict(c.function.arguments)) for c in calls] == [
        ("get_weather", arguments)
    ]
    history = [
        *ask,
        whole.message,
        {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"},
    ]
    final = qwen.chat(model=model, messages=history, tools=[WEATHER], options={**QWEN_OPTIONS, "num_predict": 8})
    assert not final.message.tool_calls and isinstance(final.message.content, str)
    assert final.prompt_eval_count > whole.prompt_eval_count  # the call and its result reached the prompt


def test_think_on_qwen3(qwen: ollama.Client) -> None:
    model = qwen.list().models[0].model
    assert model is not None
    ask = [{"role": "user", "content": "Think first."}]
    options = {**QWEN_OPTIONS, "regex": THINKING}
    on = qwen.chat(model=model, messages=ask, think=True, options=options)
    assert on.message.thinking and on.message.content and "<think>" not in on.message.content
    content, thinking, _, _ = joined_chat(
        qwen.chat(model=model, messages=ask, think=True, options=options, stream=True)
    )
    assert (thinking, content) == (on.message.thinking, on.message.content)
    generated = qwen.generate(model=model, prompt="Think first.", think=True, options=options)
    assert (generated.thinking, generated.response) == (on.message.thinking, on.message.content)
    off = qwen.chat(model=model, messages=ask, think=False, options=options)
    # Qwen3's template closes an empty think block when thinking is off; nothing is split out
    assert off.prompt_eval_count > on.prompt_eval_count
    assert not off.message.thinking and off.message.content.startswith("<think>")
