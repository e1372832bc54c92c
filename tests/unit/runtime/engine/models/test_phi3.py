"""The Phi-3 family (tiny ``phi3`` and ``phi3_longrope`` checkpoints, CPU fp32) against transformers.

What the parametrized suites (test_model_equivalence, test_cpu_decode_layers, the speculative
scheduler tests) do not reach: the fused ``qkv_proj`` / ``gate_up_proj`` split over TP ranks, and
LongRoPE past ``original_max_position_embeddings`` (the parametrized sequences stay within it).

LongRoPE's rule, as transformers' ``generate`` applies it: every cached key of a sequence is
rotated with the short factors while it is at most ``original_max_position_embeddings`` long, and
with the long factors, all of them, once it is longer (a prompt past it is one forward with the
long factors; the step at which a sequence outgrows it re-runs the whole sequence,
``Phi3ForCausalLM.prepare_inputs_for_generation``). The model reads which requests are long from
the batch (``ForwardBatch.long_rope``, the scheduler's choice) or, in a batch without it (the
harness here), from each request's length after the forward; the scheduler's side (recomputing a
request that decodes across the limit, long chunks below it, the prefix cache's namespaces) is
tested against ``generate`` in ``tests/unit/scheduler_proc/test_longrope_crossing.py``.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.config.args import ServerArgs
from runtime.engine.config_reading import UnsupportedModelError
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import PHI3_ORIGINAL_MAX, TinyCheckpoints, hf_greedy, load_hf_model, random_prompt
from tests.support.harness import Harness
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

NEW_TOKENS = 16
ORIG = PHI3_ORIGINAL_MAX


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("attention_backend", "torch_native")
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=4096, load_progress=False, **kwargs)


@pytest.fixture(scope="module")
def longrope(tiny_checkpoints: TinyCheckpoints) -> tuple[ModelRunner, Any]:
    path = tiny_checkpoints.path("phi3_longrope")
    return _runner(path), load_hf_model(path)


# ---- config and tables -----------------------------------------------------------------


def test_config_reads_partial_rotary_and_longrope(tiny_checkpoints: TinyCheckpoints) -> None:
    config = ModelConfig.from_pretrained(tiny_checkpoints.path("phi3_longrope"))
    rope = config.rope
    assert (config.family, config.head_dim, config.rotary_dim) == ("phi3", 16, 12)
    assert (rope.rope_type, rope.original_max_position_embeddings) == ("longrope", ORIG)
    assert len(rope.short_factor) == len(rope.long_factor) == 6
    # no ``factor``: the context's growth 512 / ORIG sets the attention factor
    assert rope.attention_factor == pytest.approx(math.sqrt(1 + math.log(512 / ORIG) / math.log(ORIG)))
    plain = ModelConfig.from_pretrained(tiny_checkpoints.path("phi3"))
    assert (plain.rotary_dim, plain.rope.rope_type, plain.rope.attention_factor) == (16, "default", 1.0)


def test_su_is_longrope_and_the_factors_are_required(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    raw = ModelConfig.from_pretrained(tiny_checkpoints.path("phi3_longrope")).raw
    params = {k: v for k, v in raw["rope_parameters"].items() if k != "rope_type"}
    su = ModelConfig.from_dict({**raw, "rope_parameters": None, "rope_scaling": {**params, "type": "su"}}, tmp_path)
    assert su.rope == ModelConfig.from_dict(raw, tmp_path).rope
    given = {**params, "rope_type": "longrope", "attention_factor": 1.25, "factor": 3.0}
    assert ModelConfig.from_dict({**raw, "rope_parameters": given}, tmp_path).rope.attention_factor == 1.25
    without = {k: v for k, v in raw["rope_parameters"].items() if k != "long_factor"}
    with pytest.raises(UnsupportedModelError, match="long_factor"):
        ModelConfig.from_dict({**raw, "rope_parameters": without}, tmp_path)


@pytest.mark.parametrize("name", ["phi3", "phi3_longrope"])
def test_rotary_tables_equal_transformers(tiny_checkpoints: TinyCheckpoints, name: str) -> None:
    """Every row of the short and long tables bit for bit as transformers' rotary embedding makes
    them for a forward within, and one past, original_max_position_embeddings."""
    path = tiny_checkpoints.path(name)
    runner, hf = _runner(path), load_hf_model(path)
    table = runner.model.model.rotary_emb
    rows = table.max_position
    half = table.rotary_dim // 2
    sets = [(torch.arange(ORIG)[None], 0)]
    if name == "phi3_longrope":
        assert table.cos_cache.shape == (2 * rows, half)  # short rows, then long rows
        sets.append((torch.arange(rows)[None], rows))
    for positions, offset in sets:
        cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
        n = positions.shape[1]
        assert torch.equal(table.cos_cache[offset : offset + n], cos[0, :, :half])
        assert torch.equal(table.sin_cache[offset : offset + n], sin[0, :, :half])


def test_long_rows_per_request(longrope: tuple[ModelRunner, Any]) -> None:
    """An extend's tokens read the long rows when its sequence outgrows ORIG; a decode or verify
    token when its own position does."""
    runner, _ = longrope
    h = Harness(runner)
    crossing, within = h.add_request(random_prompt(ORIG + 4, 300, seed=1)), h.add_request([5, 6, 7])
    batch, _ = h.build_batch([crossing, within], ForwardMode.EXTEND)
    table = runner.model.model.rotary_emb
    rows = table.table_positions(batch)
    assert torch.equal(rows[: ORIG + 4], torch.arange(ORIG + 4) + table.max_position)
    assert torch.equal(rows[ORIG + 4 :], torch.arange(3))
    for mode in (ForwardMode.DECODE, ForwardMode.VERIFY):
        batch.forward_mode = mode
        batch.positions = torch.tensor([ORIG - 2, ORIG - 1, ORIG, ORIG + 1])
        long = torch.tensor([0, 0, 1, 1]) * table.max_position
        assert torch.equal(table.table_positions(batch), batch.positions + long)
    h.reset()


# ---- greedy against transformers ------------------------------------------------------


def test_prompts_across_original_max_equal_transformers(longrope: tuple[ModelRunner, Any]) -> None:
    """One batch: prompts past ORIG (long factors for all their tokens) next to ones within it."""
    runner, hf = longrope
    prompts = [random_prompt(n, runner.vocab_size, seed=200 + n) for n in (ORIG + 1, 20, ORIG + 37, 150, 7)]
    for prompt, req in zip(prompts, Harness(runner).generate(prompts, NEW_TOKENS)):
        assert req.output_ids == hf_greedy(hf, prompt, NEW_TOKENS)[0], f"prompt of length {len(prompt)}"


def test_mixed_batch_with_a_crossing_extend(longrope: tuple[ModelRunner, Any]) -> None:
    runner, hf = longrope
    prompts = [random_prompt(n, runner.vocab_size, seed=300 + n) for n in (12, ORIG + 20, 130)]
    h = Harness(runner)
    running = [h.add_request(p) for p in prompts[:2]]
    h.prefill(running)
    h.decode(running, 2)
    late = h.add_request(prompts[2])
    h.step(running + [late], ForwardMode.MIXED)  # 2 decode rows (one long, one short) + a long extend
    h.decode(running + [late], NEW_TOKENS - 1)
    for prompt, req in zip(prompts, running + [late]):
        assert req.output_ids[:NEW_TOKENS] == hf_greedy(hf, prompt, NEW_TOKENS)[0]
    h.reset()


def test_the_batch_choice_overrides_the_length_rule(longrope: tuple[ModelRunner, Any]) -> None:
    """With ``batch.long_rope`` (the scheduler's per-request choice) a chunk ending below ORIG of a
    prompt past it reads the long rows, and a request marked short the short ones; decode and
    verify rows still go by position (past ORIG only long requests decode)."""
    runner, _ = longrope
    h = Harness(runner)
    chunk, other = h.add_request(random_prompt(ORIG - 10, 300, seed=2)), h.add_request([5, 6, 7])
    batch, _ = h.build_batch([chunk, other], ForwardMode.EXTEND)
    table = runner.model.model.rotary_emb
    assert torch.equal(table.table_positions(batch)[: ORIG - 10], torch.arange(ORIG - 10))  # (by length: short)
    batch.long_rope = torch.tensor([True, False])
    rows = table.table_positions(batch)
    assert torch.equal(rows[: ORIG - 10], torch.arange(ORIG - 10) + table.max_position)
    assert torch.equal(rows[ORIG - 10 :], torch.arange(3))
    batch.forward_mode = ForwardMode.DECODE
    batch.positions = torch.tensor([ORIG - 1, ORIG])
    assert torch.equal(table.table_positions(batch), batch.positions + torch.tensor([0, 1]) * table.max_position)
    h.reset()


def _serve(runner: ModelRunner, prompts: list[list[int]], **args: Any) -> list[list[int]]:
    """Greedy outputs (EOS ignored) of ``prompts`` through an in-process scheduler over ``runner``."""
    sched = Scheduler(
        ServerArgs(max_total_tokens=runner.max_total_tokens, disable_overlap_schedule=True, **args),
        model_runner=runner,
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        sched.handle_message(TokenizedGenerateReq(rid=str(i), input_ids=prompt, sampling_params=params))
    results = run_until_idle(sched)
    assert_idle_invariant(sched)
    return [results[str(i)]["ids"] for i in range(len(prompts))]


def test_pages_of_four_and_chunked_prefill_through_the_scheduler(tiny_checkpoints: TinyCheckpoints) -> None:
    """Page size 4, prompts in chunks: short prompts in chunks of 8; a long one in chunks that end
    below ORIG, or whose first already crosses it (every chunk rotates with the long factors, as
    its one-forward prefill in transformers does)."""
    path = tiny_checkpoints.path("phi3_longrope")
    hf = load_hf_model(path)
    runner = _runner(path, page_size=4, max_running_requests=8)
    rng = random.Random(5)
    short = [[rng.randrange(3, runner.vocab_size) for _ in range(n)] for n in (9, 23, 30)]
    assert _serve(runner, short, page_size=4, chunked_prefill_size=8) == [
        hf_greedy(hf, p, NEW_TOKENS)[0] for p in short
    ]
    long = [rng.randrange(3, runner.vocab_size) for _ in range(ORIG + 60)]
    expected = [hf_greedy(hf, long, NEW_TOKENS)[0]]
    for chunk in (32, (ORIG // 4 + 2) * 4):  # below ORIG; past it, in whole pages
        assert _serve(runner, [long], page_size=4, chunked_prefill_size=chunk) == expected


# ---- tensor parallelism --------------------------------------------------------------------


@pytest.mark.parametrize("name", ["phi3", "phi3_longrope"])
def test_fused_weights_split_over_tp2_reproduce_tp1(
    tiny_checkpoints: TinyCheckpoints, thread_tp_group: ThreadTPGroup, name: str
) -> None:
    """Each rank's qkv rows are its query heads and its KV head, its gate/up rows its slice of
    each, cut from the fused tensors; the TP=2 greedy output is TP=1's."""
    path = tiny_checkpoints.path(name)
    whole = _runner(path)
    prompts = [random_prompt(n, whole.vocab_size, seed=60 + n) for n in (5, ORIG + 9)]
    expected = [r.output_ids for r in Harness(whole).generate(prompts, 8)]
    ranks = [_runner(path, tp_rank=r, tp_size=2) for r in range(2)]

    full = whole.model.model.layers[1]
    q, kv, inter = 64, 32, 128  # rows of q (4 heads x 16), of k or v (2 heads), of gate or up
    full_qkv, full_gate_up = full.self_attn.qkv_proj.weight, full.mlp.gate_up_proj.weight
    for rank, runner in enumerate(ranks):
        layer = runner.model.model.layers[1]
        q_rows = full_qkv[rank * q // 2 : (rank + 1) * q // 2]
        k_rows = full_qkv[q + rank * kv // 2 : q + (rank + 1) * kv // 2]
        v_rows = full_qkv[q + kv + rank * kv // 2 : q + kv + (rank + 1) * kv // 2]
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q_rows, k_rows, v_rows]))
        half = inter // 2
        gate, up = (
            full_gate_up[rank * half : (rank + 1) * half],
            full_gate_up[inter + rank * half : inter + (rank + 1) * half],
        )
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate, up]))

    outputs = run_on_ranks(
        thread_tp_group, lambda rank: [r.output_ids for r in Harness(ranks[rank]).generate(prompts, 8)]
    )
    assert outputs[0] == outputs[1] == expected


def test_fused_tensor_of_the_wrong_size_is_named(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from runtime.engine.layers.linear import WeightShapeError
    from tests.support.checkpoints import copy_checkpoint

    broken = copy_checkpoint(tiny_checkpoints.path("phi3"), tmp_path / "ckpt")
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16]  # a KV head short
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightShapeError, match=name):
        _runner(broken)
