"""Llama 3.1-style RoPE scaling in GGUF files: llama.cpp's ``rope_freqs`` divisors
(``runtime.checkpoints.gguf.rope_freqs``).

llama.cpp's converter turns a ``llama3`` rope_scaling into one divisor per rotary frequency; the
prepared config recovers the llama3 parameters where the divisors are such a curve (then the
tables are the source checkpoint's, bit for bit) and otherwise keeps the divisors, applied as
llama.cpp applies them. transformers' GGUF loader ignores the tensor, so the served model is
compared with transformers loading the source checkpoint itself (an F32 file holds its weights
exactly). The divisors are computed by the tests' writer as the converter computes them
(``llama_cpp_rope_freqs``), independently of the product's ``llama3_divisors``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from runtime.checkpoints.gguf.prepare import prepare_gguf
from runtime.checkpoints.gguf.rope_freqs import RTOL, llama3_divisors, llama3_parameters
from runtime.engine.layers.rotary import rope_inv_freq
from tests.support.checkpoints import TinyCheckpoints, hf_greedy, load_hf_model, random_prompt
from tests.support.gguf_files import gguf_test_folder, llama_cpp_rope_freqs, write_checkpoint_gguf
from tests.support.gguf_models import gguf_runner
from tests.support.harness import Harness

NEW_TOKENS = 10
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "llama3-gguf") as folder:
        yield folder


@pytest.mark.parametrize(
    ("dim", "base", "factor", "original"),
    [
        (128, 500000.0, 8.0, 8192),  # Llama 3.1 8B / 3.3 70B
        (64, 500000.0, 32.0, 8192),  # Llama 3.2 1B
        (128, 500000.0, 32.0, 8192),  # Llama 3.2 3B
        (16, 500000.0, 8.0, 64),  # the tiny llama_tied_llama3: one frequency between the bands
        (128, 10000.0, 4.0, 2048),  # another base and context
    ],
)
def test_the_divisors_give_back_the_llama3_parameters(dim: int, base: float, factor: float, original: int) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": base,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original,
    }
    divisors = llama_cpp_rope_freqs(rope, dim)
    assert 1.0 in divisors and factor in divisors  # both bands present
    # (numpy's fp32 pow and torch's may round a value one ulp apart)
    np.testing.assert_allclose(llama3_divisors(base, dim, factor, 1.0, 4.0, original), divisors, rtol=RTOL, atol=0)
    assert llama3_parameters(divisors, base) == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_divisors_of_no_llama3_curve_are_applied_as_llama_cpp_does(
    tiny_checkpoints: TinyCheckpoints, files: Path
) -> None:
    """Divisors that no llama3 curve gives stay per frequency: inv_freq_i = base^(-2i/d) /
    divisor_i, in one table (the LongRoPE description never switches to its long set: its
    original context is the model's)."""
    divisors = np.array([1.0, 1.0, 1.5, 2.5, 3.0, 7.0, 8.0, 8.0], dtype=np.float32)
    assert llama3_parameters(divisors, 10000.0) is None
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("llama"),
        files / "llama-freqs.gguf",
        tokenizer=False,
        extra=lambda w: w.add_tensor("rope_freqs.weight", divisors),
    )
    runner = gguf_runner(path)
    rope = runner.model_config.rope
    assert (rope.rope_type, rope.attention_factor) == ("longrope", 1.0)
    assert rope.short_factor == rope.long_factor == tuple(float(d) for d in divisors)
    exponents = np.arange(0, 16, 2, dtype=np.float64) / 16
    expected = torch.tensor(rope.theta**-exponents / divisors.astype(np.float64), dtype=torch.float32)
    torch.testing.assert_close(rope_inv_freq(16, rope), expected, rtol=1e-6, atol=0.0)
    tables = runner.model.model.rotary_emb
    assert tables.long_after is None and tables.cos_cache.shape[0] == tables.max_position
    positions = torch.arange(tables.max_position, dtype=torch.float32)[:, None]
    torch.testing.assert_close(tables.cos_cache, (positions * rope_inv_freq(16, rope)[None, :]).cos())


def test_a_file_of_ones_has_no_scaling(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("llama"),
        files / "llama-ones.gguf",
        tokenizer=False,
        extra=lambda w: w.add_tensor("rope_freqs.weight", np.ones(8, np.float32)),
    )
    assert "rope_scaling" not in json.loads((prepare_gguf(path) / "config.json").read_text())


def test_llama3_file_serves_as_its_source(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    """The tiny Llama 3 (factor 8, original context 64) as llama.cpp converts it: the recovered
    scaling is the source's, so are the cos / sin tables, and the greedy tokens are
    transformers' from the source folder, for prompts within and past the original context."""
    src = tiny_checkpoints.path("llama_tied_llama3")
    path = write_checkpoint_gguf(src, files / "llama3-F32.gguf", tokenizer=False)
    config = json.loads((prepare_gguf(path) / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3"
    runner, source = gguf_runner(path), gguf_runner(src)
    assert runner.model_config.rope == source.model_config.rope
    assert runner.model_config.tie_word_embeddings
    ours, theirs = runner.model.model.rotary_emb, source.model.model.rotary_emb
    assert torch.equal(ours.cos_cache, theirs.cos_cache) and torch.equal(ours.sin_cache, theirs.sin_cache)

    reference: Any = load_hf_model(src)
    prompts = [random_prompt(n, runner.vocab_size, seed=50 + n) for n in (5, 80)]
    for prompt, req in zip(prompts, Harness(runner).generate(prompts, NEW_TOKENS, return_logprob=True)):
        tokens, logprobs = hf_greedy(reference, prompt, NEW_TOKENS)
        assert req.output_ids == tokens, f"prompt of length {len(prompt)}"
        assert req.logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"prompt of length {len(prompt)}"
