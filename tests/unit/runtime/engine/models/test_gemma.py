"""The Gemma families (tiny ``gemma2`` and ``gemma3`` checkpoints, CPU fp32) against transformers.

The parametrized suites (test_model_equivalence, test_cpu_decode_layers, the speculative scheduler
tests) run both checkpoints through the model runner one batch at a time. What they do not reach
is here: how a Gemma config is read (both spellings of its RoPE and window settings), TP 2, a
whole batch of 32 through the scheduler with overlap on and off, pages of 4 with chunked prefill,
and the hybrid sliding-window pool with its radix cache: prompts longer than the windowed layers'
window, sent twice, the second time from the prefix cache.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from runtime.config.args import ServerArgs
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.gemma_config import GemmaConfig
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import (
    GEMMA_IMAGE_TOKENS,
    GEMMA_WINDOW,
    TinyCheckpoints,
    hf_greedy,
    load_hf_model,
    random_prompt,
)
from tests.support.harness import Harness
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

NEW_TOKENS = 12
GEMMAS = ("gemma2", "gemma3")


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("attention_backend", "torch_native")
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=4096, load_progress=False, **kwargs)


def _serve(runner: ModelRunner, prompts: list[list[int]], **args: Any) -> list[dict[str, Any]]:
    """Each prompt's result (greedy, EOS ignored) through an in-process scheduler over ``runner``."""
    args.setdefault("disable_overlap_schedule", True)
    sched = Scheduler(ServerArgs(max_total_tokens=runner.max_total_tokens, **args), model_runner=runner)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.handle_message(TokenizedGenerateReq(rid=str(i), input_ids=prompt, sampling_params=params))
    results = run_until_idle(sched)
    assert_idle_invariant(sched)
    return [results[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="module", params=GEMMAS)
def gemma(request: pytest.FixtureRequest, tiny_checkpoints: TinyCheckpoints) -> tuple[Path, Any]:
    path = tiny_checkpoints.path(request.param)
    return path, load_hf_model(path)


# ---- config ----------------------------------------------------------------------------


def test_gemma3_config_in_both_spellings(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """transformers 5 writes per-layer-type RoPE and ``layer_types``; older Gemma 3 configs give
    ``rope_local_base_freq``, ``rope_scaling`` and ``sliding_window_pattern``: the same model."""
    new = ModelConfig.from_pretrained(tiny_checkpoints.path("gemma3"))
    gemma = new.family_config_as(GemmaConfig)
    assert new.layer_windows == (GEMMA_WINDOW, None, GEMMA_WINDOW)
    assert gemma.rope_local is not None and gemma.local_layers == (True, False, True)
    assert [(gemma.rope_local if local else new.rope).theta for local in gemma.local_layers] == [
        10000.0,
        1000000.0,
        10000.0,
    ]
    assert (new.rope.rope_type, new.rope.factor) == ("linear", 2.0)
    assert (new.hidden_act, new.norm, new.qk_norm) == ("gelu_pytorch_tanh", "rms_unit_offset", True)
    assert gemma.attention_scaling(new.head_dim) == 32**-0.5
    raw = {k: v for k, v in new.raw.items() if k not in ("rope_parameters", "layer_types")}
    old = ModelConfig.from_dict(
        {
            **raw,
            "num_hidden_layers": 7,
            "rope_theta": 1000000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "rope_local_base_freq": 10000.0,
            "sliding_window_pattern": 3,
        },
        tmp_path,
    )
    assert old.layer_windows == (16, 16, None, 16, 16, None, 16)
    assert old.rope == new.rope and old.family_config_as(GemmaConfig).rope_local == gemma.rope_local
    default_pattern = ModelConfig.from_dict({**raw, "num_hidden_layers": 7}, tmp_path)
    assert default_pattern.layer_windows == (16,) * 5 + (None, 16)  # the family's five to one


def test_gemma2_config_alternates_and_caps(tiny_checkpoints: TinyCheckpoints) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoints.path("gemma2"))
    gemma = config.family_config_as(GemmaConfig)
    assert config.layer_windows == (GEMMA_WINDOW, None)
    assert (gemma.attn_logit_softcap, gemma.final_logit_softcap) == (2.0, 3.0)
    assert gemma.attention_scaling(config.head_dim) == 24**-0.5 and gemma.rope_local is None
    assert gemma.local_layers == (True, False)


def test_the_text_model_of_a_multimodal_gemma3_checkpoint(tiny_checkpoints: TinyCheckpoints) -> None:
    """``Gemma3ForConditionalGeneration``: its nested text config and prefixed text-model weights
    (the vision tower is not read) give transformers' greedy tokens on text prompts."""
    path = tiny_checkpoints.path("gemma3_multimodal")
    runner = _runner(path)
    assert runner.model_config.layer_windows == (GEMMA_WINDOW, None, GEMMA_WINDOW)
    hf = load_hf_model(path)
    assert type(hf).__name__ == "Gemma3ForConditionalGeneration"
    prompts = [random_prompt(n, GEMMA_IMAGE_TOKENS[0], seed=40 + n) for n in (6, 2 * GEMMA_WINDOW + 1)]
    got = [r.output_ids for r in Harness(runner).generate(prompts, NEW_TOKENS)]
    assert got == [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]


def test_a_released_multimodal_config_fills_what_its_text_config_leaves_out(tmp_path: Path) -> None:
    """Gemma 3 4B's config.json keeps in ``text_config`` only what differs from transformers'
    Gemma3TextConfig; the rest (heads, head_dim, query scale, RoPE bases) are the class defaults."""
    raw = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    config = ModelConfig.from_dict(raw, tmp_path)
    assert (config.family, config.architecture, config.hidden_size, config.num_hidden_layers) == (
        "gemma3",
        "Gemma3ForConditionalGeneration",
        2560,
        34,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (8, 4, 256)
    gemma = config.family_config_as(GemmaConfig)
    assert gemma.attention_scaling(config.head_dim) == 256**-0.5
    assert config.vocab_size == 262208 and config.tie_word_embeddings
    assert (config.rope.rope_type, config.rope.factor, config.rope.theta) == ("linear", 8.0, 1000000.0)
    assert gemma.rope_local is not None and gemma.rope_local.theta == 10000.0
    assert config.layer_windows[:6] == (1024,) * 5 + (None,)
    assert config.eos_token_ids == [1, 106]


# ---- through the scheduler --------------------------------------------------------------


@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_thirty_two_at_once_equal_transformers(gemma: tuple[Path, Any], overlap: bool) -> None:
    """Batch 32 (mixed lengths, several crossing the window), chunked prefill, overlap on and off."""
    path, hf = gemma
    runner = _runner(path, max_running_requests=32)
    rng = random.Random(7)
    prompts = [
        [rng.randrange(3, runner.vocab_size) for _ in range(rng.randrange(2, 3 * GEMMA_WINDOW))] for _ in range(32)
    ]
    results = _serve(runner, prompts, chunked_prefill_size=64, disable_overlap_schedule=not overlap)
    assert [r["ids"] for r in results] == [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]


def test_pages_of_four_and_chunks_of_eight(gemma: tuple[Path, Any]) -> None:
    """Page size 4 (the windowed layers then keep every token's KV in the one pool)."""
    path, hf = gemma
    runner = _runner(path, page_size=4, max_running_requests=8)
    prompts = [random_prompt(n, runner.vocab_size, seed=n) for n in (5, 23, 2 * GEMMA_WINDOW + 3)]
    results = _serve(runner, prompts, page_size=4, chunked_prefill_size=8)
    assert [r["ids"] for r in results] == [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]


def test_window_crossed_then_served_from_the_swa_radix_cache(gemma: tuple[Path, Any]) -> None:
    """The hybrid pool (windowed layers keep only their window's tokens) with its radix cache:
    prompts past the window, then each prompt extended (a conversation's next turn), whose cached
    prompt is matched whole."""
    path, hf = gemma
    runner = _runner(path, max_running_requests=8)
    assert runner.model_config.is_hybrid_swa
    prompts = [random_prompt(n, runner.vocab_size, seed=200 + n) for n in (3 * GEMMA_WINDOW, 4 * GEMMA_WINDOW + 5)]
    turns = [p + random_prompt(5, runner.vocab_size, seed=300 + i) for i, p in enumerate(prompts)]
    args = ServerArgs(max_total_tokens=runner.max_total_tokens, disable_overlap_schedule=True, chunked_prefill_size=24)
    sched = Scheduler(args, model_runner=runner)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for round_, batch in enumerate((prompts, turns)):
        for i, prompt in enumerate(batch):
            sched.handle_message(TokenizedGenerateReq(rid=f"{round_}-{i}", input_ids=prompt, sampling_params=params))
        results = run_until_idle(sched)
        assert [results[f"{round_}-{i}"]["ids"] for i in range(len(batch))] == [
            hf_greedy(hf, p, NEW_TOKENS)[0] for p in batch
        ]
    assert [results[f"1-{i}"]["cached"] for i in range(len(turns))] == [len(p) for p in prompts]
    assert_idle_invariant(sched)


# ---- tensor parallelism ---------------------------------------------------------------------


@pytest.mark.parametrize("name", GEMMAS)
def test_tp2_reproduces_tp1(tiny_checkpoints: TinyCheckpoints, thread_tp_group: ThreadTPGroup, name: str) -> None:
    """Heads, norms and the soft-capped logits over two ranks: the TP=2 greedy output is TP=1's."""
    path = tiny_checkpoints.path(name)
    whole = _runner(path)
    prompts = [random_prompt(n, whole.vocab_size, seed=90 + n) for n in (4, GEMMA_WINDOW + 9)]
    expected = [r.output_ids for r in Harness(whole).generate(prompts, 8)]
    ranks = [_runner(path, tp_rank=r, tp_size=2) for r in range(2)]
    outputs = run_on_ranks(
        thread_tp_group, lambda rank: [r.output_ids for r in Harness(ranks[rank]).generate(prompts, 8)]
    )
    assert outputs[0] == outputs[1] == expected
