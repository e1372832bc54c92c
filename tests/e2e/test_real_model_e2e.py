"""The default model, SmolLM2-135M-Instruct, served by launch.py (CPU): a quality guard.

The tiny random checkpoints show that the server computes what transformers computes; they
cannot show that the result means anything. A trained model can:

1. questions with one right answer (a capital, arithmetic, a translation, an author) are
   answered right, greedy, in fp32 and in bf16, through the ZMQ client and the openai SDK;
2. greedy output equals transformers' own GGUF loading token for token on chat prompts, one
   at a time and 16 at once, prefilled in 32-token chunks, and again from the prefix cache,
   with n-gram speculative decoding on (the fp32 server's flags: tests/support/real_model.py).

The questions were chosen by probing the model: each answer is right in both dtypes, and at
every step up to the answer word the chosen token leads the runner-up by at least 0.25 nats
in both (so neither dtype is right by luck). Rejected: the capital of Italy (fp32 answers
"Il Coriobella", bf16 "Rome"), 7 + 6 (bf16 says 12), "Translate 'thank you' into Spanish"
(never "gracias"), "Translate 'hello' into Spanish" ("Hola", but by 0.02 nats in fp32, 0 in bf16).
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, NamedTuple

import openai
import pytest

from runtime.client import Client
from tests.support.checkpoints import hf_greedy
from tests.support.lora_adapters import AdapterSpec, build_adapter
from tests.support.real_model import (
    API_KEY,
    CHUNKED_PREFILL_SIZE,
    CLIENT_TIMEOUT_S,
    REAL_MODEL_LORA_RANK,
    SERVED_NAME,
    chat_ids,
    hf_greedy_until_eos,
    one_torch_thread,
    real_model_args,
    serve_real_model,
)
from tests.support.server_fixtures import assert_idle_and_nothing_leaked, http_json, is_idle, wait_until
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.real_model"]

# question -> a pattern its answer must contain (case-insensitive, whole word)
QUESTIONS: dict[str, str] = {
    "What is the capital of Japan?": "Tokyo",
    "What is the capital of the United Kingdom?": "London",
    "What is 10 + 10?": "20",
    "What is 100 divided by 4?": "25",
    "How do you say 'hello' in Spanish?": "Hola",
    "Who is the author of Hamlet?": "Shakespeare",
    "What is the chemical symbol for water?": "H2O",
}
# bf16 is emulated on this CPU (slow): one question of each kind.
BF16_QUESTIONS = [
    "What is the capital of Japan?",
    "What is 10 + 10?",
    "How do you say 'hello' in Spanish?",
    "Who is the author of Hamlet?",
]
ANSWER_TOKENS = 12  # every chosen answer names its word within 11 tokens
EQUALITY_TOKENS = 24
SEQUENTIAL_TOKENS = 12  # batch size 1 costs a decode step per token per chat: the first half of the reference

CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": q}]
    for q in (
        "What is the capital of France?",
        "What is 2 + 2?",
        "Who wrote Hamlet?",
        "Name three primary colors.",
        "Write a haiku about the sea.",
        "Give me one tip for learning to cook.",
        "What does a CPU do?",
        "Why is the sky blue? Answer in one sentence.",
        "List the planets of the solar system in order from the sun, starting with Mercury and ending with "
        "Neptune, and say which one is the largest and which one is the smallest of them all.",
        "Here is a long story to summarise. Once upon a time, in a small village by the river, there lived an "
        "old baker who rose before dawn every day to bake bread for everyone in the village, and the children "
        "would wait at his door for the first warm loaf. Summarise it in one line.",
        "Explain in simple words what photosynthesis is.",
        "What is the boiling point of water in Celsius?",
        "Suggest a name for a pet cat.",
        "How many days are there in a week?",
    )
] + [
    [
        {"role": "system", "content": "You are a terse assistant. Answer in at most five words."},
        {"role": "user", "content": "What is the largest ocean on Earth?"},
    ],
    [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Tell me a fun fact about octopuses."},
    ],
]


def assert_right(question: str, answer: str, dtype: str, client: str) -> None:
    word = QUESTIONS[question]
    assert re.search(rf"\b{re.escape(word)}\b", answer, re.IGNORECASE), (
        f"{dtype} via {client}: {question!r} -> {answer!r}, which lacks {word!r}"
    )


def ask_both_clients(client: ServedClient, questions: list[str], dtype: str) -> dict[str, tuple[str, str]]:
    """Each question through the ZMQ client (one batch call) and the openai SDK over HTTP (all at
    once, from threads): ``question -> (zmq answer, http answer)``, each checked right."""
    assert client.server.http_address is not None
    oai = openai.OpenAI(
        base_url=client.server.http_address + "/v1", api_key=API_KEY, max_retries=0, timeout=CLIENT_TIMEOUT_S
    )

    def http(question: str) -> str:
        r = oai.chat.completions.create(
            model=SERVED_NAME,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_completion_tokens=ANSWER_TOKENS,
        )
        assert r.model == SERVED_NAME and r.choices[0].message.role == "assistant"
        return r.choices[0].message.content or ""

    greedy = {"temperature": 0, "max_new_tokens": ANSWER_TOKENS}
    with ThreadPoolExecutor(len(questions) + 1) as pool:  # both clients at once: one batch, half the steps
        zmq_call = pool.submit(
            client.generate, messages=[[{"role": "user", "content": q}] for q in questions], sampling_params=greedy
        )
        http_answers = list(pool.map(http, questions))
        zmq = zmq_call.result()
    answers = {}
    for q, z, h in zip(questions, zmq, http_answers):
        assert_right(q, z["text"], dtype, "the ZMQ client")
        assert_right(q, h, dtype, "the openai SDK")
        answers[q] = (z["text"], h)
    return answers


# ---------------------------------------------------------------------- equality with transformers


class Expected(NamedTuple):
    """What the server must answer to one chat, from transformers."""

    prompt: list[int]  # the chat rendered by transformers' tokenizer of the GGUF file
    output: list[int]  # transformers' greedy continuation, up to and including EOS
    finish: dict[str, Any]  # the finish_reason the server must report

    def first(self, n: int) -> "Expected":
        """What ``max_new_tokens=n`` gives (n <= EQUALITY_TOKENS): greedy decoding's first n tokens."""
        if len(self.output) <= n and self.finish["type"] == "stop":
            return self
        return self._replace(output=self.output[:n], finish={"type": "length", "length": n})


@pytest.fixture(scope="module")
def reference(smollm2_hf: tuple[Any, Any]) -> list[Expected]:
    """transformers' answer to each chat, computed once. Listed before ``smollm2_server`` (which
    waits for the server) in the tests that use both, so pytest sets it up first (same scope,
    argument order): the reference then loads while the server starts."""
    model, tokenizer = smollm2_hf
    prompts = [chat_ids(tokenizer, messages) for messages in CHATS]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert eos == model.config.eos_token_id
    outputs = hf_greedy_until_eos(model, prompts, EQUALITY_TOKENS, eos, tokenizer.pad_token_id or eos)
    assert any(o[-1] == eos for o in outputs) and any(o[-1] != eos for o in outputs), "both ways to finish"
    return [
        Expected(
            p, o, {"type": "stop", "matched": eos} if o[-1] == eos else {"type": "length", "length": EQUALITY_TOKENS}
        )
        for p, o in zip(prompts, outputs)
    ]


def check_against_reference(results: list[dict[str, Any]], reference: list[Expected]) -> None:
    for messages, r, expected in zip(CHATS, results, reference, strict=True):
        assert r["meta"]["prompt_tokens"] == len(expected.prompt), messages  # the same template, the same tokens
        assert r["output_ids"] == expected.output, messages
        assert r["meta"]["finish_reason"] == expected.finish, messages


def flushed(client: Client) -> None:
    wait_until(lambda: is_idle(client), 60, "an idle server")
    assert client.flush_cache()["success"] is True


def test_one_at_a_time_equals_transformers(reference: list[Expected], smollm2_server: ServedClient) -> None:
    """Batch size 1: each chat sent after the last one finished. The long chats are more than
    one 32-token chunk even after the shared system prompt comes from the prefix cache."""
    assert any(len(e.prompt) > 2 * CHUNKED_PREFILL_SIZE for e in reference)
    flushed(smollm2_server)
    greedy = {"temperature": 0, "max_new_tokens": SEQUENTIAL_TOKENS}
    results = [smollm2_server.generate(messages=m, sampling_params=greedy) for m in CHATS]
    check_against_reference(results, [e.first(SEQUENTIAL_TOKENS) for e in reference])
    assert_idle_and_nothing_leaked(smollm2_server)
    assert smollm2_server.server_info()["spec_draft_tokens"] > 0  # (the server speculates: real_model.py)


def test_sixteen_at_once_equal_transformers_then_hit_the_prefix_cache(
    reference: list[Expected], smollm2_server: ServedClient
) -> None:
    """All chats sent at once on an empty prefix cache (so prefills of several requests share
    32-token chunks), then all again: the repeats come from the prefix cache and say so, and
    give the same tokens."""
    assert len(CHATS) >= 16
    flushed(smollm2_server)
    greedy = {"temperature": 0, "max_new_tokens": EQUALITY_TOKENS}
    first = smollm2_server.generate(messages=CHATS, sampling_params=greedy)
    check_against_reference(first, reference)
    again = smollm2_server.generate(messages=CHATS, sampling_params=greedy)
    check_against_reference(again, reference)
    for r, expected in zip(again, reference):
        assert len(expected.prompt) - 1 <= r["meta"]["cached_tokens"] < len(expected.prompt), r["meta"]
    assert_idle_and_nothing_leaked(smollm2_server)


# ---------------------------------------------------------------------- LoRA adapters

LORA_SPECS = {
    "attn8": AdapterSpec(r=8, alpha=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=21, scale=4.0),
    "all16": AdapterSpec(
        r=REAL_MODEL_LORA_RANK,
        alpha=8,
        targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        seed=22,
        scale=4.0,
    ),
}
LORA_TOKENS = 12


def test_peft_adapters_on_the_real_model_equal_peft(
    smollm2_hf: tuple[Any, Any], smollm2_server: ServedClient, tmp_path: Path
) -> None:
    """Two adapters made with peft for SmolLM2-135M (ranks 8 and 16, attention only and all seven
    projections), loaded at run time, in one batch with the base model: each request's greedy tokens
    equal peft's over transformers' model (fp32); then unloaded."""
    from peft import PeftModel

    model, tokenizer = smollm2_hf
    paths = {name: build_adapter(model.config, tmp_path / name, spec) for name, spec in LORA_SPECS.items()}
    for name, path in paths.items():
        status, body = http_json(
            smollm2_server, "POST", "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, key=API_KEY
        )
        assert status == 200 and body["success"], body
    prompts = [chat_ids(tokenizer, messages) for messages in CHATS[:3]]
    names: list[str | None] = [None, "attn8", "all16"]
    greedy = {"temperature": 0, "max_new_tokens": LORA_TOKENS, "ignore_eos": True}
    batch = [(p, n) for p in prompts for n in names]
    results = smollm2_server.generate(
        input_ids=[p for p, _ in batch], sampling_params=greedy, lora_path=[n for _, n in batch]
    )
    peft = PeftModel.from_pretrained(model, str(paths["attn8"]), adapter_name="attn8")
    try:
        peft.load_adapter(str(paths["all16"]), adapter_name="all16")
        with one_torch_thread():
            for (prompt, name), result in zip(batch, results):
                if name is None:
                    with peft.disable_adapter():
                        expected, _ = hf_greedy(peft, prompt, LORA_TOKENS)
                else:
                    peft.set_adapter(name)
                    expected, _ = hf_greedy(peft, prompt, LORA_TOKENS)
                assert result["output_ids"] == expected, name
        assert len({tuple(r["output_ids"]) for r in results[:3]}) == 3, "each adapter changes the answer"
    finally:
        peft.unload()  # (the module's transformers model is the base again)
    for name in paths:
        status, body = http_json(smollm2_server, "POST", "/unload_lora_adapter", {"lora_name": name}, key=API_KEY)
        assert status == 200 and body["success"], body
    assert_idle_and_nothing_leaked(smollm2_server)


# ---------------------------------------------------------------------- quality guard


def test_fp32_answers_are_right_through_both_clients(smollm2_server: ServedClient) -> None:
    answers = ask_both_clients(smollm2_server, list(QUESTIONS), "fp32")
    assert len(answers) == len(QUESTIONS)
    assert_idle_and_nothing_leaked(smollm2_server)


@pytest.fixture(scope="module")
def smollm2_bf16_server(real_model_cache: Path) -> Iterator[ServedClient]:
    """A short-lived bf16 server (same session cache: the GGUF is already prepared)."""
    yield from serve_real_model(real_model_cache, real_model_args("bfloat16", max_total_tokens=2048))


def test_bf16_answers_are_right_through_both_clients(smollm2_bf16_server: ServedClient) -> None:
    assert smollm2_bf16_server.server_info()["server_args"]["dtype"] == "bfloat16"
    ask_both_clients(smollm2_bf16_server, BF16_QUESTIONS, "bf16")
    assert_idle_and_nothing_leaked(smollm2_bf16_server)
