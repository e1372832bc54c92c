"""Models loaded with ``--quantization`` (runtime/engine/quant): which weights stay quantized, that their
values are the file's (the dense load's, bit for bit), each linear within the kernels' derived
error bound of its dequantized fp32 reference, the resident bytes the formats say, and the one-call
decode path (csrc/decode_layers.c, its qf32 set) equal to the layers run one by one.

The real model's answers with quantized weights are checked end to end in
tests/e2e/test_quantized_e2e.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.engine.cpu import attention_kernels_f32, decode_layers
from runtime.engine.layers.embedding import VocabParallelEmbedding
from runtime.engine.model_runner import ModelRunner
from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.quant.weight import QuantizedBands, QuantizedWeight, reference_linear, weight_blocks
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.support.quant_bounds import quantized_linear_bound
from tests.unit.runtime.engine.cpu import test_cpu_decode_layers
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import _decode_logits

calls = test_cpu_decode_layers.calls  # (its fixture: which forwards the one-call path ran)


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "quant-model") as folder:
        yield folder


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype="float32", max_total_tokens=2048, load_progress=False, **kwargs)


def _modules(runner: ModelRunner) -> dict[str, Any]:
    """Every linear layer and the embedding, by module name."""
    return {
        name: module
        for name, module in runner.model.named_modules()
        if isinstance(module, (LinearWeightLayer, VocabParallelEmbedding))
    }


def _weights(runner: ModelRunner) -> dict[str, Any]:
    """Every linear's and the embedding's weight, by module name (a linear's values where only its packed
    copy holds them: ``LinearWeightLayer.weight_values``)."""
    return {
        name: module.weight_values() if isinstance(module, LinearWeightLayer) else module.weight
        for name, module in _modules(runner).items()
    }


def _gguf(tiny_checkpoints: TinyCheckpoints, files: Path, name: str, weight_type: str, **kwargs: Any) -> Path:
    return write_checkpoint_gguf(
        tiny_checkpoints.path(name),
        files / f"{name}-{weight_type}.gguf",
        weight_type=weight_type,
        tokenizer=False,
        **kwargs,
    )


@pytest.mark.parametrize(
    ("weight_type", "tie"), [("Q4_1", True), ("Q8_0", False), ("Q4_0", False), ("Q5_0", False), ("Q5_1", False)]
)
def test_gguf_weights_stay_in_their_blocks_with_the_files_values(
    tiny_checkpoints: TinyCheckpoints, files: Path, weight_type: str, tie: bool
) -> None:
    """The real model's mix: Q4_1 linears and a Q8_0 token embedding, tied to the LM head."""
    types = {"token_embd.weight": "Q8_0"} if tie else None
    path = _gguf(tiny_checkpoints, files, "llama", weight_type, tie=tie, types=types)
    dense, quantized = _runner(path), _runner(path, quantization="gguf")
    dense_weights, kept = _weights(dense), _weights(quantized)
    for name, weight in kept.items():
        assert isinstance(weight, QuantizedWeight), name
        want = "Q8_0" if tie and name in ("model.embed_tokens", "lm_head") else weight_type
        assert weight.source == want, name
        assert torch.equal(weight.dequantize(), dense_weights[name]), name  # Q/K rows un-interleaved alike
    if tie:
        assert kept["lm_head"] is kept["model.embed_tokens"]
    # resident bytes: the formats' (q8: 1 + 4/32 bytes a value, q4: 0.5 + 8/32), the rest dense fp32
    values = {name: w.shape[0] * w.shape[1] for name, w in kept.items() if not (tie and name == "lm_head")}
    per_value = {"Q8_0": 1.125, "Q4_0": 0.75, "Q4_1": 0.75, "Q5_0": 1.125, "Q5_1": 1.25}
    expected = sum(int(n * per_value[kept[name].source]) for name, n in values.items())
    rest = dense.weight_bytes() - sum(n * 4 for n in values.values())  # norms, rotary tables: dense in both
    assert quantized.weight_bytes() == expected + rest
    assert quantized.weight_bytes() < dense.weight_bytes() / 2.5  # (Q5_1: 1.25 bytes a value against 4)


def test_mixed_formats_in_one_layer_stay_in_bands(
    tiny_checkpoints: TinyCheckpoints, files: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Q4_K_M-like file: a qkv of Q4_K q/k (the q4 layout) and a Q5_K v (repacked as q8 with mins)
    stays quantized as two bands of those layouts; the Q4_K, Q5_K and Q6_K single-format ones stay in
    their (repacked) blocks; a gate/up whose up is in a type not kept (Q3_K) loads dense."""
    mix = {
        "blk.1.attn_v.weight": "Q5_K",
        "blk.0.ffn_down.weight": "Q6_K",
        "blk.1.ffn_down.weight": "Q5_K",
        "blk.1.ffn_up.weight": "Q3_K",
    }
    path = _gguf(tiny_checkpoints, files, "llama_hd64", "Q4_K", types=mix)
    dense = _weights(_runner(path))
    with caplog.at_level(logging.INFO, logger="runtime.engine.quant.loading"):
        quantized = _weights(_runner(path, quantization="gguf"))
    dense_notes = [r.getMessage() for r in caplog.records if "load dense" in r.getMessage()]
    assert dense_notes == ["MergedColumnParallelLinear: shards in Q4_K beside dense ones load dense"]
    qkv = quantized["model.layers.1.self_attn.qkv_proj"]
    assert isinstance(qkv, QuantizedBands) and qkv.source == "Q4_K+Q5_K"
    assert [(first, w.source, w.kind, w.shape[0]) for first, w in qkv.bands()] == [
        (0, "Q4_K", "q4", 384),
        (384, "Q5_K", "q8", 128),
    ]
    assert isinstance(quantized["model.layers.1.mlp.gate_up_proj"], torch.Tensor)
    down = quantized["model.layers.0.mlp.down_proj"]
    assert isinstance(down, QuantizedWeight) and (down.source, down.kind, down.group) == ("Q6_K", "q8", 16)
    q4k = quantized["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(q4k, QuantizedWeight) and q4k.source == "Q4_K"
    q5k = quantized["model.layers.1.mlp.down_proj"]
    assert isinstance(q5k, QuantizedWeight) and (q5k.source, q5k.kind, q5k.mins is not None) == ("Q5_K", "q8", True)
    for name, weight in quantized.items():
        assert torch.equal(weight if isinstance(weight, torch.Tensor) else weight.dequantize(), dense[name]), name


@pytest.mark.parametrize("source", ["gguf", "int8", "int8-of-gguf"])
def test_every_linear_within_the_bound_of_its_dequantized_reference(
    tiny_checkpoints: TinyCheckpoints, files: Path, source: str
) -> None:
    if source == "int8":
        runner = _runner(tiny_checkpoints.path("qwen2"), quantization="int8")  # safetensors
    else:  # a GGUF file's blocks kept, or its dequantized values made int8
        method = "gguf" if source == "gguf" else "int8"
        runner = _runner(_gguf(tiny_checkpoints, files, "qwen2", "Q4_1"), quantization=method)
    gen = torch.Generator().manual_seed(11)
    checked = 0
    for name, module in runner.model.named_modules():
        if not isinstance(module, LinearWeightLayer) or not isinstance(module.weight, QuantizedWeight):
            continue
        weight = module.weight
        x = torch.randn(3, weight.shape[1], generator=gen)
        got = runner.ops.linear(x, weight, None)
        err = (got.double() - reference_linear(x.double(), weight, None).double()).abs()
        assert bool((err <= quantized_linear_bound(x, weight)).all()), name
        checked += 1
    expected = 4 * runner.model_config.num_hidden_layers + (1 if source == "gguf" else 0)  # + the LM head
    assert checked == expected
    if source != "gguf":  # SGLang's w8a8_int8: the embedding and LM head stay dense
        assert isinstance(runner.model.lm_head.weight, torch.Tensor)
        assert all(
            w.source == "int8" and w.group == w.shape[1]
            for w in _weights(runner).values()
            if isinstance(w, QuantizedWeight)
        )


@pytest.mark.skipif(
    not attention_kernels_f32.applies(),
    reason="needs a CPU with AVX2 and FMA (or AVX-512) "
    "and the kernels' vector build: the fp32 call's attention is its kernels",
)
@pytest.mark.parametrize("source", ["gguf", "int8"])
def test_one_call_decode_equals_the_layers_bit_for_bit(
    tiny_checkpoints: TinyCheckpoints, files: Path, source: str, calls: list[bool]
) -> None:
    if source == "gguf":
        runner = _runner(_gguf(tiny_checkpoints, files, "llama", "Q4_1"), quantization="gguf")
    else:
        runner = _runner(tiny_checkpoints.path("qwen2"), quantization="int8")
    layered = _decode_logits(runner, [False] * 4, requests=3)
    calls.clear()
    one_call = _decode_logits(runner, [True] * 4, requests=3)
    assert calls == [False] * 3 + [True] * 3, calls  # two prefills, the mirror's rebuild, then the call
    stack = runner.layer_stack
    assert isinstance(stack, decode_layers.CpuLayerStack)
    described = stack.description(3)
    assert described is not None and described.kernels == "qf32"
    for step, (a, b) in enumerate(zip(layered, one_call)):
        assert torch.equal(a, b), f"decode step {step} differs"


def test_gguf_needs_a_gguf_file(tiny_checkpoints: TinyCheckpoints) -> None:
    with pytest.raises(ValueError, match="not a GGUF file"):
        _runner(tiny_checkpoints.path("llama"), quantization="gguf")


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_keeps_a_gguf_files_blocks_where_the_cpu_has_no_native_bf16(
    tiny_checkpoints: TinyCheckpoints, files: Path, monkeypatch: pytest.MonkeyPatch, native_bf16: bool
) -> None:
    """launch.py's --quantization auto: a GGUF file on a CPU without native bf16 matmul (AVX2) keeps
    its blocks, with fp32 activations; with native bf16 both forms, bf16 activations, or, with too
    little RAM for both forms, the blocks alone with bf16 activations; with a dtype asked for, or a
    safetensors folder, or none, or (with native bf16) AMX tiles, the weights are dense."""
    from runtime.engine import model_runner

    monkeypatch.setattr(model_runner, "cpu_supports_bf16", lambda: native_bf16)
    monkeypatch.setattr(model_runner, "cpu_has_amx", lambda: False)
    path = _gguf(tiny_checkpoints, files, "llama", "Q4_1")

    def auto(checkpoint: Path, **kwargs: Any) -> ModelRunner:
        return ModelRunner(checkpoint, device="cpu", max_total_tokens=2048, load_progress=False, **kwargs)

    chosen = auto(path, dtype="auto", quantization="auto")
    if native_bf16:
        assert chosen.quantization == "gguf_dual" and chosen.dtype == torch.bfloat16
        embedding = chosen.model.model.embed_tokens  # (untied: its blocks alone, only looked up)
        assert isinstance(embedding.weight, QuantizedWeight)
        assert all(weight_blocks(m) is not None for m in _modules(chosen).values() if m is not embedding)
        # on AMX tiles (not measured there): dense; where both forms would take more than their share
        # of RAM: the blocks alone, bf16 activations
        monkeypatch.setattr(model_runner, "cpu_has_amx", lambda: True)
        assert auto(path, dtype="auto", quantization="auto").quantization is None
        monkeypatch.setattr(model_runner, "cpu_has_amx", lambda: False)
        monkeypatch.setattr(model_runner, "DUAL_RAM_SHARE", 1e-9)
        alone = auto(path, dtype="auto", quantization="auto")
        assert alone.quantization == "gguf" and alone.dtype == torch.bfloat16 and alone.bf16_prefill
        assert all(isinstance(w, QuantizedWeight) for w in _weights(alone).values())
    else:
        assert chosen.quantization == "gguf" and chosen.dtype == torch.float32
        assert all(isinstance(w, QuantizedWeight) for w in _weights(chosen).values())
    assert auto(path, dtype="float32", quantization="auto").quantization is None  # the oracle's exactness
    assert auto(path, dtype="auto", quantization="none").quantization is None
    assert auto(tiny_checkpoints.path("llama"), dtype="float32", quantization="auto").quantization is None


def test_tp2_ranks_keep_their_shards_quantized(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    """Column-parallel ranks keep their rows (Q/K un-interleaved per head), row-parallel ranks their
    whole blocks of columns: each rank's values are its dense shard's."""
    path = _gguf(tiny_checkpoints, files, "llama", "Q8_0")
    for rank in range(2):
        dense = _weights(_runner(path, tp_rank=rank, tp_size=2))
        kept = _weights(_runner(path, tp_rank=rank, tp_size=2, quantization="gguf"))
        for name, weight in kept.items():
            assert isinstance(weight, QuantizedWeight), name
            assert torch.equal(weight.dequantize(), dense[name]), name
