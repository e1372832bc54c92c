"""ModelRunner (torch_native attention, fp32 CPU) against transformers, for every tiny architecture.

Each test runs for llama, mistral (GQA group 4), qwen2 (qkv bias, linear RoPE), qwen3
(q/k norm, explicit head_dim) and a Llama with tied embeddings and llama3 RoPE.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import hf_greedy, load_hf_model, random_prompt
from tests.support.harness import Harness

NEW_TOKENS = 24
BATCH_PROMPT_LENS = (1, 3, 7, 12, 20, 33, 47, 60)


class Reference:
    """transformers' greedy output per prompt, computed once per (checkpoint, prompt)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._cache: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def greedy(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(prompt)
        if key not in self._cache:
            self._cache[key] = hf_greedy(self.model, prompt, NEW_TOKENS)
        return self._cache[key]


@pytest.fixture(scope="module")
def runner_and_ref(tiny_checkpoint: tuple[str, Path]) -> Iterator[tuple[ModelRunner, Reference]]:
    _, path = tiny_checkpoint
    runner = ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=8192,
        load_progress=False,
    )
    yield runner, Reference(load_hf_model(path))


@pytest.fixture
def harness(runner_and_ref: tuple[ModelRunner, Reference]) -> Iterator[Harness]:
    h = Harness(runner_and_ref[0])
    yield h
    h.reset()


def _batch_prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=100 + n) for n in BATCH_PROMPT_LENS]


def test_single_prompt_greedy_equals_transformers(runner_and_ref, harness) -> None:
    runner, ref = runner_and_ref
    prompt = random_prompt(13, runner.vocab_size, seed=1)
    (req,) = harness.generate([prompt], NEW_TOKENS)
    expected, _ = ref.greedy(prompt)
    assert len(expected) == NEW_TOKENS
    assert req.output_ids == expected


def test_batch_of_different_lengths_equals_transformers_per_prompt(runner_and_ref, harness) -> None:
    runner, ref = runner_and_ref
    prompts = _batch_prompts(runner.vocab_size)
    reqs = harness.generate(prompts, NEW_TOKENS)
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == ref.greedy(prompt)[0], f"prompt of length {len(prompt)}"


def test_shared_prefix_reuses_cached_kv(runner_and_ref, harness) -> None:
    runner, ref = runner_and_ref
    first_prompt = random_prompt(30, runner.vocab_size, seed=2)
    second_prompt = first_prompt[:20] + random_prompt(15, runner.vocab_size, seed=3)
    first = harness.add_request(first_prompt)
    harness.prefill([first])
    harness.decode([first], 3)

    second = harness.add_request(second_prompt)
    harness.share_prefix(first, second, 20)
    prefix_slots = list(second.slots)
    batch, counts = harness.build_batch([second], ForwardMode.EXTEND)
    assert counts == [15] and batch.prefix_lens_cpu == [20]  # only the new part runs
    out = runner.forward(batch)
    second.output_ids.append(int(out.next_token_ids[0]))
    # Both decode together from here; the shared slots are read by both requests.
    harness.decode([first, second], NEW_TOKENS - 1)
    assert second.slots[:20] == prefix_slots == first.slots[:20]
    assert first.output_ids[:NEW_TOKENS] == ref.greedy(first_prompt)[0]
    assert second.output_ids == ref.greedy(second_prompt)[0]


def test_chunked_prefill_equals_unchunked(runner_and_ref, harness) -> None:
    runner, ref = runner_and_ref
    prompts = _batch_prompts(runner.vocab_size)
    whole = harness.generate(prompts, NEW_TOKENS, return_logprob=True)
    chunked = harness.generate(prompts, NEW_TOKENS, chunk_size=7, return_logprob=True)
    for prompt, a, b in zip(prompts, whole, chunked):
        assert b.output_ids == a.output_ids == ref.greedy(prompt)[0]
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)


def test_logprobs_match_transformers_log_softmax(runner_and_ref, harness) -> None:
    runner, ref = runner_and_ref
    prompts = _batch_prompts(runner.vocab_size)[::2]
    reqs = harness.generate(prompts, NEW_TOKENS, return_logprob=True)
    for prompt, req in zip(prompts, reqs):
        tokens, logprobs = ref.greedy(prompt)
        assert req.output_ids == tokens
        assert len(req.logprobs) == NEW_TOKENS
        assert torch.allclose(torch.tensor(req.logprobs), torch.tensor(logprobs), atol=1e-4, rtol=0)


def test_mixed_batch_of_decodes_and_a_prefill(runner_and_ref, harness) -> None:
    runner, ref = runner_and_ref
    prompts = _batch_prompts(runner.vocab_size)
    running = [harness.add_request(p) for p in prompts[:4]]
    harness.prefill(running)
    harness.decode(running, 2)
    late = harness.add_request(prompts[6])
    harness.step(running + [late], ForwardMode.MIXED)  # 4 decode rows + one 47-token extend
    harness.decode(running + [late], NEW_TOKENS - 1)
    for prompt, req in zip(prompts[:4] + [prompts[6]], running + [late]):
        assert req.output_ids[:NEW_TOKENS] == ref.greedy(prompt)[0]
