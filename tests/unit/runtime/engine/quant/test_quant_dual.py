"""``--quantization gguf_dual``: a GGUF file's blocks kept beside its dense values. The dense values
are the dense load's bit for bit and the blocks the ``gguf`` load's; a product of at most
``BLOCK_ROWS_MAX`` rows reads the blocks, a larger one the dense values; the one-call decode stack
takes the blocks' kernels (``qbf16``) for a few-row step and the dense ones above, each equal bit for
bit to the layers run one by one; the resident bytes count both forms; ``auto`` picks it where the
CPU has native bf16 matmul.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.engine.cpu import decode_layers, kernel_library
from runtime.engine.cpu.quant_kernels import BLOCK_ROWS_MAX, quant_linear
from runtime.engine.cpu.weight_plan import plan_weight
from runtime.engine.model_runner import ModelRunner
from runtime.engine.quant.loading import quantized_bytes
from runtime.engine.quant.weight import QuantizedWeight, weight_blocks
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import gguf_test_folder, write_checkpoint_gguf
from tests.unit.runtime.engine.cpu import test_cpu_decode_layers
from tests.unit.runtime.engine.cpu.test_cpu_decode_layers import BF16_KERNELS, _decode_logits
from tests.unit.runtime.engine.quant.test_quant_model import _modules, _weights

calls = test_cpu_decode_layers.calls  # (its fixture: which forwards the one-call path ran)

needs_bf16_kernels = pytest.mark.skipif(
    "avx512bf16" not in kernel_library.host_levels() or kernel_library.level() != "avx512bf16",
    reason="needs a CPU with AVX512-BF16 (avx512_bf16): the bf16 one-call stack's kernels are built for it",
)


@pytest.fixture(scope="module")
def gguf_path(tiny_checkpoints: TinyCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with gguf_test_folder(tmp_path_factory, "quant-dual") as folder:
        # the real model's mix: Q4_1 linears and a Q8_0 token embedding tied to the LM head
        yield write_checkpoint_gguf(
            tiny_checkpoints.path("llama"),
            folder / "llama-Q4_1.gguf",
            weight_type="Q4_1",
            tokenizer=False,
            tie=True,
            types={"token_embd.weight": "Q8_0"},
        )


def _runner(path: Path, dtype: str = "bfloat16", **kwargs: Any) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=2048, load_progress=False, **kwargs)


def test_dense_values_are_the_dense_loads_and_blocks_the_gguf_loads(gguf_path: Path) -> None:
    dual, dense = _runner(gguf_path, quantization="gguf_dual"), _runner(gguf_path)
    kept = _weights(_runner(gguf_path, dtype="float32", quantization="gguf"))
    dual_weights, dense_weights = _weights(dual), _weights(dense)
    assert dual_weights.keys() == dense_weights.keys() == kept.keys()
    dual_modules = _modules(dual)
    for name, weight in dual_weights.items():
        assert isinstance(weight, torch.Tensor) and torch.equal(weight, dense_weights[name]), name
        blocks, reference = weight_blocks(dual_modules[name]), kept[name]
        assert blocks is not None and isinstance(reference, QuantizedWeight), name
        assert blocks.source == reference.source and torch.equal(blocks.dequantize(), reference.dequantize()), name
    assert weight_blocks(dual.model.lm_head) is weight_blocks(dual.model.model.embed_tokens)  # tied: once
    # both forms are resident: the dense model's bytes plus the blocks'
    assert dual.weight_bytes() == dense.weight_bytes() + sum(quantized_bytes(dual.model).values())
    assert set(quantized_bytes(dual.model)) == {"Q4_1", "Q8_0"}


def test_few_rows_read_the_blocks_more_the_dense_values(gguf_path: Path) -> None:
    runner = _runner(gguf_path, quantization="gguf_dual")
    layer = runner.model.model.layers[0].mlp.gate_up_proj
    weight, values, blocks = layer.weight, layer.weight_values(), weight_blocks(layer)
    assert blocks is not None and [band.kernel for band in layer.plan.bands][0] == "blocks"
    gen = torch.Generator().manual_seed(5)
    for rows in (1, BLOCK_ROWS_MAX, BLOCK_ROWS_MAX + 1, 40):
        x = torch.randn(rows, weight.shape[1], generator=gen).bfloat16()
        got = runner.ops.linear(x, weight, None, layer.plan)
        if rows <= BLOCK_ROWS_MAX:
            want = quant_linear(x, blocks, None)
        else:
            want = runner.ops.linear(x, values, None, plan_weight(values))  # the same values without blocks
        assert want is not None and torch.equal(got, want), rows
    head = runner.model.lm_head
    x = torch.randn(2, head.weight.shape[1], generator=gen).bfloat16()
    head_blocks = weight_blocks(head)
    assert head_blocks is not None
    got = runner.ops.float_linear(x, head.weight, head.plan)
    assert torch.equal(got, quant_linear(x, head_blocks, None, float_out=True))


@needs_bf16_kernels
@pytest.mark.parametrize("method, requests", [("gguf_dual", 3), ("gguf_dual", BLOCK_ROWS_MAX + 2), ("gguf", 3)])
def test_one_call_decode_equals_the_layers_bit_for_bit(
    gguf_path: Path, calls: list[bool], method: str, requests: int
) -> None:
    """bf16 activations: a dual model's few-row steps and a kept-quantized bf16 model's steps run the
    qbf16 set, a dual model's larger steps the dense set; each as the layers one by one compute it."""
    runner = _runner(gguf_path, quantization=method)
    layered = _decode_logits(runner, [False] * 4, requests=requests)
    calls.clear()
    one_call = _decode_logits(runner, [True] * 4, requests=requests)
    assert calls[-3:] == [True] * 3 and not any(calls[:-3]), calls  # prefills, the mirror's rebuild, the call
    stack = runner.layer_stack
    assert isinstance(stack, decode_layers.CpuLayerStack)
    taken = stack.description(requests)
    assert taken is not None
    assert taken.kernels == ("qbf16" if requests <= BLOCK_ROWS_MAX else BF16_KERNELS)
    for step, (a, b) in enumerate(zip(layered, one_call)):
        assert torch.equal(a, b), f"decode step {step} differs"
    report = runner.weight_info()["kernels"]
    if method == "gguf_dual":
        assert report["decode_stack"] == f"qbf16 up to {BLOCK_ROWS_MAX} rows, {BF16_KERNELS} above"
        assert all("_upto_" in path for path in report["linears"]), report["linears"]


def test_weights_reload_in_place_blocks_and_dense_values(
    gguf_path: Path, tiny_llama_other_weights: Path, tmp_path: Path
) -> None:
    """/update_weights_from_disk on a dual server: another GGUF file of the model gives the dense
    values and the blocks a fresh load of it gives, and the same decode steps."""
    from runtime.engine.loading.weight_reload import reload_weights

    other = write_checkpoint_gguf(
        tiny_llama_other_weights, tmp_path / "other-Q4_1.gguf", weight_type="Q4_1", tokenizer=False, tie=True
    )
    runner = _runner(gguf_path, quantization="gguf_dual")
    other_folder = _runner(other, quantization="gguf_dual").model_path
    reload_weights(runner, other_folder)
    fresh = _runner(other, quantization="gguf_dual")
    got_weights, fresh_weights, fresh_modules = _weights(runner), _weights(fresh), _modules(fresh)
    for name, module in _modules(runner).items():
        assert torch.equal(got_weights[name], fresh_weights[name]), name
        got_blocks, want_blocks = weight_blocks(module), weight_blocks(fresh_modules[name])
        assert got_blocks is not None and want_blocks is not None
        assert torch.equal(got_blocks.dequantize(), want_blocks.dequantize()), name
    for a, b in zip(_decode_logits(runner, [True] * 3, requests=2), _decode_logits(fresh, [True] * 3, requests=2)):
        assert torch.equal(a, b)


def test_an_embedding_no_head_shares_keeps_its_blocks_alone(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """An untied token embedding is only looked up: dual keeps it in its blocks alone (rows dequantized
    on lookup, the dense load's values bit for bit), while its LM head keeps both forms."""
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("llama"), tmp_path / "untied-Q8_0.gguf", weight_type="Q8_0", tokenizer=False, tie=False
    )
    dual, dense = _runner(path, quantization="gguf_dual"), _runner(path)
    embedding = dual.model.model.embed_tokens
    assert isinstance(embedding.weight, QuantizedWeight) and weight_blocks(dual.model.lm_head) is not None
    ids = torch.arange(dual.vocab_size)
    assert torch.equal(embedding(ids), dense.model.model.embed_tokens(ids))
