"""ctypes wrapper of ``csrc/lora.c``: ``DeviceOps.lora_add`` (multi-LoRA's shrink and expand) on CPU.

``lora_add`` returns False where the kernel does not apply, and the caller runs the torch reference
(``runtime.engine.ops.lora.reference_lora_add``): kernels off (``TINYSERVE_CPU_KERNELS=0``) or not
built, tensors not on the CPU, a dtype other than fp32 and bf16 or mixed dtypes, weights that are
not contiguous, or rows of ``out``/``x`` that are not contiguous. Arguments the kernel refuses (a
slot past the stacked weights, runs outside the batch, parts that do not cover ``out``'s rows) raise
``ValueError``: it checks them all before it reads any tensor.

The kernel computes in fp32 and rounds each output once, as the reference does; the sums run in
another order (dot products over K in vector lanes, with AVX512-BF16 over bf16 pairs), so results
agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.kernel_library import declare
from runtime.engine.ops.lora import LoraSegments, LoraWeights

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# x, ldx, out, ldo, T, K, N, a, b, S, R, P, part_rows, starts, slots, n
_SIGNATURE = [_ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64]
declare("lora_add_f32", _SIGNATURE, _int)
declare("lora_add_bf16", _SIGNATURE, _int)

_KERNELS = {torch.float32: "lora_add_f32", torch.bfloat16: "lora_add_bf16"}
# csrc: lora_add's return codes (-5, out of memory, falls back to the reference)
_REFUSED = {
    -1: "sizes or strides that do not fit",
    -2: "part_rows that do not split out's rows",
    -3: "runs outside the batch's tokens",
    -4: "a slot past the stacked weights",
}


def lora_add(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> bool:
    """``out [T, N] +=`` each run's adapter product of ``x [T, K]`` in place, as
    ``reference_lora_add``; False (nothing written) where the kernel does not apply."""
    lib = kernel_library.load()
    a, b = weights.a, weights.b
    kernel = _KERNELS.get(out.dtype)
    if lib is None or kernel is None:
        return False
    strides = _row_strides(out, x, a, b)
    if strides is None:
        return False
    part_rows = weights.part_rows
    slots, rank = a.shape[0], b.shape[2]
    if a.shape[1] != (len(part_rows) - 1) * rank:
        raise ValueError(f"lora_add: a's {a.shape[1]} rows are not {len(part_rows) - 1} parts of rank {rank}")
    starts, run_slots = _runs(segments)
    rc = getattr(lib, kernel)(
        x.data_ptr(),
        strides[1],
        out.data_ptr(),
        strides[0],
        out.shape[0],
        a.shape[2],
        b.shape[1],
        a.data_ptr(),
        b.data_ptr(),
        slots,
        rank,
        len(part_rows) - 1,
        _part_rows(part_rows),
        starts.data_ptr(),
        run_slots.data_ptr(),
        run_slots.numel(),
    )
    if rc in _REFUSED:
        raise ValueError(f"lora_add: {_REFUSED[rc]} (part_rows {part_rows}, runs {segments.starts_cpu})")
    return rc == 0


def _row_strides(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """``out``'s and ``x``'s row strides where the kernel reads these tensors as they are (CPU, one
    dtype, rows contiguous and apart, contiguous weights of matching shapes), else None. Checked
    with torch's cheapest accessors: a decode step calls this for every adapted linear."""
    dtype = out.dtype
    if not (out.is_cpu and x.is_cpu and a.is_cpu and b.is_cpu) or not (x.dtype == a.dtype == b.dtype == dtype):
        return None
    if out.ndim != 2 or x.ndim != 2 or a.ndim != 3 or b.ndim != 3 or not (a.is_contiguous() and b.is_contiguous()):
        return None
    (tokens, n), (x_tokens, k) = out.shape, x.shape
    (out_row, out_col), (x_row, x_col) = out.stride(), x.stride()
    if tokens <= 1:  # a single row's stride is whatever torch left: only its width matters
        out_row = x_row = max(n, k)
    if out_col != 1 or x_col != 1 or out_row < n or x_row < k or x_tokens != tokens:
        return None  # strided columns, or rows that overlap (a broadcast)
    if a.shape[0] != b.shape[0] or a.shape[2] != k or b.shape[1] != n or min(n, k, b.shape[2]) < 1:
        return None
    return out_row, x_row


@functools.lru_cache(maxsize=64)
def _part_rows(part_rows: tuple[int, ...]) -> ctypes.Array[ctypes.c_int64]:
    """``part_rows`` as the kernel's int64 array (one per linear shape, made once)."""
    return (ctypes.c_int64 * len(part_rows))(*part_rows)


def _runs(segments: LoraSegments) -> tuple[torch.Tensor, torch.Tensor]:
    """The runs' starts and slots as int32 CPU tensors: the segments' own where they are (a CPU
    model's), else built from the host copies."""
    starts, slots = segments.starts, segments.slots
    if (
        starts.is_cpu
        and slots.is_cpu
        and starts.dtype == slots.dtype == torch.int32
        and starts.is_contiguous()
        and slots.is_contiguous()
        and starts.numel() == slots.numel() + 1
    ):
        return starts, slots
    return (
        torch.tensor(segments.starts_cpu, dtype=torch.int32),
        torch.tensor(segments.slots_cpu, dtype=torch.int32),
    )
