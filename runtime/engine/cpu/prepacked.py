"""Prepacked linear weights on CPU (``CpuOps.linear`` calls ``linear``).

``F.linear`` hands its backend a plain ``[out, in]`` matrix, which is re-laid-out into a
blocked format inside every call (oneDNN for bf16/fp16, MKL's sgemm for fp32). Laying it out
once, after the weights are loaded, saves that work:

- bf16/fp16: oneDNN's reorder (``torch.ops.mkldnn._reorder_linear_weight``, what inductor's
  CPU weight freezing uses) and ``torch.ops.mkldnn._linear_pointwise`` on the packed copy: the
  same oneDNN kernel either way, so the packed path gives bit-identical results, faster at every
  size; it always runs. A bf16 call of at most
  ``AMX_LINEAR_MAX_ROWS`` rows (a decode batch) on a CPU with AMX goes instead to
  ``amx_linear_bf16`` (``csrc/amx_linear.c``), which reads the same packed copy: at those
  sizes a linear streams its weight once, and oneDNN's call left part of the memory
  bandwidth unused and had a setup cost in every call (``bench/cpu_linear.py --dtype bfloat16``).
  Its fp32 sums run in the same tile instruction over the same blocks, so results match
  oneDNN's to the last bit or differ by one bf16 rounding where the two sum in another order.
  It needs the copy in oneDNN's ``AB16b32a2b`` layout, which ``pack_weight`` checks against the
  weight's bytes when it packs (oneDNN picks the layout by shape, dtype and CPU). On a CPU with
  AVX512-BF16 but no AMX oneDNN packs ``[out / 64][in / 2][64][2]`` instead, and such a call goes
  to ``dp_linear_bf16`` (``csrc/dp_linear.c``, the same design on the CPU's bf16 dot products):
  oneDNN's own call left the dot-product units partly idle while the weight streamed in.
- fp32: the copy is laid out in column panels (``[out / 16][in][16]``, ``panel_copy``) for
  ``linear_f32`` (``csrc/linear_f32.c``), which a decode batch's rows take
  (``fp32_panel_rows``): at those sizes the libraries' kernels stalled on fetching the weight
  from memory, this one spreads the fetch over its work (``bench/cpu_linear.py``, with
  AVX-512 and capped at AVX2). A single row (a decode step of one request) takes the kernel's
  matrix-vector path, which multiplies several panels at once so that the FMA chains overlap
  (with AVX2 it streams the weight faster than MKL's sgemv; with AVX-512 too, by a rough
  single-thread check on an AVX512-BF16 EPYC, as are two and three rows). Every build level takes
  every row count from one: a row count left to F.linear would give those rows MKL's bits while a
  call of more rows gives them the kernel's, so a row's bits would depend on how many rows share
  its call (a speculative verify's rows against the decode steps they replay,
  tests/unit/runtime/engine/cpu/test_cpu_verify_one_call.py). Prefill sizes, where
  MKL's blocking wins, stay on F.linear. The
  copy is made only where the kernel can run (a vector build of the kernels). The kernel sums
  each output in its own order (blocks of 256 products in sequence, then the blocks), so its
  result is not F.linear's bits: each output is within a few fp32 epsilons of
  ``sum_k |x_k * w_k|`` of F.linear's (``tests/unit/runtime/engine/cpu/test_cpu_prepack.py`` holds the
  bound), the size of the difference between two valid fp32 sums; inside the band a row's result does not
  depend on the other rows of the batch. The fp32 greedy tokens still equal transformers'
  (tests/unit/runtime/engine/test_model_equivalence.py).

Who owns a copy: nobody here. ``pack_weight`` makes a ``PackedCopy`` (the copy, its layout and the
address the C kernels read), and the weight's plan (``runtime.engine.cpu.weight_plan``), which its
layer owns and replaces when the weight is loaded again, keeps it alive and decides which kernel
reads it at which row count. This module only lays weights out and calls the kernels on a layout
they read. A weight oneDNN refuses (bf16 on an AVX2-only CPU), or an fp32 weight whose rows are not
a multiple of 16, gets no copy and its layer stays on F.linear.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

import torch

from runtime.engine.cpu import kernel_library

logger = logging.getLogger(__name__)

ONEDNN_DTYPES = (torch.bfloat16, torch.float16)
# Rows (tokens) of an fp32 call that take linear_f32 on the panel copy, by the kernels' build
# level (bench/cpu_linear.py: against MKL's sgemm and oneDNN's packed kernel at the bench model's
# shapes). From FP32_PANEL_MAX_ROWS + 1 rows on, MKL's blocking for large products wins; below
# the level's minimum, the libraries' kernels would. Every level starts at one row (the kernel's
# matrix-vector path; AVX-512 once started at four, measured before that path existed): the band
# must hold every decode batch size, else a row's bits depend on its batch's size (a 3-row decode
# step on F.linear, the same rows in a 7-row verify on the kernel).
FP32_PANEL_MAX_ROWS = 128
FP32_PANEL_MIN_ROWS = {"avx2": 1, "avx512": 1, "avx512bf16": 1}  # no entry: the kernel declines
PANEL = 16  # columns per panel of the fp32 copy (csrc/linear_f32.c: PANEL)
# bf16 calls of up to this many rows take amx_linear_bf16 where it applies (beyond it oneDNN's
# cache blocking wins: bench/cpu_linear.py --dtype bfloat16 --m 64 128 256).
AMX_LINEAR_MAX_ROWS = 64  # csrc/amx_linear.c: AMX_LINEAR_MAX_ROWS
PACK_BATCH_HINT = 64  # the batch size oneDNN is told to pack for
DP_COLUMNS = 64  # csrc/dp_linear.c: DP_COLS, columns per block of the layout it reads

# The layouts of a packed copy: what reads it.
PANELS = "panels"  # fp32 [out / 16][in][16]: linear_f32
AMX_TILES = "amx_tiles"  # bf16 as oneDNN's AB16b32a2b: amx_linear_bf16 (and oneDNN)
DP_PAIRS = "dp_pairs"  # bf16 [out / 64][in / 2][64][2], oneDNN's AVX512-BF16 packing: dp_linear_bf16 (and oneDNN)
ONEDNN = "onednn"  # any other oneDNN layout: oneDNN's own kernel only

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
kernel_library.declare("amx_linear_bf16", [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, ctypes.c_int, _ptr], ctypes.c_int)
kernel_library.declare("amx_linear_silu_mul_bf16", [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr], ctypes.c_int)
kernel_library.declare("linear_f32", [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], ctypes.c_int)
kernel_library.declare("dp_linear_bf16", [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, ctypes.c_int, _ptr], ctypes.c_int)


@dataclass(frozen=True, eq=False)
class PackedCopy:
    """A weight laid out for a kernel: the copy (``tensor``, which keeps the memory alive), its
    ``layout`` (one of the names above) and the address our C kernels read (0 for ``ONEDNN``: only
    oneDNN reads it, through the tensor)."""

    tensor: torch.Tensor
    layout: str
    address: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """The copy's resident bytes (oneDNN's opaque tensor: as oneDNN reports them)."""
        if self.tensor.is_mkldnn:
            return int(torch.ops.mkldnn._nbytes(self.tensor))
        return self.tensor.numel() * self.tensor.element_size()


def prepack_available() -> bool:
    """True when this torch build has oneDNN's prepacked linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        return callable(ops._reorder_linear_weight) and callable(ops._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor, batch_hint: int = PACK_BATCH_HINT) -> PackedCopy | None:
    """The packed copy of a ``[out, in]`` CPU weight, or None where it cannot be made: fp32 as
    ``panel_copy``, half precision by oneDNN, whose layout (picked by shape, dtype and CPU) is read
    back from the copy's bytes: ``AMX_TILES`` or ``DP_PAIRS`` where our bf16 kernels read it."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    out_features, in_features = weight.shape
    if weight.dtype == torch.float32:
        panels = panel_copy(weight)
        if panels is None:
            return None
        return PackedCopy(panels, PANELS, panel_address(panels, out_features, in_features), out_features, in_features)
    if weight.dtype not in ONEDNN_DTYPES or not prepack_available():
        return None
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except RuntimeError:
        logger.debug("oneDNN could not pack a %s weight of shape %s", weight.dtype, tuple(weight.shape), exc_info=True)
        return None
    layout, address = ONEDNN, 0
    if weight.dtype == torch.bfloat16:
        if tile_address := _tile_address(weight, packed):
            layout, address = AMX_TILES, tile_address
        elif dp_address := _dp_address(weight, packed):
            layout, address = DP_PAIRS, dp_address
    return PackedCopy(packed, layout, address, out_features, in_features)


def panel_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """fp32 ``[out, in]`` as ``[out / 16][in][16]`` (panel p: columns 16p..16p+15, one cache line
    per depth), what ``linear_f32`` reads; None when ``out`` is not a multiple of 16."""
    out_features, in_features = weight.shape
    if out_features % PANEL or in_features == 0:
        return None
    with torch.no_grad():
        return weight.detach().reshape(out_features // PANEL, PANEL, in_features).transpose(1, 2).contiguous()


def fp32_panel_rows() -> range:
    """Rows of an fp32 call that take ``linear_f32`` with the kernels' build in use (empty: none,
    e.g. kernels off, no compiler, a plain C build)."""
    low = FP32_PANEL_MIN_ROWS.get(kernel_library.level() or "")
    return range(low, FP32_PANEL_MAX_ROWS + 1) if low and kernel_library.load() is not None else range(0)


def onednn_linear(x: torch.Tensor, packed: PackedCopy, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` through oneDNN's kernel on its packed copy (bf16/fp16; the same kernel F.linear
    runs, without re-laying the weight out in the call)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")


def _packed_bytes(weight: torch.Tensor, packed: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """``(address, int16 view of its bytes)`` of oneDNN's copy ``packed`` of bf16 ``weight`` when it
    holds as many bytes as the weight (no padding), else None. (torch.ops.mkldnn.data_ptr /
    _nbytes: what inductor's CPU codegen reads packed weights with.)"""
    try:
        if not packed.is_mkldnn or torch.ops.mkldnn._nbytes(packed) != weight.numel() * 2:
            return None
        address = int(torch.ops.mkldnn.data_ptr(packed))
    except (AttributeError, RuntimeError):
        return None
    return address, torch.frombuffer((ctypes.c_int16 * weight.numel()).from_address(address), dtype=torch.int16)


def _tile_address(weight: torch.Tensor, packed: torch.Tensor) -> int:
    """The address of ``packed`` when it holds bf16 ``weight`` as oneDNN's ``AB16b32a2b``
    (``[out / 32][in / 32][16][32][2]``, nothing else in the buffer), the layout ``amx_linear_bf16``
    reads; else 0. oneDNN picks the layout by shape, dtype and CPU: the bytes are compared."""
    out_features, in_features = weight.shape
    found = _packed_bytes(weight, packed) if out_features % 32 == 0 and in_features % 32 == 0 else None
    if found is None:
        return 0
    address, raw = found
    blocks = weight.detach().view(torch.int16).view(out_features // 32, 32, in_features // 32, 16, 2)
    return address if torch.equal(raw.view(-1, in_features // 32, 16, 32, 2), blocks.permute(0, 2, 3, 1, 4)) else 0


def _dp_address(weight: torch.Tensor, packed: torch.Tensor) -> int:
    """The address of ``packed`` when it holds bf16 ``weight`` as ``[out / 64][in / 2][64][2]``
    (oneDNN's packing for its AVX512-BF16 kernel), the layout ``dp_linear_bf16`` reads; else 0."""
    found = _packed_bytes(weight, packed)
    return found[0] if found is not None and dp_layout_of(weight, found[1]) else 0


def dp_layout_of(weight: torch.Tensor, raw: torch.Tensor) -> bool:
    """Whether the int16 buffer ``raw`` holds bf16 ``[out, in]`` ``weight`` as ``dp_linear_bf16`` reads it."""
    out_features, in_features = weight.shape
    if out_features % DP_COLUMNS or in_features % 2 or raw.numel() != weight.numel():
        return False
    pairs = weight.detach().view(torch.int16).view(out_features // DP_COLUMNS, DP_COLUMNS, in_features // 2, 2)
    return torch.equal(raw.view(out_features // DP_COLUMNS, in_features // 2, DP_COLUMNS, 2), pairs.transpose(1, 2))


def unpacked(copy: PackedCopy) -> torch.Tensor | None:
    """The bf16 ``[out, in]`` weight a copy in ``AMX_TILES`` or ``DP_PAIRS`` holds, read back from its
    bytes (which ``pack_weight`` compared with the weight's: the same values, bit for bit); None for
    another layout."""
    out_features, in_features = copy.out_features, copy.in_features
    if copy.layout not in (AMX_TILES, DP_PAIRS) or not copy.address:
        return None
    raw = torch.frombuffer(
        (ctypes.c_int16 * (out_features * in_features)).from_address(copy.address), dtype=torch.int16
    )
    if copy.layout == DP_PAIRS:  # [out / 64][in / 2][64][2]
        rows = raw.view(out_features // DP_COLUMNS, in_features // 2, DP_COLUMNS, 2).transpose(1, 2)
    else:  # [out / 32][in / 32][16][32][2]
        rows = raw.view(out_features // 32, in_features // 32, 16, 32, 2).permute(0, 3, 1, 2, 4)
    return rows.reshape(out_features, in_features).view(torch.bfloat16).clone()


def panel_address(panels: torch.Tensor, out_features: int, in_features: int) -> int:
    """The address ``linear_f32`` reads when ``panels`` is a usable ``panel_copy`` of an
    ``[out_features, in_features]`` weight (fp32, contiguous, on the CPU), else 0."""
    if (
        panels.dtype != torch.float32
        or panels.device.type != "cpu"
        or not panels.is_contiguous()
        or out_features % PANEL
        or panels.shape != (out_features // PANEL, in_features, PANEL)
    ):
        return 0
    return panels.data_ptr()


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor | None:
    """fp32 ``x [..., in]`` times the weight whose ``panel_copy`` is ``panels``, plus ``bias``,
    through ``linear_f32``; None where the kernel does not apply (no vector build, operands it
    cannot read)."""
    lib = kernel_library.load()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if bias is not None and (
        bias.dtype != torch.float32
        or bias.device.type != "cpu"
        or bias.dim() != 1
        or not bias.is_contiguous()
        or bias.numel() != out_features
    ):
        return None
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    if rows == 0 or not panel_address(panels, out_features, in_features):
        return None
    x2 = x.reshape(rows, in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(rows, out_features, dtype=torch.float32)
    rc = lib.linear_f32(
        x2.data_ptr(),
        rows,
        x2.stride(0),
        panels.data_ptr(),
        out_features,
        in_features,
        bias.data_ptr() if bias is not None else None,
        out.data_ptr(),
    )
    return out.view(*x.shape[:-1], out_features) if rc == 0 else None


def _kernel_operand(x: torch.Tensor, packed: PackedCopy, layout: str) -> tuple[Any, torch.Tensor] | None:
    """``(library, x as [rows, in] with unit column stride)`` when a bf16 kernel that reads
    ``layout`` takes bf16 ``x`` against ``packed``: at most ``AMX_LINEAR_MAX_ROWS`` rows, the
    library built, and ``packed`` in that layout; else None."""
    if packed.layout != layout or not packed.address or x.dtype != torch.bfloat16:
        return None
    in_features = x.shape[-1]
    rows = x.numel() // max(in_features, 1)
    if not 0 < rows <= AMX_LINEAR_MAX_ROWS:
        return None
    lib = kernel_library.load()
    if lib is None:
        return None
    x2 = x.reshape(rows, in_features)
    return (lib, x2) if x2.stride(1) == 1 else None


def _packed_kernel_linear(
    kernel: str,
    layout: str,
    x: torch.Tensor,
    packed: PackedCopy,
    bias: torch.Tensor | None,
    float_out: bool,
) -> torch.Tensor | None:
    """bf16 ``x`` times ``packed`` (plus ``bias``) through the C ``kernel`` (``amx_linear_bf16`` or
    ``dp_linear_bf16``: one signature), or None where it does not apply (``_kernel_operand``)."""
    out_features = packed.out_features
    if bias is not None and (
        bias.dtype != torch.bfloat16 or bias.dim() != 1 or not bias.is_contiguous() or bias.numel() != out_features
    ):
        return None
    operand = _kernel_operand(x, packed, layout)
    if operand is None:
        return None
    lib, x2 = operand
    out = torch.empty(x2.shape[0], out_features, dtype=torch.float32 if float_out else torch.bfloat16)
    rc = getattr(lib, kernel)(
        x2.data_ptr(),
        x2.shape[0],
        x2.stride(0),
        packed.address,
        out_features,
        x2.shape[1],
        bias.data_ptr() if bias is not None else None,
        int(float_out),
        out.data_ptr(),
    )
    return out.view(*x.shape[:-1], out_features) if rc == 0 else None


def amx_linear(
    x: torch.Tensor, packed: PackedCopy, bias: torch.Tensor | None, float_out: bool = False
) -> torch.Tensor | None:
    """bf16 ``x [..., in]`` times the oneDNN-packed ``packed`` through ``amx_linear_bf16``, or None
    where it does not apply (AMX off, or see ``_kernel_operand``).
    ``float_out``: the bf16 results widened to fp32 (``.float()`` of the bf16 result)."""
    return _packed_kernel_linear("amx_linear_bf16", AMX_TILES, x, packed, bias, float_out)


def dp_linear(
    x: torch.Tensor, packed: PackedCopy, bias: torch.Tensor | None, float_out: bool = False
) -> torch.Tensor | None:
    """The same through ``dp_linear_bf16`` where oneDNN packed for AVX512-BF16 without AMX."""
    return _packed_kernel_linear("dp_linear_bf16", DP_PAIRS, x, packed, bias, float_out)


def amx_linear_silu_mul(x: torch.Tensor, packed: PackedCopy, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x`` times ``packed`` (a merged gate/up weight, gate rows first) in
    one call of ``amx_linear_silu_mul_bf16``: the same bf16 values as the linear followed by the
    silu*mul kernel, without writing the ``[rows, 2 * inter]`` intermediate. None where it does not
    apply (a bias, rows not in whole column blocks, or see ``_kernel_operand``; then run the two)."""
    operand = _kernel_operand(x, packed, AMX_TILES) if bias is None and packed.out_features % 64 == 0 else None
    if operand is None:
        return None
    lib, x2 = operand
    inter = packed.out_features // 2
    out = torch.empty(x2.shape[0], inter, dtype=torch.bfloat16)
    rc = lib.amx_linear_silu_mul_bf16(
        x2.data_ptr(), x2.shape[0], x2.stride(0), packed.address, inter, x2.shape[1], out.data_ptr()
    )
    return out.view(*x.shape[:-1], inter) if rc == 0 else None
