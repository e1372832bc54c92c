"""The quantized KV cache's C writes (``csrc/kv_quant.c``): a forward's new K/V quantized into the pool,
and the decode mirror's rebuild from quantized pool rows.

- ``store_kv``: the forward's new K/V rows (bf16 or fp32; token rows may be strided, as views of a
  fused qkv output are) quantized straight into their pool slots, bytes equal to
  ``KVCacheFormat.quantize`` (the reference: the pool's own ``set_kv_buffer``), which in torch costs a
  float copy, an amax, a divide, a round, a clamp, a cast and a cat per store, then an indexed write;
- ``mirror_gather``: the decode mirror's copies re-made from the pool (``runtime.engine.cpu.decode_mirror``),
  codes moved as they are (K transposed), int8's per-row scales into their own arrays: the copies stay
  quantized, so the decode kernel (``attention_kernels_q8``) reads half a bf16 mirror's bytes.

Formats (``memory.kv_format``): ``int8`` (a row of D int8 values then its fp32 scale), ``fp8_e4m3`` and
``fp8_e5m2`` (D bytes of fp8 bits, one scale per layer). ``FORMAT_CODES`` gives C's names for them
(``csrc/kv_codes.h``). Every wrapper returns False, writing nothing, where its kernel does not apply
(no library, another dtype or layout): the caller then keeps its torch path.
"""

from __future__ import annotations

import ctypes

import torch

from memory.kv_format import SCALE_BYTES, KVCacheFormat
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.kernel_library import declare

FORMAT_CODES = {"int8": 1, "fp8_e4m3": 2, "fp8_e5m2": 3}  # csrc/kv_codes.h
MAX_HEAD_DIM = 256  # csrc: MAX_D
_SOURCE_DTYPES = (torch.bfloat16, torch.float32)

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
declare(
    "store_kv_rows_q", [_ptr, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _int, _f32, _f32, _ptr, _ptr, _i64], _int
)
declare("mirror_gather_q", [_ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _int, _ptr, _ptr, _ptr, _ptr], _int)


def format_code(kv_format: KVCacheFormat) -> int | None:
    """C's code of a quantized format (None: not one the kernels read)."""
    return FORMAT_CODES.get(kv_format.name)


def _pool_buffers_fit(k_buf: torch.Tensor, v_buf: torch.Tensor, kv_format: KVCacheFormat) -> bool:
    """``[slots, Hkv, row_width]`` contiguous CPU buffers of the format's storage, alike."""
    return (
        k_buf.dim() == 3
        and k_buf.dtype == kv_format.storage
        and k_buf.device.type == "cpu"
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
        and v_buf.dtype == k_buf.dtype
        and v_buf.shape == k_buf.shape
    )


def _int_arg(t: torch.Tensor, n: int) -> bool:
    return t.dtype == torch.int64 and t.device.type == "cpu" and t.is_contiguous() and t.shape == (n,)


def store_kv(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_format: KVCacheFormat,
    k_scale: float,
    v_scale: float,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> bool:
    """Quantize ``k``/``v`` ``[n, Hkv, D]`` (bf16 or fp32, alike; heads packed, token rows may be
    strided) into slots ``loc`` (int64 ``[n]``) of a quantized pool's ``k_buf``/``v_buf``
    ``[slots, Hkv, row_width]``; ``k_scale``/``v_scale``: fp8's layer scales. False, writing
    nothing, where the kernel does not apply; slots outside the pool are refused here too, so that
    the pool's own write raises its usual error."""
    code = format_code(kv_format)
    if code is None or k.dim() != 3 or not _pool_buffers_fit(k_buf, v_buf, kv_format):
        return False
    n, hkv, d = k.shape
    if not (_int_arg(loc, n) and 0 < d <= MAX_HEAD_DIM and k_buf.shape[1:] == (hkv, kv_format.row_width(d))):
        return False
    for t in (k, v):
        if t.dtype not in _SOURCE_DTYPES or t.dtype != k.dtype or t.device.type != "cpu":
            return False
        if t.shape != (n, hkv, d) or (n and t.stride()[1:] != (d, 1)):
            return False
    lib = kernel_library.load()
    if lib is None:
        return False
    elem = k.element_size()
    return (
        lib.store_kv_rows_q(
            k.data_ptr(),
            k.stride(0) * elem,
            v.data_ptr(),
            v.stride(0) * elem,
            elem,
            loc.data_ptr(),
            n,
            hkv,
            d,
            code,
            float(k_scale),
            float(v_scale),
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.shape[0],
        )
        == 0
    )


def mirror_gather(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_format: KVCacheFormat,
    loc: torch.Tensor,
    width: int,
    codes_k: torch.Tensor,
    codes_v: torch.Tensor,
    scales_k: torch.Tensor | None,
    scales_v: torch.Tensor | None,
) -> bool:
    """Keys ``[0, width)`` of a quantized decode mirror: the pool rows at ``loc`` (int64 ``[n * width]``,
    request by request) of ``k_buf``/``v_buf`` into ``codes_k [n, Hkv, D, cap]`` (transposed),
    ``codes_v [n, Hkv, cap, D]`` (the pool's storage dtype) and, for int8, the rows' scales into
    ``scales_k``/``scales_v`` fp32 ``[n, Hkv, cap]`` (None for fp8). False, writing nothing, where
    the kernel does not apply (then use torch's gather); slots outside the pool are refused too."""
    code = format_code(kv_format)
    if code is None or codes_k.dim() != 4 or not _pool_buffers_fit(k_buf, v_buf, kv_format):
        return False
    n, hkv, d, cap = codes_k.shape
    if not (_int_arg(loc, n * width) and 0 <= width <= cap and k_buf.shape[1:] == (hkv, kv_format.row_width(d))):
        return False
    for t, shape in ((codes_k, (n, hkv, d, cap)), (codes_v, (n, hkv, cap, d))):
        if t.dtype != k_buf.dtype or t.shape != shape or not t.is_contiguous() or t.device.type != "cpu":
            return False
    int8 = kv_format.name == "int8"
    for s in (scales_k, scales_v):
        if int8 != (s is not None):
            return False
        if s is not None and (s.dtype != torch.float32 or s.shape != (n, hkv, cap) or not s.is_contiguous()):
            return False
    lib = kernel_library.load()
    if lib is None:
        return False
    return (
        lib.mirror_gather_q(
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.shape[0],
            loc.data_ptr(),
            n,
            width,
            hkv,
            d,
            cap,
            code,
            codes_k.data_ptr(),
            codes_v.data_ptr(),
            scales_k.data_ptr() if scales_k is not None else None,
            scales_v.data_ptr() if scales_v is not None else None,
        )
        == 0
    )


def row_scales(rows: torch.Tensor) -> torch.Tensor:
    """int8 pool rows ``[..., D + 4]`` -> their fp32 scales ``[...]`` (torch's read of what the kernels
    read in C)."""
    d = rows.shape[-1] - SCALE_BYTES
    return rows[..., d:].contiguous().view(torch.float32).squeeze(-1)
