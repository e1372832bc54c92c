"""ModelRunner.forward contract: greedy fallback, the Sampler path, logprobs, dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.sampling_params import SamplingParams
from tests.support.checkpoints import random_prompt
from tests.support.harness import Harness


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    return ModelRunner(tiny_llama_path, device="cpu", dtype="float32", max_total_tokens=4096, load_progress=False)


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=300 + n) for n in (4, 9, 21)]


def test_sampler_greedy_params_equal_builtin_argmax(runner: ModelRunner) -> None:
    prompts = _prompts(runner.vocab_size)
    h = Harness(runner)
    plain = h.generate(prompts, 6, return_logprob=True)
    h.reset()
    via_sampler = h.generate(prompts, 6, return_logprob=True, sampling_params=[SamplingParams(temperature=0.0)] * 3)
    h.reset()
    for a, b in zip(plain, via_sampler):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_seeded_sampling_is_reproducible_and_batch_independent(runner: ModelRunner) -> None:
    prompts = _prompts(runner.vocab_size)
    params = [SamplingParams(temperature=1.0, top_k=20, seed=11 + i) for i in range(3)]
    h = Harness(runner)
    together = [r.output_ids for r in h.generate(prompts, 8, sampling_params=params)]
    h.reset()
    alone = h.generate(prompts[1:2], 8, sampling_params=params[1:2])[0].output_ids
    h.reset()
    assert alone == together[1]


def test_output_fields(runner: ModelRunner) -> None:
    h = Harness(runner)
    reqs = [h.add_request(p) for p in _prompts(runner.vocab_size)]
    batch, _ = h.build_batch(reqs, ForwardMode.EXTEND, return_logprob=True)
    out = runner.forward(batch, top_logprobs_num=5)
    h.reset()
    assert out.next_token_ids.dtype == torch.int64 and out.next_token_ids.shape == (3,)
    assert out.logits is not None and out.logits.dtype == torch.float32 and out.logits.shape == (3, runner.vocab_size)
    expected = torch.log_softmax(out.logits, -1)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs, expected.gather(1, out.next_token_ids[:, None]).squeeze(1))
    assert out.top_logprobs is not None
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (3, 5)
    assert torch.equal(ids[:, 0], out.next_token_ids)  # greedy picks the best logprob


def test_bfloat16_runner_is_close_to_fp32(tiny_llama_path: Path, runner: ModelRunner) -> None:
    bf16 = ModelRunner(tiny_llama_path, device="cpu", dtype="bfloat16", max_total_tokens=4096, load_progress=False)
    assert bf16.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
    prompts = _prompts(runner.vocab_size)
    logits = []
    for r in (runner, bf16):
        h = Harness(r)
        reqs = [h.add_request(p) for p in prompts]
        batch, _ = h.build_batch(reqs, ForwardMode.EXTEND)
        logits.append(r.forward(batch).logits)
        h.reset()
    assert logits[1].dtype == torch.float32
    scale = logits[0].abs().max()
    assert (logits[0] - logits[1]).abs().max() < 0.05 * scale
