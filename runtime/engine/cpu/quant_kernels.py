"""ctypes wrapper of ``csrc/quant_linear.c`` (and its bf16 rows' and whole-weight dequantization's files,
``quant_linear_bf16.c``, ``quant_dequantize.c``): linear layers on weights kept quantized
(``runtime.engine.quant.weight.QuantizedWeight``): up to a long prefill on tiles of the weight dequantized in
cache with the activations as they are (weight-only: the dense model's numbers), or for a few rows of a
weight marked ``int8_activations`` with the activations quantized per block of 32 on the fly; a long
prefill's on the whole weight dequantized for the BLAS (``DENSE_MIN_ROWS``), in fp32 or, for a weight
marked ``bf16_prefill`` (a CPU with native bf16 matmul), in bf16 from ``BF16_DENSE_MIN_ROWS`` rows on.

``quant_linear`` returns None (the caller takes the torch reference, ``reference_linear``) where
the kernel does not apply: kernels off (``TINYSERVE_CPU_KERNELS=0``) or not built, a weight not on
the CPU, activations neither fp32 nor bf16. A few rows of bf16 activations go to
``quant_linear_bf16`` (``csrc/quant_linear_bf16.c``: AVX512-BF16 dot products on the rows as they are,
where the build has them); elsewhere bf16 activations are widened to fp32 for ``quant_linear_f32`` and
the result rounded back. Each band takes the same kernel ``csrc/decode_layers.c``'s qbf16 set gives it,
so the one-call decode stack and the layers agree bit for bit.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.kernel_library import declare
from runtime.engine.quant.weight import KeptWeight, QuantizedWeight

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
declare("quant_linear_f32", [_ptr, _i64, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64], _int)
declare("quant_linear_bf16", [_ptr, _i64, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _i64], _int)
declare("quant_dequantize_f32", [_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr], _int)
declare("quant_dequantize_bf16", [_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr], _int)

# From this many rows on (a long prefill) the weight is dequantized whole and the product is the
# BLAS's: its blocking for large products beats the kernel's tiles (docs/benchmarks.md, "Quantized
# weights"), and one pass over the weight is small next to rows x its size of products.
DENSE_MIN_ROWS = 256
# A weight marked ``bf16_prefill`` (a CPU with native bf16 matmul) takes that product from this many
# rows on, in bf16 (oneDNN's AVX512-BF16 or AMX kernel on the weight dequantized straight to bf16):
# past the bf16 rows' kernel (csrc/quant_linear_bf16.c, QB_MAX_ROWS), where fp32 rows would take the
# fp32 tiles, which it beats at every row count (a short prompt's prefill, a large verify step).
BF16_DENSE_MIN_ROWS = 33

KIND_CODES = {"q8": 0, "q4": 1}  # csrc: quant_linear_f32's kind (and decode_layers.c's QuantWeight.kind)
INT8_ACTIVATIONS = 2  # csrc: QUANT_INT8_ACTIVATIONS, the kind's numerics bit

# A weight kept in both forms (--quantization gguf_dual) reads its blocks for products of at most
# this many rows (a decode step of a few requests, or a verify step): there the weight's bytes bound
# the product and the blocks are a fraction of them; more rows take the dense values, whose
# products cost no dequantization (docs/benchmarks.md, "Blocks and dense values together"). The
# weight's plan (runtime.engine.cpu.weight_plan) gives its blocks these rows.
BLOCK_ROWS_MAX = 4


def kind_code(weight: QuantizedWeight) -> int:
    """The kernel's ``kind`` for ``weight``: its layout, and whether few rows quantize the activations."""
    return KIND_CODES[weight.kind] | (INT8_ACTIVATIONS if weight.int8_activations else 0)


def quant_linear(
    x: torch.Tensor, weight: KeptWeight, bias: torch.Tensor | None, float_out: bool = False
) -> torch.Tensor | None:
    """``x [..., in] @ weight.T (+ bias)`` in ``x``'s dtype (fp32 with ``float_out``), or None where
    the kernel does not apply. A weight in bands (``QuantizedBands``) runs one call per band, each
    writing its columns of the one output (the kernel's output row stride), with its bias slice:
    each column's sums are those of the band's weight alone."""
    lib = kernel_library.load()
    if (
        lib is None
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
        or x.dtype not in (torch.float32, torch.bfloat16)
    ):
        return None
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)  # (in x's dtype: each kernel below widens them only if it needs to)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.float().contiguous()
    out = torch.empty(rows.shape[0], out_features, dtype=torch.float32)
    if rows.shape[0] == 0:
        return out.reshape(*x.shape[:-1], out_features).to(torch.float32 if float_out else x.dtype)
    if rows.shape[0] >= (BF16_DENSE_MIN_ROWS if weight.bf16_prefill else DENSE_MIN_ROWS):
        dense = _dequantized(lib, weight, torch.bfloat16 if weight.bf16_prefill else torch.float32)
        if dense is not None:
            out = _dense_product(rows, dense, bias).reshape(*x.shape[:-1], out_features)
            return out if float_out or x.dtype == torch.float32 else out.to(x.dtype)
    widened: torch.Tensor | None = None  # fp32 rows, made once, where a band needs them
    for first, band in weight.bands():
        # bf16 rows as they are where quant_linear_bf16 takes them (-1: it declined, nothing written)
        if rows.dtype == torch.bfloat16 and band_product(lib.quant_linear_bf16, rows, band, bias, first, out) == 0:
            continue
        widened = rows.float() if widened is None else widened
        if band_product(lib.quant_linear_f32, widened, band, bias, first, out) != 0:
            return None
    out = out.reshape(*x.shape[:-1], out_features)
    return out if float_out or x.dtype == torch.float32 else out.to(x.dtype)


def band_product(
    kernel: Any, rows: torch.Tensor, band: QuantizedWeight, bias: torch.Tensor | None, first: int, out: torch.Tensor
) -> int:
    """``kernel`` (``quant_linear_f32`` or ``quant_linear_bf16``) on ``rows`` and ``band``, whose output
    columns start at ``first`` of ``out`` (fp32, rows of its width), with the bias's slice: its return
    code (0, or -1 where it declined and wrote nothing)."""
    return int(
        kernel(
            rows.data_ptr(),
            rows.shape[0],
            rows.stride(0),
            kind_code(band),
            band.qs.data_ptr(),
            band.scales.data_ptr(),
            _address(band.mins),
            _address(band.supers),
            band.group,
            band.shape[0],
            rows.shape[1],
            bias[first:].data_ptr() if bias is not None else None,
            out[:, first:].data_ptr(),
            out.shape[1],
        )
    )


# The buffer each dtype's dequantized weights are written into, grown to the largest and kept: a fresh
# tensor per product would fault in its pages on every call (for a forward of the 1.5B model, about 2.6 GB
# of new pages: most of the dequantization's time). A product's dense weight is read before the next.
# A weight larger than this (a large vocabulary's LM head) takes a tensor of its own, so that the kept
# buffer stays a layer's size.
_dequantize_buffers: dict[torch.dtype, torch.Tensor] = {}
DEQUANTIZE_BUFFER_MAX_BYTES = 256 << 20


def _dequantized(lib: ctypes.CDLL, weight: KeptWeight, dtype: torch.dtype) -> torch.Tensor | None:
    """The whole weight dequantized, in fp32 or rounded to bf16 (nearest even), band by band, in this
    dtype's buffer (valid until the next call); None where the kernel declines a band's operands."""
    out_features, in_features = weight.shape
    values = out_features * in_features
    buffer = _dequantize_buffers.get(dtype)
    if buffer is None or buffer.numel() < values:
        buffer = torch.empty(values, dtype=dtype)
        if buffer.nbytes <= DEQUANTIZE_BUFFER_MAX_BYTES:
            _dequantize_buffers[dtype] = buffer
    dense = buffer[:values].view(out_features, in_features)
    dequantize = lib.quant_dequantize_bf16 if dtype == torch.bfloat16 else lib.quant_dequantize_f32
    for first, band in weight.bands():
        args = (band.qs.data_ptr(), band.scales.data_ptr(), _address(band.mins), _address(band.supers), band.group)
        if dequantize(kind_code(band), *args, band.shape[0], in_features, dense[first:].data_ptr()) != 0:
            return None
    return dense


def _dense_product(rows: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A long prefill's fp32 ``rows @ dense.T (+ bias)`` on the dequantized weight (``rows`` fp32 or bf16): in fp32, or, for a
    bf16 ``dense`` (a weight marked ``bf16_prefill``), with the rows rounded to bf16 too (the product
    rounded to bf16, as a dense bf16 model's, then the bias added in fp32)."""
    if dense.dtype == torch.float32:
        return torch.nn.functional.linear(rows.float(), dense, bias)
    out = torch.nn.functional.linear(rows.bfloat16(), dense).float()
    return out if bias is None else out.add_(bias)


def _address(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None
