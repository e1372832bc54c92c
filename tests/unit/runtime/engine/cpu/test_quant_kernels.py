"""The quantized linear kernels (csrc/quant_linear.c) against the dequantize-then-matmul reference,
at every build level this CPU runs, on odd shapes: 1..300 activation rows (with int8 activations the
integer products' row groups of 8 and their remainders below 24 rows; the dequantized tiles, which
weight-only products take at every row count and int8 ones from 24; the whole weight dequantized for
the BLAS from 256), depths of 1, 3, 4, 8 and 17 blocks of 32, output rows not a multiple of the kernel's
chunk of 8; and GGUF's blocks repacked into our layouts against the gguf package. Weight-only products
equal the reference to fp32 rounding; int8 ones stay within a derived error bound
(tests/support/quant_bounds.py); the reference is computed in float64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.ops import CpuOps
from runtime.engine.cpu.quant_kernels import BF16_DENSE_MIN_ROWS, DENSE_MIN_ROWS, quant_linear
from runtime.engine.quant.gguf_blocks import from_gguf
from runtime.engine.quant.weight import QuantizedWeight, quantize_int8, reference_linear
from tests.support.quant_bounds import EPS32, quantized_linear_bound


def _random_weight(
    layout: str, out_features: int, in_features: int, gen: torch.Generator, int8_activations: bool = False
) -> QuantizedWeight:
    """A random weight of ``layout``: q8 per 32 / per 16 / per row / per 32 with a min (Q5_1, Q5_K), or q4
    (scale and min per 32)."""
    if layout == "q4":
        qs = torch.randint(0, 256, (out_features, in_features // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
        scales = torch.rand(out_features, in_features // 32, generator=gen) * 0.02
        mins = (torch.rand(out_features, in_features // 32, generator=gen) - 0.5) * 0.2
        return QuantizedWeight(
            "q4", "test", (out_features, in_features), qs, scales, mins, int8_activations=int8_activations
        )
    group = {"q8": 32, "q8_16": 16, "q8_row": in_features, "q8_min": 32}[layout]
    qs = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int32).to(torch.int8)
    scales = torch.rand(out_features, in_features // group, generator=gen) * 0.01
    mins = (torch.rand(out_features, in_features // 32, generator=gen) - 0.5) * 0.2 if layout == "q8_min" else None
    return QuantizedWeight(
        "q8", "test", (out_features, in_features), qs, scales, mins, group=group, int8_activations=int8_activations
    )


SHAPES = [(1, 37, 32), (1, 21, 128), (3, 9, 96), (5, 61, 544), (8, 13, 544), (13, 9, 256), (24, 5, 544)]
SHAPES += [(130, 19, 96), (300, 11, 64)]


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("layout", ["q8", "q8_16", "q8_row", "q8_min", "q4"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
def test_weight_only_products_are_the_dequantized_weights(
    layout: str, rows: int, out_features: int, in_features: int
) -> None:
    """The default numerics, at every row count: the activations are not rounded, so the result is the
    dequantized weight's product to fp32 rounding (the dense model's numbers, far inside the int8 bound)."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = _random_weight(layout, out_features, in_features, gen)
    x = torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    bias = torch.randn(out_features, generator=gen)
    got = quant_linear(x, weight, bias)
    assert got is not None and got.shape == (rows, out_features) and got.dtype == torch.float32
    want = reference_linear(x.double(), _double(weight), bias.double())
    # fp32 rounding of each product and sum: a few eps of the terms' magnitude
    magnitude = x.double().abs() @ weight.dequantize().double().abs().T + bias.double().abs()
    err = (got.double() - want).abs()
    assert bool((err <= (in_features // 32 + 16) * EPS32 * magnitude).all())
    if rows < 24:  # the int8 numerics of the same product do differ by more: the two paths are distinct
        int8 = _random_weight(
            layout, out_features, in_features, torch.Generator().manual_seed(rows * 1000 + in_features), True
        )
        rounded = quant_linear(x, int8, bias)
        assert rounded is not None and float((rounded.double() - want).abs().max()) > float(err.max())


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("layout", ["q8", "q8_16", "q8_row", "q8_min", "q4"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), SHAPES)
def test_int8_activations_within_the_activation_quantization_bound(
    layout: str, rows: int, out_features: int, in_features: int
) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = _random_weight(layout, out_features, in_features, gen, int8_activations=True)
    x = torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, :32] = 0.0  # an all-zero block: scale 0
    bias = torch.randn(out_features, generator=gen)
    got = quant_linear(x, weight, bias)
    assert got is not None and got.shape == (rows, out_features) and got.dtype == torch.float32
    want = reference_linear(x.double(), _double(weight), bias.double())
    err = (got.double() - want).abs()
    bound = quantized_linear_bound(x, weight) + EPS32 * bias.double().abs()
    assert bool((err <= bound).all()), f"worst error / bound {float((err / bound).max()):.3f}"
    # the bound is not vacuous: a fifth of the outputs' scale at most (a lost block, or a scale of the wrong
    # block, moves an output by about sqrt(1 / blocks) of its scale: a quarter at 17 blocks)
    assert float(bound.max()) < 0.2 * float(want.abs().max())


def _double(weight: QuantizedWeight) -> QuantizedWeight:
    """A stand-in whose ``dequantize`` is in float64 (for the float64 reference)."""

    class Double(QuantizedWeight):
        def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return super().dequantize(rows, torch.float64)

    return Double(weight.kind, weight.source, weight.shape, weight.qs, weight.scales, weight.mins, weight.group)


@pytest.mark.usefixtures("kernel_level")
def test_bf16_activations_and_fp32_logits() -> None:
    gen = torch.Generator().manual_seed(5)
    weight = _random_weight("q4", 40, 64, gen)
    x = torch.randn(2, 3, 64, generator=gen)
    as_bf16 = quant_linear(x.bfloat16(), weight, None)
    logits = quant_linear(x.bfloat16(), weight, None, float_out=True)
    assert as_bf16 is not None and as_bf16.dtype == torch.bfloat16 and as_bf16.shape == (2, 3, 40)
    assert logits is not None and logits.dtype == torch.float32
    assert torch.equal(as_bf16, logits.bfloat16())


@pytest.mark.parametrize("layout", ["q8", "q4"])
def test_a_long_prefill_of_a_bf16_prefill_weight_is_the_bf16_product(layout: str) -> None:
    """A weight marked ``bf16_prefill``: from ``BF16_DENSE_MIN_ROWS`` rows its product is the dequantized
    weight and the rows rounded to bf16, multiplied (the dense bf16 model's product), then the fp32
    bias; unmarked, the fp32 product (the dequantized weight's from ``DENSE_MIN_ROWS``, the tiles'
    below); below ``BF16_DENSE_MIN_ROWS`` rows the mark changes nothing. (The kernel's q4
    dequantization may differ from torch's by fp32 rounding, which bf16 rounding hides but for a value
    on a rounding boundary: none is at this seed.)"""
    gen = torch.Generator().manual_seed(11)
    weight = _random_weight(layout, 72, 96, gen)
    bias = torch.randn(72, generator=gen)
    x = torch.randn(DENSE_MIN_ROWS, 96, generator=gen)
    counts = (DENSE_MIN_ROWS, BF16_DENSE_MIN_ROWS, BF16_DENSE_MIN_ROWS - 1)
    fp32 = [quant_linear(x[:rows], weight, bias) for rows in counts]
    weight.bf16_prefill = True
    marked = [quant_linear(x[:rows], weight, bias) for rows in counts]
    for rows, got, unmarked in zip(counts[:2], marked, fp32):
        assert got is not None and unmarked is not None and got.dtype == torch.float32
        want = torch.nn.functional.linear(x[:rows].bfloat16(), weight.dequantize().bfloat16()).float() + bias
        assert torch.equal(got, want)
        assert not torch.equal(got, unmarked)  # (the two numerics are distinct: the fp32 one is tested above)
    assert marked[2] is not None and fp32[2] is not None and torch.equal(marked[2], fp32[2])


def test_kernels_off_fall_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """TINYSERVE_CPU_KERNELS=0: the CPU ops multiply by the dequantized weight (the torch reference)."""
    monkeypatch.setenv("TINYSERVE_CPU_KERNELS", "0")
    kernel_library.reset()
    try:
        weight, x = _random_weight("q4", 4, 64, torch.Generator()), torch.randn(3, 64)
        assert quant_linear(x, weight, None) is None
        assert torch.equal(CpuOps().linear(x, weight, None), reference_linear(x, weight, None))
    finally:
        monkeypatch.undo()
        kernel_library.reset()


def _random_blocks(type_name: str, rows: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid GGUF blocks: random bytes, with every fp16 scale field a finite value."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, in_features // block, size), dtype=np.uint8)
    scale_fields = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2]}
    scale_fields.update({"Q5_K": [0, 2], "Q6_K": [208]})
    for at in scale_fields[type_name]:
        raw[..., at : at + 2] = (rng.random(raw.shape[:2]) * 0.05 + 1e-3).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_blocks_repack_losslessly(type_name: str) -> None:
    from gguf import GGMLQuantizationType, dequantize

    rng = np.random.default_rng(7)
    raw = _random_blocks(type_name, 5, 512, rng)
    ours = from_gguf(raw, type_name, 512)
    want = torch.from_numpy(dequantize(raw, GGMLQuantizationType[type_name]).astype(np.float32))
    assert torch.equal(ours.dequantize(), want)
    assert torch.equal(ours.dequantize(torch.tensor([3, 1])), want[[3, 1]])  # the rows an embedding looks up
    per_value = {
        "Q8_0": 1 + 4 / 32,
        "Q4_0": 0.5 + 8 / 32,
        "Q4_1": 0.5 + 8 / 32,
        "Q5_0": 1 + 4 / 32,
        "Q5_1": 1 + 8 / 32,
        # the K-quants' super-block form: 8-bit codes per group, fp32 d and dmin per 256
        "Q4_K": 0.5 + 2 / 32 + 8 / 256,
        "Q5_K": 1 + 2 / 32 + 8 / 256,
        "Q6_K": 1 + 1 / 16 + 8 / 256,
    }[type_name]
    assert ours.nbytes() == int(5 * 512 * per_value)


def test_int8_per_channel_rounds_each_value_to_its_step() -> None:
    weight = torch.randn(6, 64) * torch.arange(1, 7).unsqueeze(1)
    weight[2] = 0.0
    quantized = quantize_int8(weight)
    assert quantized is not None and quantized.kind == "q8" and quantized.group == 64
    step = weight.abs().amax(1, keepdim=True) / 127
    assert bool(((quantized.dequantize() - weight).abs() <= step / 2 * (1 + 1e-5)).all())
    assert quantize_int8(torch.randn(4, 40)) is None  # rows not whole blocks of 32: stays dense


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("layout", ["q8", "q8_16", "q8_row", "q8_min", "q4"])
def test_many_rows_take_the_dequantized_weight_unrounded(layout: str) -> None:
    """With int8 activations too, from 24 rows on the activations are not quantized: the result is the
    dequantized weight's product to fp32 rounding (far inside the activation-quantization bound)."""
    gen = torch.Generator().manual_seed(11)
    weight = _random_weight(layout, 40, 544, gen, int8_activations=True)
    for rows in (24, 64, 256):
        x = torch.randn(rows, 544, generator=gen)
        got = quant_linear(x, weight, None)
        want = reference_linear(x.double(), _double(weight), None)
        assert got is not None
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
