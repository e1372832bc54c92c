"""Merged linears whose parts come in different GGUF block formats (a Q4_K_M file's Q4_K q/k beside a
Q6_K v, a Q4_K gate beside a Q6_K up) kept in their blocks as row bands (``QuantizedBands``).

- the CPU kernel multiplies band by band into each band's columns: every column is the product of
  its band's weight alone, bit for bit, in both numerics;
- a tiny Llama and a tiny Qwen2 (q/k/v biases) with rows of 256 (one K-quant super-block) load such
  files with no dense fallback, at the formats' bytes, and their greedy tokens are the dequantized
  dense model's (``--quantization none`` of the same file) under the weight-only numerics, at TP=1
  and TP=2 (each rank's rows of each part);
- the one-call decode stack takes such a layer (its qf32 and qbf16 sets' weight chain) and equals the
  layers run one by one bit for bit, with int8 activations too;
- a weight reload refills the bands in place, and refuses a file whose bands differ;
- ``gguf_dual`` keeps the bands beside the dense values, for few-row products.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.engine.cpu import attention_kernels_f32, decode_layers
from runtime.engine.cpu.quant_kernels import quant_linear
from runtime.engine.cpu.weight_plan import layer_plan
from runtime.engine.loading.weight_reload import WeightReloadError, reload_weights
from runtime.engine.model_runner import ModelRunner
from runtime.engine.quant.loading import quantized_bytes
from runtime.engine.quant.weight import QuantizedBands, QuantizedWeight, reference_linear, weight_blocks
from tests.support.checkpoints import TinyCheckpoints, random_prompt
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.support.harness import Harness
from tests.support.quant_bounds import quantized_linear_bound
from tests.support.tp_threads import ThreadTPGroup, run_on_ranks
from tests.unit.runtime.engine.cpu import test_cpu_decode_layers
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import _decode_logits
from tests.unit.runtime.engine.cpu.test_quant_kernels import _random_weight
from tests.unit.runtime.engine.quant.test_quant_dual import needs_bf16_kernels
from tests.unit.runtime.engine.quant.test_quant_model import _weights

calls = test_cpu_decode_layers.calls  # (its fixture: which forwards the one-call path ran)

# Q4_K_M's mix on the 2-layer checkpoints (Q4_K elsewhere): v in Q6_K on every layer, layer 0's up in Q6_K
MIX = {"blk.0.attn_v.weight": "Q6_K", "blk.1.attn_v.weight": "Q6_K", "blk.0.ffn_up.weight": "Q6_K"}
# as repacked: q4 with a scale and a min code per 32, int8 with a scale code per 16; d and dmin in fp32 per 256
BYTES_PER_VALUE = {"Q4_K": 0.5 + 2 / 32 + 8 / 256, "Q6_K": 1 + 1 / 16 + 8 / 256}
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def files(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "quant-bands") as folder:
        yield folder


def _gguf(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, seed: int = 0, types: dict[str, str] | None = None
) -> Path:
    """``name`` as a Q4_K file with ``MIX`` (and ``types``' overrides), K-quant blocks drawn with ``seed``."""
    return write_checkpoint_gguf(
        tiny_checkpoints.path(name),
        files / f"{name}-mix-{seed}-{'-'.join(sorted((types or {}).values()))}.gguf",
        weight_type="Q4_K",
        types={**MIX, **(types or {})},
        tokenizer=False,
        seed=seed,
    )


def _runner(path: Path, **kwargs: Any) -> ModelRunner:
    kwargs.setdefault("dtype", "float32")
    return ModelRunner(path, device="cpu", max_total_tokens=2048, load_progress=False, **kwargs)


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 30, 300])
def test_each_bands_columns_are_its_weights_product(rows: int, int8_activations: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    parts = [
        _random_weight(layout, out, 256, gen, int8_activations)
        for layout, out in (("q4", 40), ("q8_16", 24), ("q8_min", 9))
    ]
    bands = QuantizedBands(parts)
    x, bias = torch.randn(rows, 256, generator=gen), torch.randn(bands.shape[0], generator=gen)
    got = quant_linear(x, bands, bias)
    assert got is not None and got.shape == (rows, 73)
    for first, part in bands.bands():
        columns = slice(first, first + part.shape[0])
        alone = quant_linear(x, part, bias[columns])
        if rows < 256:  # (from 256 rows the BLAS multiplies the dequantized weight: its blocking is its own)
            assert alone is not None and torch.equal(got[:, columns], alone), (first, part.kind)
        want = reference_linear(x.double(), part, bias[columns].double())
        assert bool(((got[:, columns].double() - want).abs() <= quantized_linear_bound(x, part)).all())


@pytest.mark.parametrize("name", ["llama_hd64", "qwen2_hd64"])
def test_mixed_merged_linears_load_in_their_blocks(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _gguf(tiny_checkpoints, files, name)
    dense = _weights(_runner(path))
    with caplog.at_level(logging.INFO, logger="runtime.engine.quant.loading"):
        runner = _runner(path, quantization="gguf")
    assert not [r for r in caplog.records if "load dense" in r.getMessage()]
    kept = _weights(runner)
    for layer in range(2):
        qkv, gate_up = kept[f"model.layers.{layer}.self_attn.qkv_proj"], kept[f"model.layers.{layer}.mlp.gate_up_proj"]
        assert isinstance(qkv, QuantizedBands)
        assert [(first, w.source, w.shape[0]) for first, w in qkv.bands()] == [(0, "Q4_K", 384), (384, "Q6_K", 128)]
        assert isinstance(gate_up, QuantizedBands if layer == 0 else QuantizedWeight)
    by_format: dict[str, int] = {}
    for weight_name, weight in kept.items():
        assert not isinstance(weight, torch.Tensor), weight_name
        assert torch.equal(weight.dequantize(), dense[weight_name]), weight_name
        for _, part in weight.bands():
            by_format[part.source] = by_format.get(part.source, 0) + int(
                part.shape[0] * 256 * BYTES_PER_VALUE[part.source]
            )
    assert quantized_bytes(runner.model) == runner.weight_info()["quantized_bytes"] == by_format
    report = runner.kernels
    assert isinstance(report, dict)
    # each weight once (no band again on its own): o and down of both layers, layer 1's gate/up, the
    # LM head and the embedding in Q4_K; both qkv and layer 0's gate/up in bands
    assert report["linears"] == {"kept_Q4_K": 7, "kept_Q4_K+Q6_K": 3}


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=70 + n) for n in (5, 17)]


@pytest.mark.parametrize("name", ["llama_hd64", "qwen2_hd64"])
def test_greedy_tokens_are_the_dequantized_dense_models(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str
) -> None:
    path = _gguf(tiny_checkpoints, files, name)
    dense, kept = _runner(path), _runner(path, quantization="gguf")
    prompts = _prompts(dense.vocab_size)
    want = [r.output_ids for r in Harness(dense).generate(prompts, NEW_TOKENS)]
    assert [r.output_ids for r in Harness(kept).generate(prompts, NEW_TOKENS)] == want


@pytest.mark.parametrize("name", ["llama_hd64", "qwen2_hd64"])
def test_tp2_ranks_keep_their_rows_of_each_part_and_answer_as_dense(
    tiny_checkpoints: TinyCheckpoints, files: Path, thread_tp_group: ThreadTPGroup, name: str
) -> None:
    path = _gguf(tiny_checkpoints, files, name)
    dense = _runner(path)
    prompts = _prompts(dense.vocab_size)
    want = [r.output_ids for r in Harness(dense).generate(prompts, NEW_TOKENS)]
    ranks = [_runner(path, tp_rank=r, tp_size=2, quantization="gguf") for r in range(2)]
    whole = _weights(dense)["model.layers.0.self_attn.qkv_proj"]
    for rank, runner in enumerate(ranks):
        qkv = _weights(runner)["model.layers.0.self_attn.qkv_proj"]
        assert isinstance(qkv, QuantizedBands), rank
        assert [(first, w.source, w.shape[0]) for first, w in qkv.bands()] == [(0, "Q4_K", 192), (192, "Q6_K", 64)]
        # this rank's two q heads, its k head and its v head of the whole (4 q heads, 2 kv heads of 64)
        q, k, v = whole[rank * 128 :][:128], whole[256 + rank * 64 :][:64], whole[384 + rank * 64 :][:64]
        assert torch.equal(qkv.dequantize(), torch.cat([q, k, v])), rank
    results = run_on_ranks(
        thread_tp_group, lambda rank: [r.output_ids for r in Harness(ranks[rank]).generate(prompts, NEW_TOKENS)]
    )
    assert results[0] == results[1] == want


@pytest.mark.skipif(
    not attention_kernels_f32.applies(),
    reason="needs a CPU with AVX2 and FMA (or AVX-512) and the kernels' vector build: the fp32 call's attention",
)
@pytest.mark.parametrize("int8_activations", [False, True])
@pytest.mark.parametrize("name", ["llama_hd64", "qwen2_hd64"])
def test_one_call_decode_takes_the_bands_bit_for_bit(
    tiny_checkpoints: TinyCheckpoints, files: Path, name: str, int8_activations: bool, calls: list[bool]
) -> None:
    runner = _runner(_gguf(tiny_checkpoints, files, name), quantization="gguf", int8_activations=int8_activations)
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


@needs_bf16_kernels
@pytest.mark.parametrize("method", ["gguf", "gguf_dual"])
def test_bf16_one_call_decode_takes_the_bands_bit_for_bit(
    tiny_checkpoints: TinyCheckpoints, files: Path, method: str, calls: list[bool]
) -> None:
    """bf16 activations: the qbf16 set widens them and multiplies band by band as the layers do."""
    runner = _runner(_gguf(tiny_checkpoints, files, "llama_hd64"), dtype="bfloat16", quantization=method)
    layered = _decode_logits(runner, [False] * 4, requests=3)
    calls.clear()
    one_call = _decode_logits(runner, [True] * 4, requests=3)
    assert calls[-3:] == [True] * 3 and not any(calls[:-3]), calls
    stack = runner.layer_stack
    assert isinstance(stack, decode_layers.CpuLayerStack)
    described = stack.description(3)
    assert described is not None and described.kernels == "qbf16"
    for step, (a, b) in enumerate(zip(layered, one_call)):
        assert torch.equal(a, b), f"decode step {step} differs"


def test_reload_refills_the_bands_in_place_and_refuses_other_bands(
    tiny_checkpoints: TinyCheckpoints, files: Path
) -> None:
    runner = _runner(_gguf(tiny_checkpoints, files, "llama_hd64"), quantization="gguf")
    qkv = _weights(runner)["model.layers.0.self_attn.qkv_proj"]
    assert isinstance(qkv, QuantizedBands)
    storage = [part.qs.data_ptr() for _, part in qkv.bands()]
    other = _runner(_gguf(tiny_checkpoints, files, "llama_hd64", seed=1), quantization="gguf")
    assert not torch.equal(_weights(other)["model.layers.0.self_attn.qkv_proj"].dequantize(), qkv.dequantize())
    reload_weights(runner, other.model_path)
    after = _weights(runner)["model.layers.0.self_attn.qkv_proj"]
    assert after is qkv and [part.qs.data_ptr() for _, part in qkv.bands()] == storage
    fresh = _weights(other)
    for name, weight in _weights(runner).items():
        assert torch.equal(weight.dequantize(), fresh[name].dequantize()), name
    before = qkv.dequantize()
    q5k = _runner(_gguf(tiny_checkpoints, files, "llama_hd64", 1, {"blk.0.attn_v.weight": "Q5_K"}), quantization="gguf")
    with pytest.raises(WeightReloadError, match="reloads only in the same format"):
        reload_weights(runner, q5k.model_path)
    assert _weights(runner)["model.layers.0.self_attn.qkv_proj"] is qkv and torch.equal(qkv.dequantize(), before)


def test_dual_keeps_the_bands_beside_the_dense_values(tiny_checkpoints: TinyCheckpoints, files: Path) -> None:
    path = _gguf(tiny_checkpoints, files, "llama_hd64")
    dual = _runner(path, dtype="bfloat16", quantization="gguf_dual")
    layer = dual.model.model.layers[0].self_attn.qkv_proj
    blocks, plan = weight_blocks(layer), layer_plan(layer)
    assert isinstance(blocks, QuantizedBands) and plan is not None
    assert plan.bands[0].kernel == "blocks" and plan.bands[0].operand is blocks
    assert torch.equal(layer.weight_values(), blocks.dequantize(dtype=torch.bfloat16))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(dual.ops.linear(x, layer.weight, layer.bias, layer.plan), quant_linear(x, blocks, layer.bias))
