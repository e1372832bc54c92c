"""A quantized KV cache (--kv-cache-dtype) on tiny checkpoints of several families, through ModelRunner.

Greedy equality with the unquantized cache is not expected (the values attention reads changed); what
is checked is what holds:

- teacher-forced along the unquantized cache's greedy tokens, the log-probability of each step's greedy
  token stays within a bound per format (int8 tightest, fp8_e5m2's two-bit mantissa loosest), are not all equal (the cache
  really is quantized), and the argmax agrees wherever the unquantized step's top-two margin exceeds
  twice that bound;
- a prompt reads the same values however its keys got into the cache: one prefill, chunked prefill, or
  a prefix another request cached (an extend's new tokens attend to their stored values too);
- the pool's bytes per token and the CPU default pool's tokens follow the format;
- TP=2 ranks, each quantizing its own KV heads, give TP=1's greedy output.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import TinyCheckpoints, random_prompt
from tests.support.harness import Harness
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

FAMILIES = ("llama", "qwen2_swa", "gemma3", "phi3")
# Largest |log-probability| change of the unquantized cache's greedy token at any teacher-forced step,
# per format (measured on these checkpoints: int8 <= 0.09, fp8_e4m3 <= 0.44, fp8_e5m2 <= 0.54, the
# largest on gemma3's: about twice that, so that another CPU's summation order cannot cross it).
DRIFT_BOUND = {"int8": 0.2, "fp8_e4m3": 0.8, "fp8_e5m2": 1.0}
FORCED_STEPS = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("kv_dtype_ckpts"))


def _runner(path: Path, kv_cache_dtype: str, **kwargs: object) -> ModelRunner:
    args: dict[str, object] = {"max_total_tokens": 512, **kwargs}
    return ModelRunner(
        str(path), device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype, load_progress=False, **args
    )


def _forced_logprobs(runner: ModelRunner, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """``[len(forced) + 1, vocab]`` log-softmax after the prompt and after each forced token (decode steps:
    every one reads the cache)."""
    harness = Harness(runner)
    req = harness.add_request(prompt)
    batch, _ = harness.build_batch([req], ForwardMode.EXTEND)
    rows = [runner.compute_logits(batch)[0]]
    for token in forced:
        req.output_ids.append(token)
        batch, _ = harness.build_batch([req], ForwardMode.DECODE)
        rows.append(runner.compute_logits(batch)[0])
    return torch.log_softmax(torch.stack(rows).float(), dim=-1)


@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_drift_is_bounded_and_argmax_agrees_where_the_margin_is_clear(
    checkpoints: TinyCheckpoints, family: str
) -> None:
    path = checkpoints.path(family)
    base_runner = _runner(path, "auto")
    prompts = [random_prompt(n, base_runner.vocab_size, seed) for n, seed in ((40, 1), (70, 2))]
    baselines = []
    for prompt in prompts:
        greedy = Harness(base_runner).generate([prompt], FORCED_STEPS)[0].output_ids
        baselines.append((prompt, greedy[:-1], _forced_logprobs(base_runner, prompt, greedy[:-1])))
    for kv_dtype, bound in DRIFT_BOUND.items():
        runner = _runner(path, kv_dtype)
        assert runner.token_to_kv_pool.format.name == kv_dtype
        largest = 0.0
        for prompt, forced, base in baselines:
            got = _forced_logprobs(runner, prompt, forced)
            chosen = base.argmax(-1, keepdim=True)  # the unquantized cache's greedy token at each step
            drift = (got.gather(1, chosen) - base.gather(1, chosen)).abs()[:, 0]  # [steps]
            largest = max(largest, float(drift.max()))
            assert float(drift.max()) <= bound, f"{family} {kv_dtype}: drift {drift.tolist()}"
            top2 = base.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * bound
            assert torch.equal(got.argmax(-1)[clear], base.argmax(-1)[clear]), f"{family} {kv_dtype}"
        assert largest > 0.0, f"{family} {kv_dtype}: the logits did not move: is the cache quantized?"


@pytest.mark.parametrize("family", ["llama", "qwen2_swa"])
@pytest.mark.parametrize("kv_dtype", list(DRIFT_BOUND))
def test_a_prompt_reads_the_same_values_chunked_cached_or_in_one_prefill(
    checkpoints: TinyCheckpoints, kv_dtype: str, family: str
) -> None:
    runner = _runner(checkpoints.path(family), kv_dtype)
    prompt = random_prompt(48, runner.vocab_size, 7)
    whole = Harness(runner).generate([prompt], 6, return_logprob=True)[0]
    chunked = Harness(runner).generate([prompt], 6, chunk_size=16, return_logprob=True)[0]
    harness = Harness(runner)
    first, second = harness.prefill_sharing([prompt, prompt[:40] + prompt[40:]], shared_prefix=40)
    harness.decode([first, second], 5, return_logprob=True)
    for other in (chunked, second):
        assert other.output_ids == whole.output_ids
        # (the decode steps': the same values read, summed in another order where two requests share
        # a prefix: the cascade attends to it once for both)
        assert other.logprobs[-5:] == pytest.approx(whole.logprobs[-5:], abs=1e-3)


def test_the_cpu_default_pool_holds_more_tokens_of_a_narrower_cache(checkpoints: TinyCheckpoints) -> None:
    """The CPU pool is sized by the work's need in the model dtype's bytes: an int8 cache of an fp32 model
    (D + 4 bytes a head against 4 D) holds about 4 D / (D + 4) times the tokens in the same memory."""
    path = checkpoints.path("llama")
    dense = ModelRunner(str(path), device="cpu", dtype="float32", max_running_requests=4, load_progress=False)
    quant = ModelRunner(
        str(path), device="cpu", dtype="float32", max_running_requests=4, kv_cache_dtype="int8", load_progress=False
    )
    d = dense.model_config.head_dim
    assert quant.token_to_kv_pool.bytes_per_token() * 4 * d == dense.token_to_kv_pool.bytes_per_token() * (d + 4)
    ratio = quant.max_total_tokens / dense.max_total_tokens
    assert ratio == pytest.approx(4 * d / (d + 4), rel=0.02)
    assert quant.kv_pool.kv_dtype == "int8" and dense.kv_pool.kv_dtype == "float32"
    assert quant.kv_pool.kv_bytes_per_token == quant.token_to_kv_pool.bytes_per_token()
    assert quant.kv_pool.bytes is not None and dense.kv_pool.bytes is not None
    assert quant.kv_pool.bytes == pytest.approx(dense.kv_pool.bytes, rel=0.02)  # the same memory
    assert " in int8, " in quant.kv_pool.log_line()


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_tp2_ranks_quantize_their_own_heads_as_tp1_does(
    checkpoints: TinyCheckpoints, thread_tp_group: ThreadTPGroup, kv_dtype: str
) -> None:
    """A (token, KV head) row is quantized on its own (int8's scale) or by its layer's scale (fp8), so each
    rank's half of the heads holds the same stored values as the whole model's pool: the greedy output
    of TP=2 is TP=1's, with the same quantized cache."""
    path = checkpoints.path("llama")
    whole = _runner(path, kv_dtype)
    prompts = [random_prompt(n, whole.vocab_size, seed=80 + n) for n in (9, 41)]
    expected = [r.output_ids for r in Harness(whole).generate(prompts, 6)]
    ranks = [_runner(path, kv_dtype, tp_rank=r, tp_size=2) for r in range(2)]
    assert ranks[0].token_to_kv_pool.bytes_per_token() * 2 == whole.token_to_kv_pool.bytes_per_token()
    outputs = run_on_ranks(
        thread_tp_group, lambda rank: [r.output_ids for r in Harness(ranks[rank]).generate(prompts, 6)]
    )
    assert outputs[0] == outputs[1] == expected
