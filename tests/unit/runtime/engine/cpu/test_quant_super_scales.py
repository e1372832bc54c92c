"""The K-quants' super-block scales (``QuantizedWeight.supers``: 8-bit codes per group, fp32 ``d`` and
``dmin`` per 256 values, which the kernels decode a row at a time: csrc/quant_layout.h's row_scales)
against the same weight with its scales expanded to fp32 (the plain form): every kernel, at every build
level this CPU runs, gives the same bits from both, since the decoded scales are the same fp32 products.
Covered: the weight-only rows (one and two weight rows at a time), int8 activations, the dequantized
tiles, the whole weight dequantized in fp32 and bf16, and bf16 rows (where the build has the kernel);
and the layout's bytes and refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.quant_kernels import band_product, quant_linear
from runtime.engine.quant.gguf_blocks import from_gguf
from runtime.engine.quant.weight import QuantizedWeight, cat_rows, zero_rows
from tests.unit.runtime.engine.cpu.test_quant_kernels import _random_blocks

K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def _pair(type_name: str, out_features: int, in_features: int, int8: bool = False) -> tuple[QuantizedWeight, ...]:
    """A random K-quant weight as repacked (super-block form) and a copy with its scales expanded."""
    raw = _random_blocks(type_name, out_features, in_features, np.random.default_rng(out_features + in_features))
    packed = from_gguf(raw, type_name, in_features)
    plain = from_gguf(raw, type_name, in_features)
    plain.expand_scales_()
    for weight in (packed, plain):
        weight.int8_activations = int8
    assert packed.supers is not None and plain.supers is None and plain.scales.dtype == torch.float32
    return packed, plain


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("type_name", K_QUANTS)
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 23, 24, 40])
@pytest.mark.parametrize("int8", [False, True], ids=["weight-only", "int8-activations"])
def test_super_block_scales_multiply_as_their_fp32_products(type_name: str, rows: int, int8: bool) -> None:
    packed, plain = _pair(type_name, 19, 512, int8)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=gen)
    bias = torch.randn(19, generator=gen)
    got, want = quant_linear(x, packed, bias), quant_linear(x, plain, bias)
    assert got is not None and want is not None
    assert torch.equal(got, want)
    assert torch.equal(packed.dequantize(), plain.dequantize())


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("type_name", K_QUANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_whole_weight_dequantizes_as_the_plain_form(type_name: str, dtype: torch.dtype) -> None:
    lib = kernel_library.load()
    assert lib is not None
    packed, plain = _pair(type_name, 21, 768)
    dequantize = lib.quant_dequantize_bf16 if dtype == torch.bfloat16 else lib.quant_dequantize_f32
    outs = []
    for weight in (packed, plain):
        out = torch.empty(21, 768, dtype=dtype)
        scales, mins, supers = weight.scales, weight.mins, weight.supers
        args = (weight.qs.data_ptr(), scales.data_ptr(), mins.data_ptr() if mins is not None else None)
        code = 1 if weight.kind == "q4" else 0
        assert (
            dequantize(
                code, *args, supers.data_ptr() if supers is not None else None, weight.group, 21, 768, out.data_ptr()
            )
            == 0
        )
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[1], plain.dequantize(dtype=torch.float32).to(dtype))


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("type_name", K_QUANTS)
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_bf16_rows_take_the_same_products(kernel_level: str, type_name: str, rows: int) -> None:
    lib = kernel_library.load()
    assert lib is not None
    packed, plain = _pair(type_name, 13, 256)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    outs = [torch.full((rows, 13), float("nan")) for _ in range(2)]
    codes = [band_product(lib.quant_linear_bf16, x, weight, None, 0, out) for weight, out in zip((packed, plain), outs)]
    assert codes[0] == codes[1] == (0 if kernel_level == "avx512bf16" else -1)
    if codes[0] == 0:
        assert torch.equal(outs[0], outs[1])


def test_the_form_is_a_quarter_fewer_bytes_and_stacks_with_its_own_kind() -> None:
    packed, plain = _pair("Q4_K", 4, 512)
    assert packed.nbytes() == 4 * 512 * (0.5 + 2 / 32 + 8 / 256) and plain.nbytes() == 4 * 512 * 0.75
    stacked = cat_rows([packed, packed, zero_rows(packed, 3)])
    assert stacked.supers is not None and stacked.supers.shape == (11, 2, 2)
    assert torch.equal(stacked.dequantize()[4:8], packed.dequantize()) and not stacked.dequantize()[8:].any()
    with pytest.raises(ValueError, match="different layouts"):
        cat_rows([packed, plain])
    with pytest.raises(ValueError, match="super-block scales"):
        QuantizedWeight("q4", "bad", (4, 512), packed.qs, packed.scales.float(), packed.mins, supers=packed.supers)


def test_kernels_refuse_super_blocks_off_256_columns() -> None:
    """A depth that is not whole super-blocks is not the form's: the kernel declines, nothing written."""
    lib = kernel_library.load()
    assert lib is not None
    packed, _ = _pair("Q4_K", 3, 512)
    x, out = torch.randn(1, 288), torch.full((1, 3), float("nan"))
    args = (packed.qs.data_ptr(), packed.scales.data_ptr(), packed.mins.data_ptr() if packed.mins is not None else None)
    rc = lib.quant_linear_f32(
        x.data_ptr(),
        1,
        288,
        1,
        *args,
        packed.supers.data_ptr() if packed.supers is not None else None,
        32,
        3,
        288,
        None,
        out.data_ptr(),
        3,
    )
    assert rc == -1 and bool(out.isnan().all())
