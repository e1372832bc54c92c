"""The Triton dequantizing matmul (runtime/engine/cuda/quant_matmul.py, through ``TritonOps.linear``)
against the dequantize-then-matmul reference, on CPU under Triton's interpreter in fp32: every
layout (q8 per 32 / per 16 / per row / per 32 with a min, q4), activation rows below, at and above the tile's 16,
depths that are and are not whole tiles of 64, output rows not a multiple of the tile's 64; a weight
in bands of two layouts.

The kernel forms the same fp32 weight values as the reference and sums the products in another
order, so each output is within ``K * eps * sum |x w|`` of it (fp32 reassociation).

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module sets
``TRITON_INTERPRET=1`` before anything imports it (see tests/support/triton_interp.py).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.engine.cuda.ops import TritonOps  # noqa: E402
from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402
from runtime.engine.quant.weight import QuantizedBands, QuantizedWeight, reference_linear  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402
from tests.unit.runtime.engine.cpu.test_quant_kernels import _random_weight  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()
OPS = TritonOps()
EPS32 = float(torch.finfo(torch.float32).eps)


@pytest.mark.parametrize("layout", ["q8", "q8_16", "q8_row", "q8_min", "q4"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 37, 96), (17, 70, 128)])
def test_dequantizing_matmul_equals_the_reference(layout: str, rows: int, out_features: int, in_features: int) -> None:
    gen = torch.Generator().manual_seed(rows + in_features)
    weight: QuantizedWeight = _random_weight(layout, out_features, in_features, gen)
    x = torch.randn(rows, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    got = OPS.linear(x, weight, bias)
    want = reference_linear(x.double(), weight, None).double() + bias.double()
    bound = in_features * EPS32 * (x.double().abs() @ weight.dequantize().double().abs().T + bias.double().abs())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    assert bool(((got.double() - want).abs() <= bound).all())
    logits = OPS.float_linear(x, weight)
    assert logits.dtype == torch.float32 and torch.allclose(logits, got - bias, atol=float(bound.max()))


@pytest.mark.parametrize("rows", [1, 17])
def test_bands_multiply_into_their_columns(rows: int) -> None:
    """A merged layer whose parts' formats differ (``QuantizedBands``: a Q4_K q/k beside a Q6_K v):
    one launch per band, into its columns of the one output, each equal to the band's own product."""
    gen = torch.Generator().manual_seed(rows)
    bands = QuantizedBands([_random_weight("q4", 70, 96, gen), _random_weight("q8_16", 37, 96, gen)])
    x = torch.randn(rows, 96, generator=gen)
    bias = torch.randn(bands.shape[0], generator=gen)
    got = OPS.linear(x, bands, bias)
    assert got.shape == (rows, 107)
    for first, part in bands.bands():
        columns = slice(first, first + part.shape[0])
        assert torch.equal(got[:, columns], OPS.linear(x, part, bias[columns]))
    assert torch.equal(OPS.float_linear(x, bands), torch.cat([OPS.float_linear(x, p) for _, p in bands.bands()], 1))


if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
