"""Multi-LoRA end to end: a server started through launch.py with adapters, driven by real clients.

One tiny-Llama server with two adapters at start and two slots (``--max-loras-per-batch 2``): a batch
of the base and both adapters, each greedy-equal to peft + transformers; the same through the OpenAI
SDK (``model="tiny:ADAPTER"``) and the Python client; a third adapter loaded at run time (three adapters
over two slots: requests wait for a slot) and unloaded while a request runs on it (the request
finishes, then the name is refused); unknown adapters refused with 400 naming them; the prefix cache
keeps each adapter's KV apart. The memory invariant holds after each test.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.client import Client, RequestError
from tests.support.checkpoints import hf_greedy, random_prompt
from tests.support.lora_adapters import AdapterSpec, build_adapter, peft_model
from tests.support.server_fixtures import (
    API_KEY,
    CLIENT_TIMEOUT_S,
    assert_idle_and_nothing_leaked,
    base_args,
    http_json,
)
from tests.support.server_process import launch_server

pytestmark = pytest.mark.e2e

SERVED = "tiny"
SPECS = {
    "a": AdapterSpec(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=11),
    "b": AdapterSpec(r=4, alpha=8, targets=("gate_proj", "up_proj", "down_proj", "v_proj"), seed=12),
    "c": AdapterSpec(r=8, alpha=8, targets=("q_proj", "v_proj", "down_proj"), seed=13),
}
MAX_NEW = 8
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints: Any) -> dict[str, Path]:
    base = tiny_checkpoints.path("llama")
    return {name: build_adapter(base, tiny_checkpoints.root / f"e2e-lora-{name}", spec) for name, spec in SPECS.items()}


@pytest.fixture(scope="module")
def lora_server(tiny_checkpoints: Any, adapters: dict[str, Path]) -> Iterator[Client]:
    argv = base_args(
        tiny_checkpoints.path("llama"),
        "--api-key",
        API_KEY,
        "--served-model-name",
        SERVED,
        "--lora-paths",
        f"a={adapters['a']}",
        f"b={adapters['b']}",
        "--max-loras-per-batch",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        "all",
    )
    with launch_server(argv, client_timeout=CLIENT_TIMEOUT_S) as client:
        yield client


def expected(tiny_checkpoints: Any, adapters: dict[str, Path], prompt: list[int], name: str | None) -> list[int]:
    base = tiny_checkpoints.path("llama")
    tokens, _ = hf_greedy(peft_model(base, adapters[name] if name else None), prompt, MAX_NEW)
    return tokens


def test_a_batch_of_the_base_and_two_adapters_equals_peft(
    lora_server: Client, tiny_checkpoints: Any, adapters: dict[str, Path]
) -> None:
    prompts = [random_prompt(12 + i, 300, seed=40 + i) for i in range(6)]
    names: list[str | None] = [None, "a", "b", None, "a", "b"]
    results = lora_server.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    for prompt, name, result in zip(prompts, names, results):
        assert result["output_ids"] == expected(tiny_checkpoints, adapters, prompt, name), name
    # SGLang's native body: one adapter for every prompt
    status, body = http_json(
        lora_server, "POST", "/generate", {"input_ids": prompts[:2], "sampling_params": GREEDY, "lora_path": "b"}
    )
    assert status == 200
    assert [item["output_ids"] for item in body] == [expected(tiny_checkpoints, adapters, p, "b") for p in prompts[:2]]
    assert_idle_and_nothing_leaked(lora_server)


def test_the_openai_sdk_names_an_adapter_as_a_model(
    lora_server: Client, tiny_checkpoints: Any, adapters: dict[str, Path]
) -> None:
    import openai

    sdk = openai.OpenAI(base_url=lora_server.server.http_address + "/v1", api_key=API_KEY)  # type: ignore[attr-defined]
    ids = {m.id for m in sdk.models.list().data}
    assert ids == {SERVED, f"{SERVED}:a", f"{SERVED}:b"}
    prompt = random_prompt(10, 300, seed=7)
    for model, name in ((f"{SERVED}:a", "a"), (SERVED, None)):
        reply = sdk.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0, logprobs=0)
        assert reply.choices[0].logprobs is not None
        direct = lora_server.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)
        assert reply.choices[0].text == direct["text"]
        assert direct["output_ids"] == expected(tiny_checkpoints, adapters, prompt, name)
    extra = sdk.completions.create(
        model=SERVED, prompt=prompt, max_tokens=MAX_NEW, temperature=0, extra_body={"lora_path": "b"}
    )
    assert (
        extra.choices[0].text == lora_server.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="b")["text"]
    )
    with pytest.raises(openai.BadRequestError, match="'nope'"):
        sdk.completions.create(model=f"{SERVED}:nope", prompt=prompt, max_tokens=2)
    assert_idle_and_nothing_leaked(lora_server)


def test_unknown_adapters_are_refused_by_name(lora_server: Client) -> None:
    with pytest.raises(RequestError, match="'missing'") as caught:
        lora_server.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="missing")
    assert caught.value.code == "invalid_request"
    status, body = http_json(lora_server, "POST", "/generate", {"text": "hi", "lora_path": "missing"})
    assert status == 400 and "'missing'" in body["error"]["message"]
    status, body = http_json(lora_server, "POST", "/unload_lora_adapter", {"lora_name": "missing"})
    assert status == 400 and not body["success"]
    status, body = http_json(lora_server, "POST", "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"})
    assert status == 400 and "/nonexistent" in body["message"]
    assert lora_server.generate(input_ids=[5, 6, 7], sampling_params=GREEDY)["output_ids"]  # still serving
    assert_idle_and_nothing_leaked(lora_server)


def test_each_adapter_keeps_its_own_prefix_cache(lora_server: Client) -> None:
    prompt = random_prompt(40, 300, seed=99)
    lora_server.flush_cache()
    first = lora_server.generate(input_ids=prompt, sampling_params=GREEDY)
    on_a = lora_server.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
    on_b = lora_server.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="b")
    again_a = lora_server.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a")
    again_base = lora_server.generate(input_ids=prompt, sampling_params=GREEDY)
    assert first["meta"]["cached_tokens"] == 0
    assert on_a["meta"]["cached_tokens"] == 0, "the base's KV must not serve adapter a"
    assert on_b["meta"]["cached_tokens"] == 0, "neither the base's nor a's KV may serve adapter b"
    assert again_a["meta"]["cached_tokens"] >= len(prompt) - 1 and again_a["output_ids"] == on_a["output_ids"]
    assert again_base["meta"]["cached_tokens"] >= len(prompt) - 1 and again_base["output_ids"] == first["output_ids"]
    assert_idle_and_nothing_leaked(lora_server)


def test_load_at_run_time_then_unload_while_a_request_runs(
    lora_server: Client, tiny_checkpoints: Any, adapters: dict[str, Path]
) -> None:
    status, body = http_json(
        lora_server, "POST", "/load_lora_adapter", {"lora_name": "c", "lora_path": str(adapters["c"])}
    )
    assert status == 200 and body["success"], body
    assert {a["name"] for a in body["loaded_adapters"]} == {"a", "b", "c"}
    prompts = [random_prompt(9 + i, 300, seed=70 + i) for i in range(6)]
    names: list[str | None] = ["a", "b", "c", "c", "b", "a"]  # three adapters over two slots: some wait
    results = lora_server.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    for prompt, name, result in zip(prompts, names, results):
        assert result["output_ids"] == expected(tiny_checkpoints, adapters, prompt, name), name
    # A long request on c; once it has produced its first token, unload c: the request finishes on c.
    long_params = {"max_new_tokens": 64, "temperature": 0.0, "ignore_eos": True}
    stream = lora_server.generate(input_ids=prompts[0], sampling_params=long_params, lora_path="c", stream=True)
    started, unloaded = threading.Event(), {}

    def unload() -> None:
        started.wait(CLIENT_TIMEOUT_S)
        unloaded["reply"] = http_json(lora_server, "POST", "/unload_lora_adapter", {"lora_name": "c"})

    worker = threading.Thread(target=unload)
    worker.start()
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        started.set()
    worker.join(CLIENT_TIMEOUT_S)
    assert sum(len(c["output_ids"]) for c in chunks) == 64
    assert chunks[-1]["meta"]["finish_reason"]["type"] == "length"
    status, body = unloaded["reply"]
    assert status == 200 and body["success"] and {a["name"] for a in body["loaded_adapters"]} == {"a", "b"}
    with pytest.raises(RequestError, match="'c'"):
        lora_server.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="c")
    info = lora_server.server_info()
    assert [a["name"] for a in info["lora"]["adapters"]] == ["a", "b"]
    assert_idle_and_nothing_leaked(lora_server)
