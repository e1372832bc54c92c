"""Sliding-window models through ModelRunner (CPU torch-native backend, fp32) against transformers.

Two checkpoints (tests/support/checkpoints.py): ``mistral_swa`` (every layer windowed, W = 16) and
``qwen2_swa`` (4 layers, the first two full attention, the last two windowed, W = 24). The
reference is transformers' sdpa attention, whose sliding-window causal mask
(``create_sliding_window_causal_mask``) hides keys W or more positions behind each query; a
run with the windows switched off shows that the prompts below are long enough for the window
to change the tokens. Prompts and generations span several windows; prefill runs whole and in
chunks shorter and longer than W, and after a shared prefix longer than W.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_runner import ModelRunner
from tests.support.checkpoints import SWA_WINDOWS, hf_greedy, load_hf_model, random_prompt
from tests.support.harness import Harness

NEW_TOKENS = 40
PROMPT_LENS = (5, 23, 40, 70)


@pytest.fixture(scope="module", params=sorted(SWA_WINDOWS))
def swa_model(request: pytest.FixtureRequest, tiny_checkpoints: Any) -> Iterator[tuple[str, ModelRunner, Any]]:
    name = request.param
    path: Path = tiny_checkpoints.path(name)
    # One pool (the test harness hands out slots itself; the SWA pool is tests/unit/scheduler_proc/test_swa_memory.py's).
    runner = ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=8192,
        load_progress=False,
        disable_hybrid_swa_memory=True,
    )
    hf = load_hf_model(path)
    yield name, runner, hf


@pytest.fixture
def harness(swa_model: tuple[str, ModelRunner, Any]) -> Iterator[Harness]:
    h = Harness(swa_model[1])
    yield h
    h.reset()


_reference_cache: dict[tuple[str, tuple[int, ...]], list[int]] = {}


def _expected(name: str, hf: Any, prompt: list[int]) -> list[int]:
    key = (name, tuple(prompt))
    if key not in _reference_cache:
        _reference_cache[key] = hf_greedy(hf, prompt, NEW_TOKENS)[0]
    return _reference_cache[key]


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=500 + n) for n in PROMPT_LENS]


def test_config_windows_match_transformers_layer_types(swa_model) -> None:
    name, runner, hf = swa_model
    window = SWA_WINDOWS[name]
    expected = (
        tuple(window if t == "sliding_attention" else None for t in hf.config.layer_types)
        if getattr(hf.config, "layer_types", None)
        else (window,) * hf.config.num_hidden_layers
    )
    assert runner.model_config.layer_windows == expected
    assert runner.context_len == hf.config.max_position_embeddings  # not capped at the window
    specs = [layer.self_attn.spec.sliding_window for layer in runner.model.model.layers]
    assert tuple(specs) == expected


@pytest.mark.parametrize("chunk", [None, 7, 37], ids=["whole", "chunk7<W", "chunk37>W"])
def test_greedy_equals_transformers(swa_model, harness, chunk: int | None) -> None:
    name, runner, hf = swa_model
    prompts = _prompts(runner.vocab_size)
    reqs = harness.generate(prompts, NEW_TOKENS, chunk_size=chunk)
    for prompt, req in zip(prompts, reqs):
        assert req.output_ids == _expected(name, hf, prompt), f"{name}: prompt of {len(prompt)} tokens, chunk {chunk}"


def test_window_changes_the_tokens(swa_model, harness) -> None:
    """The same model with every window switched off gives other tokens: the parity above is a
    parity with a windowed reference, not with full attention."""
    name, runner, hf = swa_model
    prompts = _prompts(runner.vocab_size)
    layers = [layer.self_attn for layer in runner.model.model.layers]
    saved = [attn.spec for attn in layers]
    try:
        for attn in layers:
            attn.spec = dataclasses.replace(attn.spec, sliding_window=None)
        reqs = harness.generate(prompts, NEW_TOKENS)
    finally:
        for attn, spec in zip(layers, saved):
            attn.spec = spec
    assert any(req.output_ids != _expected(name, hf, p) for p, req in zip(prompts, reqs))


def test_shared_prefix_longer_than_the_window(swa_model, harness) -> None:
    name, runner, hf = swa_model
    first_prompt = random_prompt(60, runner.vocab_size, seed=7)
    second_prompt = first_prompt[:50] + random_prompt(12, runner.vocab_size, seed=8)
    first = harness.add_request(first_prompt)
    harness.prefill([first])
    harness.decode([first], 3)
    second = harness.add_request(second_prompt)
    harness.share_prefix(first, second, 50)
    batch, counts = harness.build_batch([second], ForwardMode.EXTEND)
    assert counts == [12] and batch.prefix_lens_cpu == [50]
    second.output_ids.append(int(runner.forward(batch).next_token_ids[0]))
    harness.decode([first, second], NEW_TOKENS - 1)  # a mixed-length decode batch
    assert first.output_ids[:NEW_TOKENS] == _expected(name, hf, first_prompt)
    assert second.output_ids == _expected(name, hf, second_prompt)


def test_mixed_batch_of_decodes_and_a_prefill(swa_model, harness) -> None:
    name, runner, hf = swa_model
    prompts = _prompts(runner.vocab_size)
    running = [harness.add_request(p) for p in prompts[:3]]
    harness.prefill(running)
    harness.decode(running, 2)
    late = harness.add_request(prompts[3])
    harness.step(running + [late], ForwardMode.MIXED)
    harness.decode(running + [late], NEW_TOKENS - 1)
    for prompt, req in zip(prompts, running + [late]):
        assert req.output_ids[:NEW_TOKENS] == _expected(name, hf, prompt)


def test_decode_mirror_serves_the_full_attention_layers(swa_model, harness) -> None:
    """The hybrid model's full-attention layers keep the CPU decode mirror (appending, not
    rebuilding, on consecutive steps); a model with every layer windowed plans none."""
    name, runner, _ = swa_model
    backend = runner.attn_backend
    full_layers = sum(w is None for w in runner.model_config.layer_windows)
    reqs = [harness.add_request(p) for p in _prompts(runner.vocab_size)[:2]]
    harness.prefill(reqs)
    plans = []
    for _ in range(3):
        batch, _counts = harness.build_batch(reqs, ForwardMode.DECODE)
        out = runner.forward(batch)
        plans.append(batch.attn_metadata.groups[0].mirror)
        for req, tok in zip(reqs, out.next_token_ids.tolist()):
            req.output_ids.append(int(tok))
    if full_layers == 0:
        assert plans == [None, None, None]
    else:
        assert backend.mirror.mirrored_layers == full_layers
        assert plans[0].rebuild and not plans[1].rebuild and not plans[2].rebuild
