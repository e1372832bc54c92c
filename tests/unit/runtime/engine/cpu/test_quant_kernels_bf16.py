"""The weight-only kernel for a few rows of bf16 activations (csrc/quant_linear_bf16.c: AVX512-BF16 dot
products on the rows as they are) against the dequantize-then-matmul reference in float64, on every
layout, at depths that exercise q4's four-block groups and their remainders (1, 3, 4, 8, 17 blocks)
and at 1..32 rows (its register row groups of 8 and their remainders); and the rule that picks it:
the avx512bf16 build takes these products, every other build and 33 rows or more decline them (the
widened fp32 kernel then serves, which test_quant_kernels.py covers). A build needs a CPU with
AVX512-BF16 to run: the test of its products names that feature where the host lacks it.
"""

from __future__ import annotations

import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.quant_kernels import band_product, quant_linear
from runtime.engine.quant.weight import QuantizedWeight, reference_linear
from tests.support.quant_bounds import EPS32
from tests.unit.runtime.engine.cpu.test_quant_kernels import _double, _random_weight

LAYOUTS = ["q8", "q8_16", "q8_row", "q8_min", "q4"]
SHAPES = [(1, 37, 32), (3, 9, 96), (1, 21, 128), (5, 61, 544), (8, 13, 256), (9, 7, 544), (23, 5, 128)]
SHAPES += [(31, 6, 160), (32, 3, 128)]


def _call(weight: QuantizedWeight, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> int:
    """quant_linear_bf16 on bf16 rows ``x`` (+ fp32 ``bias``) into fp32 ``out``, its return code."""
    lib = kernel_library.load()
    assert lib is not None
    return band_product(lib.quant_linear_bf16, x, weight, bias, 0, out)


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("rows", [1, 32, 33])
def test_the_bf16_build_takes_few_rows_and_the_others_decline(kernel_level: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = _random_weight("q4", 16, 128, gen)
    x = torch.randn(rows, 128, generator=gen).bfloat16()
    out = torch.full((rows, 16), float("nan"))
    takes = kernel_level == "avx512bf16" and rows <= 32
    assert _call(weight, x, out) == (0 if takes else -1)
    assert bool(out.isnan().all()) != takes  # declined: nothing written
    int8 = _random_weight("q4", 16, 128, torch.Generator().manual_seed(rows), int8_activations=True)
    assert _call(int8, x, out) == -1  # int8 activations are quant_linear_f32's


def test_bf16_products_are_the_dequantized_weights() -> None:
    """Each layout at each shape: the bf16 rows times the dequantized weight, to fp32 rounding of the
    terms (for q4 the terms include 128 s sum(x), the offset its bf16 values carry)."""
    if "avx512bf16" not in kernel_library.host_levels():
        pytest.skip("needs a CPU with AVX512-BF16 (the kernel's build level)")
    with kernel_library.use_level("avx512bf16"):
        for layout in LAYOUTS:
            for rows, out_features, in_features in SHAPES:
                gen = torch.Generator().manual_seed(rows * 1000 + in_features)
                weight = _random_weight(layout, out_features, in_features, gen)
                x = (torch.randn(rows, in_features, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).bfloat16()
                bias = torch.randn(out_features, generator=gen)
                got = quant_linear(x, weight, bias, float_out=True)
                assert got is not None and got.shape == (rows, out_features)
                direct = torch.empty(rows, out_features)
                assert _call(weight, x, direct, bias) == 0
                assert torch.equal(got, direct)  # quant_linear took this kernel
                rows64 = x.double()
                want = reference_linear(rows64, _double(weight), bias.double())
                terms = rows64.abs() @ weight.dequantize().double().abs().T + bias.double().abs()
                if layout == "q4":
                    terms += 128 * rows64.abs() @ weight.scales.double().repeat_interleave(32, dim=1).T
                err = (got.double() - want).abs()
                assert bool((err <= (in_features // 32 + 16) * EPS32 * terms).all()), (layout, rows, in_features)


def test_a_strided_bf16_row_view_is_read_in_place() -> None:
    """Rows ldx apart (a view into a wider tensor): the same products as the contiguous rows."""
    if "avx512bf16" not in kernel_library.host_levels():
        pytest.skip("needs a CPU with AVX512-BF16 (the kernel's build level)")
    with kernel_library.use_level("avx512bf16"):
        gen = torch.Generator().manual_seed(3)
        weight = _random_weight("q4", 11, 256, gen)
        wide = torch.randn(4, 384, generator=gen).bfloat16()
        view = wide[:, 64:320]
        a, b = torch.empty(4, 11), torch.empty(4, 11)
        assert _call(weight, view, a) == 0 and _call(weight, view.contiguous(), b) == 0
        assert torch.equal(a, b)


def test_weight_rows_two_at_a_time_sum_as_one_at_a_time() -> None:
    """A q4 weight's rows are multiplied two at a time for more than two activation rows (one load of
    an activation vector serving both): each output equals that weight row's product alone, bit for bit
    (depths with and without a remainder past the groups of four blocks)."""
    if "avx512bf16" not in kernel_library.host_levels():
        pytest.skip("needs a CPU with AVX512-BF16 (the kernel's build level)")
    with kernel_library.use_level("avx512bf16"):
        for rows, in_features in ((3, 128), (8, 544), (13, 256)):
            gen = torch.Generator().manual_seed(rows)
            weight = _random_weight("q4", 6, in_features, gen)
            x = torch.randn(rows, in_features, generator=gen).bfloat16()
            together = torch.empty(rows, 6)
            assert _call(weight, x, together) == 0
            for row in range(6):
                alone = QuantizedWeight(
                    "q4",
                    "test",
                    (1, in_features),
                    weight.qs[row : row + 1],
                    weight.scales[row : row + 1],
                    weight.mins[row : row + 1] if weight.mins is not None else None,
                )
                out = torch.empty(rows, 1)
                assert _call(alone, x, out) == 0
                assert torch.equal(out[:, 0], together[:, row]), (rows, in_features, row)
