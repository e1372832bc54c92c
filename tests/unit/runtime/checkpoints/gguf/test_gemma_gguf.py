"""Gemma 2 and Gemma 3 GGUF files, as llama.cpp's converters write them: norm weights stored plus
one, head_dim as ``attention.key_length`` / ``value_length``, the window as
``attention.sliding_window`` and Gemma 2's soft-caps as float keys; which layers are windowed is
not in the file (llama.cpp hard-codes every 2nd / 6th layer full).

The reference is transformers' own GGUF loading of the very file we serve. That loader rebuilds
the config from the metadata it maps and its config class's defaults for the rest (soft-caps,
query_pre_attn_scalar, the window pattern, Gemma 3's local RoPE base), so the tiny checkpoints
``gemma2_gguf`` / ``gemma3_gguf`` are those defaults (head_dim 256) with a window of 16 that the
longer prompt crosses. Greedy tokens must be equal and log-probabilities close, dense (F32, Q8_0
dequantized) and with ``--quantization gguf`` keeping the Q8_0 blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import torch

from runtime.engine.layers.embedding import VocabParallelEmbedding
from runtime.engine.model_config import ModelConfig
from runtime.engine.model_runner import ModelRunner
from runtime.engine.models.gemma_config import GemmaConfig
from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.quant.weight import QuantizedWeight
from tests.support.checkpoints import GEMMA_WINDOW, TinyCheckpoints, hf_greedy, random_prompt
from tests.support.gguf_files import gguf_test_folder, reference_tensor, write_checkpoint_gguf
from tests.support.gguf_models import gguf_runner, transformers_gguf

NEW_TOKENS = 10
PROMPT_LENS = (5, 2 * GEMMA_WINDOW + 1)  # the longer one crosses the window before decoding starts
LOGPROB_ATOL = 2e-3
# The kept-quantized kernels round each block of 32 activations to int8 (tests/support/quant_bounds.py):
# through Gemma 3's six layers a log-probability moved by up to 0.14 here, the greedy tokens not at all.
# The bound per linear is test_quant_model's; this one only catches a wrong model.
KEPT_LOGPROB_ATOL = 0.3
CHECKPOINTS = {"gemma2": "gemma2_gguf", "gemma3": "gemma3_gguf"}


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for this module's GGUF files, and a private cache for the folders prepared from them."""
    with gguf_test_folder(tmp_path_factory, "gemma-gguf") as folder:
        yield folder


def _file(tiny_checkpoints: TinyCheckpoints, files: Path, family: str, weight_type: str) -> Path:
    """The family's tiny checkpoint as a GGUF file of ``weight_type``, written once per module."""
    path = files / f"{family}-{weight_type}.gguf"
    if not path.is_file():
        write_checkpoint_gguf(tiny_checkpoints.path(CHECKPOINTS[family]), path, weight_type=weight_type)
    return path


def _assert_same_generation(runner: ModelRunner, reference: Any, atol: float = LOGPROB_ATOL) -> None:
    from tests.support.harness import Harness

    prompts = [random_prompt(n, runner.vocab_size, seed=60 + n) for n in PROMPT_LENS]
    ours = Harness(runner).generate(prompts, NEW_TOKENS, return_logprob=True)
    for prompt, req in zip(prompts, ours):
        tokens, logprobs = hf_greedy(reference, prompt, NEW_TOKENS)
        assert req.output_ids == tokens, f"prompt of length {len(prompt)}"
        assert req.logprobs == pytest.approx(logprobs, abs=atol), f"prompt of length {len(prompt)}"


@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_greedy_equals_transformers_gguf_loading(
    tiny_checkpoints: TinyCheckpoints, files: Path, family: str, weight_type: str
) -> None:
    path = _file(tiny_checkpoints, files, family, weight_type)
    runner = gguf_runner(path)
    ours, source = runner.model_config, ModelConfig.from_pretrained(tiny_checkpoints.path(CHECKPOINTS[family]))
    assert ours.family == family and ours.tie_word_embeddings
    # what the file says and the family's defaults add up to the source checkpoint's reading
    for field in ("head_dim", "layer_windows", "rope"):
        assert getattr(ours, field) == getattr(source, field), field
    # Gemma's own: the softmax scale, both soft-caps, the windowed layers and their RoPE
    assert ours.family_config_as(GemmaConfig) == source.family_config_as(GemmaConfig)
    assert None in ours.layer_windows and GEMMA_WINDOW in ours.layer_windows
    _assert_same_generation(runner, transformers_gguf(path, eager=True))


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_kept_q8_0_blocks_generate_what_transformers_does(
    tiny_checkpoints: TinyCheckpoints, files: Path, family: str
) -> None:
    """``--quantization gguf``: every linear and the (tied) embedding keep the file's Q8_0 blocks,
    whose values are the dense load's, and the model still generates transformers' tokens (its
    log-probabilities within the kernels' activation rounding)."""
    path = _file(tiny_checkpoints, files, family, "Q8_0")
    dense, kept = gguf_runner(path), gguf_runner(path, quantization="gguf")
    dense_weights = {
        name: module.weight
        for name, module in dense.model.named_modules()
        if isinstance(module, (LinearWeightLayer, VocabParallelEmbedding))
    }
    for name, module in kept.model.named_modules():
        if isinstance(module, (LinearWeightLayer, VocabParallelEmbedding)):
            weight = module.weight
            assert isinstance(weight, QuantizedWeight) and weight.source == "Q8_0", name
            assert torch.equal(weight.dequantize(), dense_weights[name]), name
    _assert_same_generation(kept, transformers_gguf(path, eager=True), atol=KEPT_LOGPROB_ATOL)


@pytest.mark.parametrize("family", sorted(CHECKPOINTS))
def test_the_file_holds_what_llama_cpps_converter_writes(
    tiny_checkpoints: TinyCheckpoints, files: Path, family: str
) -> None:
    """Every norm weight (block, sandwich, q/k and final) stored plus one, the head size and window
    keys, Gemma 2's soft-caps; and no per-layer window pattern (llama.cpp hard-codes it)."""
    from gguf import GGUFReader
    from safetensors.numpy import load_file

    path = _file(tiny_checkpoints, files, family, "F32")
    source = load_file(str(tiny_checkpoints.path(CHECKPOINTS[family]) / "model.safetensors"))
    norms = {
        "output_norm.weight": "model.norm.weight",
        "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight",
        "blk.0.post_attention_norm.weight": "model.layers.0.post_attention_layernorm.weight",
        "blk.0.ffn_norm.weight": "model.layers.0.pre_feedforward_layernorm.weight",
        "blk.0.post_ffw_norm.weight": "model.layers.0.post_feedforward_layernorm.weight",
    }
    if family == "gemma3":
        norms["blk.0.attn_q_norm.weight"] = "model.layers.0.self_attn.q_norm.weight"
        norms["blk.0.attn_k_norm.weight"] = "model.layers.0.self_attn.k_norm.weight"
    for gguf_name, hf_name in norms.items():
        np.testing.assert_array_equal(reference_tensor(path, gguf_name), source[hf_name] + np.float32(1.0))
    # (the non-norm weights as they are)
    np.testing.assert_array_equal(
        reference_tensor(path, "blk.0.attn_q.weight"), source["model.layers.0.self_attn.q_proj.weight"]
    )

    fields = GGUFReader(path, "r").fields

    def value(key: str) -> Any:
        field = fields[f"{family}.{key}"]
        return field.parts[field.data[0]][0]

    assert value("attention.key_length") == value("attention.value_length") == 256
    assert value("attention.sliding_window") == GEMMA_WINDOW
    if family == "gemma2":
        assert (value("attn_logit_softcapping"), value("final_logit_softcapping")) == (50.0, 30.0)
    else:
        assert value("rope.freq_base") == 1000000.0 and value("rope.freq_base_swa") == 10000.0
    assert f"{family}.attention.sliding_window_pattern" not in fields
