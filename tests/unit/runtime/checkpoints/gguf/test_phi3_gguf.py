"""Phi-3 GGUF files, as llama.cpp's ``phi3`` converter writes them: q, k and v rows fused in
``attn_qkv``, gate and up rows in ``ffn_up``, the rotary dims in ``rope.dimension_count`` and
LongRoPE's factors as the tensors ``rope_factors_long`` / ``rope_factors_short``.

The plain checkpoint is compared with transformers' own GGUF loading of the same file. That
loader reads neither ``rope.dimension_count`` nor the LongRoPE tensors, so the ``phi3_longrope``
file is compared with its source checkpoint instead (an F32 file holds its weights exactly).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.checkpoints.gguf.prepare import prepare_gguf
from runtime.engine.model_runner import ModelRunner
from runtime.engine.quant.weight import QuantizedWeight
from tests.support.checkpoints import PHI3_ORIGINAL_MAX, TinyCheckpoints, hf_greedy, load_hf_model, random_prompt
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.support.gguf_models import gguf_runner
from tests.support.harness import Harness
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks

NEW_TOKENS = 10
LOGPROB_ATOL = 2e-3


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "phi3-gguf") as folder:
        yield folder


def _assert_same_generation(runner: ModelRunner, reference: Any, lengths: tuple[int, ...]) -> None:
    prompts = [random_prompt(n, runner.vocab_size, seed=80 + n) for n in lengths]
    for prompt, req in zip(prompts, Harness(runner).generate(prompts, NEW_TOKENS, return_logprob=True)):
        tokens, logprobs = hf_greedy(reference, prompt, NEW_TOKENS)
        assert req.output_ids == tokens, f"prompt of length {len(prompt)}"
        assert req.logprobs == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"prompt of length {len(prompt)}"


@pytest.mark.parametrize("weight_type", ["Q8_0", "F16"])
def test_fused_file_greedy_equals_transformers_gguf_loading(
    tiny_checkpoints: TinyCheckpoints, files: Path, weight_type: str
) -> None:
    from transformers import AutoModelForCausalLM

    path = write_checkpoint_gguf(
        tiny_checkpoints.path("phi3"), files / f"phi3-{weight_type}.gguf", weight_type=weight_type
    )
    runner = gguf_runner(path)
    assert runner.model_config.architecture == "Phi3ForCausalLM"
    reference = AutoModelForCausalLM.from_pretrained(str(files), gguf_file=path.name, dtype=torch.float32).eval()
    _assert_same_generation(runner, reference, (5, 17))


def test_partial_rotary_and_longrope_file_serves_as_its_source(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    src = tiny_checkpoints.path("phi3_longrope")
    path = write_checkpoint_gguf(src, files / "phi3-longrope-F32.gguf", tokenizer=False)
    config = json.loads((prepare_gguf(path) / "config.json").read_text())
    assert config["partial_rotary_factor"] == 0.75 and config["rope_scaling"]["rope_type"] == "longrope"
    runner, source = gguf_runner(path), gguf_runner(src)
    ours, theirs = runner.model_config, source.model_config
    assert ours.rotary_dim == theirs.rotary_dim == 12
    for kind in ("short_factor", "long_factor"):  # (the file's F32, as transformers reads the config's)
        stored = torch.tensor(getattr(ours.rope, kind), dtype=torch.float32)
        assert torch.equal(stored, torch.tensor(getattr(theirs.rope, kind), dtype=torch.float32)), kind
    assert ours.rope.original_max_position_embeddings == PHI3_ORIGINAL_MAX
    # the file's fp32 attention factor scales the tables to the same bits as the config's double
    tables, source_tables = runner.model.model.rotary_emb, source.model.model.rotary_emb
    assert torch.equal(tables.cos_cache, source_tables.cos_cache)
    assert torch.equal(tables.sin_cache, source_tables.sin_cache)
    _assert_same_generation(runner, load_hf_model(src), (5, PHI3_ORIGINAL_MAX + 20))


def test_tp2_ranks_keep_their_fused_shards_quantized(
    tiny_checkpoints: TinyCheckpoints, files: Path, thread_tp_group: ThreadTPGroup
) -> None:
    """``--quantization gguf``: each rank keeps the Q8_0 blocks of its rows of the fused tensors
    (its q, k and v heads; its gate and up slices), the values of its dense shard; and the
    ranks generate what one rank does."""
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("phi3"), files / "phi3-tp-Q8_0.gguf", weight_type="Q8_0", tokenizer=False
    )
    whole = gguf_runner(path)
    prompts = [random_prompt(n, whole.vocab_size, seed=90 + n) for n in (6, 19)]
    expected = [r.output_ids for r in Harness(whole).generate(prompts, NEW_TOKENS)]
    ranks = []
    for rank in range(2):
        dense = gguf_runner(path, tp_rank=rank, tp_size=2)
        kept = gguf_runner(path, tp_rank=rank, tp_size=2, quantization="gguf")
        for layer, dense_layer in zip(kept.model.model.layers, dense.model.model.layers):
            for fused, dense_fused in (
                (layer.self_attn.qkv_proj, dense_layer.self_attn.qkv_proj),
                (layer.mlp.gate_up_proj, dense_layer.mlp.gate_up_proj),
            ):
                assert isinstance(fused.weight, QuantizedWeight) and fused.weight.source == "Q8_0"
                assert torch.equal(fused.weight.dequantize(), dense_fused.weight)
        ranks.append(dense)
    results = run_on_ranks(
        thread_tp_group, lambda rank: [r.output_ids for r in Harness(ranks[rank]).generate(prompts, NEW_TOKENS)]
    )
    assert results[0] == results[1] == expected
