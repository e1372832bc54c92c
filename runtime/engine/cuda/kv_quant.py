"""A quantized KV cache (``memory.kv_format``) inside the Triton kernels: the store's encoders and the
attention kernels' in-load decoders, plus what the host tells a kernel about a layer's pool (``KVRead``).

Store (``kernels.store_kv``): the bytes must equal ``KVCacheFormat.quantize`` run on the same device,
so each encoder follows torch's arithmetic op for op:

- int8, per (token, head) row: ``amax``; ``127 / amax`` as torch computes a number over a tensor,
  ``reciprocal(amax) * 127`` (two roundings); ``round_half_even(x * inv)`` clamped to +-127; the
  scale ``amax / 127`` written as the row's last four bytes (the kernel gets the pool's fp32 view).
- fp8: ``x / layer_scale`` clamped to the format's largest value, then round-to-nearest-even to fp8.
- bfloat16 from a wider model dtype: round-to-nearest-even of the fp32 bits.

Torch divides a tensor by a Python number differently on each device: an IEEE division on a CPU, a
multiply by the fp32 reciprocal on CUDA (``x / 127.0``, ``x / scale``). The store takes the device's
rule (``RECIPROCAL``, decided from where the tensors are), so either way its bytes are torch's.

Why integer arithmetic for the fp8 and bf16 casts: Triton's interpreter (the CPU tests) casts fp32 to
fp8/bf16 by dropping bits (not torch's round-to-nearest-even), and compiled the e4m3 type needs sm89+.
Bit manipulation rounds as torch does on every GPU and under the interpreter: one path, tested on CPU.

Read (the decode and extend kernels, ``load_kv``): each block of K or V is turned into floats as it
is loaded, never in a pass of its own over the cache. The loaded values are exact in the model's
dtype (fp32, bf16 or fp16), so the dots run there as for an unquantized cache; the scales are applied
to the scores and the softmax weights instead of to every value:

- int8: the codes themselves (|q| <= 127: exact in bf16); the row's scale multiplies that key's score
  column (K) and that key's softmax weight (V) in fp32 (``int8_row_scales``).
- fp8 through fp16 bits: e5m2's byte is fp16's top byte; e4m3's seven value bits moved into fp16's
  place are the value times 2^-8 (subnormals included). The layer scale (times 2^8 for e4m3) folds
  into the softmax scale (K) and multiplies the output (V): ``KVRead.k_factor``/``v_factor``.
- a plain cache (the model's dtype, or bf16 under an fp32 model): the values, cast to the model's dtype.

Imported after ``prepare_triton_for_device`` like every kernel module (the mode is read at import).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from memory.kv_format import INT8_MAX, SCALE_BYTES, KVCacheFormat
from runtime.engine.cuda.triton_common import interpreter_requested

# Modes (a kernel's KV_MODE / STORE_MODE constexpr). A plain cache reads and copies as it is.
PLAIN, INT8, FP8_E4M3, FP8_E5M2, BF16 = 0, 1, 2, 3, 4
INT8_MODE = tl.constexpr(INT8)  # (what a kernel compares its KV_MODE with)
_INT8 = INT8_MODE
_FP8_E4M3 = tl.constexpr(FP8_E4M3)
_FP8_E5M2 = tl.constexpr(FP8_E5M2)
_BF16 = tl.constexpr(BF16)
_FP8_MODES = {"fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2}

E4M3_DECODE_FACTOR = 256.0  # load_kv gives an e4m3 value times 2^-8
_DEVICE_RINT = tl.constexpr(not interpreter_requested())
_ROUNDER = tl.constexpr(12582912.0)  # 1.5 * 2^23: (y + it) - it rounds |y| < 2^22 half to even in fp32


@functools.lru_cache(maxsize=1024)
def fp32_reciprocal(x: float) -> float:
    """``1 / x`` rounded to fp32 once, as torch's CUDA division by a Python number computes it."""
    return float(torch.tensor(1.0, dtype=torch.float32).div_(torch.tensor(x, dtype=torch.float32)))


INV_INT8_MAX = fp32_reciprocal(INT8_MAX)
_INV_INT8_MAX = tl.constexpr(INV_INT8_MAX)


@dataclass(frozen=True)
class KVRead:
    """How the attention kernels read one layer's pool: ``mode`` (a ``KV_MODE`` constexpr), what
    multiplies the scores on top of the softmax scale (``k_factor``) and the output (``v_factor``)."""

    mode: int = PLAIN
    k_factor: float = 1.0
    v_factor: float = 1.0

    def head_dim(self, buffer: torch.Tensor) -> int:
        """Values per row of ``buffer`` (an int8 row ends with its scale's bytes)."""
        return buffer.shape[-1] - (SCALE_BYTES if self.mode == INT8 else 0)

    def scales(self, buffer: torch.Tensor) -> torch.Tensor:
        """What the kernels read the rows' scales through: the fp32 view of an int8 buffer (the same
        memory), else the buffer itself (never read)."""
        if self.mode != INT8:
            return buffer
        if buffer.shape[-1] % SCALE_BYTES or buffer.stride(-1) != 1:
            raise ValueError(f"an int8 KV row of {buffer.shape[-1] - SCALE_BYTES} values: head_dim % 4 != 0")
        return buffer.view(torch.float32)


def kv_read(kv_format: KVCacheFormat | None, k_scale: float = 1.0, v_scale: float = 1.0) -> KVRead:
    """The ``KVRead`` of a pool in ``kv_format`` (None: the model's own dtype) whose layer scales
    (fp8 only) are ``k_scale``/``v_scale``."""
    if kv_format is None or not kv_format.quantized:
        return KVRead()
    if kv_format.name == "int8":
        return KVRead(INT8)
    mode = _FP8_MODES[kv_format.name]
    factor = E4M3_DECODE_FACTOR if mode == FP8_E4M3 else 1.0
    return KVRead(mode, k_scale * factor, v_scale * factor)


def store_mode(kv_format: KVCacheFormat | None, pool_dtype: torch.dtype, src_dtype: torch.dtype) -> int:
    """The store kernel's ``STORE_MODE`` for rows of ``src_dtype`` into a pool of ``pool_dtype``."""
    if kv_format is not None and kv_format.quantized:
        return INT8 if kv_format.name == "int8" else _FP8_MODES[kv_format.name]
    return BF16 if pool_dtype == torch.bfloat16 and src_dtype != torch.bfloat16 else PLAIN


# ---- read ---------------------------------------------------------------------------------


@triton.jit
def load_kv(ptrs, mask, KV_MODE: tl.constexpr):
    """A block of K or V rows at ``ptrs`` (masked entries 0) as exactly representable numbers: the
    values (plain), the int8 codes, or the fp8 values as fp16 (e4m3's times 2^-8). The caller casts
    them to its compute dtype."""
    if KV_MODE == _INT8:
        x = tl.load(ptrs, mask=mask, other=0)
    elif KV_MODE == _FP8_E4M3:
        b = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        x = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True)
    elif KV_MODE == _FP8_E5M2:
        b = tl.load(ptrs, mask=mask, other=0).to(tl.int32)
        x = (b << 8).to(tl.int16).to(tl.float16, bitcast=True)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x


@triton.jit
def int8_row_scales(Scales, row_offsets, Lk: tl.constexpr, mask):
    """The fp32 scales of int8 rows whose first value is at ``row_offsets`` (in int8 elements of the
    pool; ``Scales`` is its fp32 view): the four bytes after the row's ``Lk`` codes. Masked: 0."""
    return tl.load(Scales + (row_offsets + Lk) // 4, mask=mask, other=0.0)


# ---- store --------------------------------------------------------------------------------


@triton.jit
def _rint(y):
    """Round half to even of fp32 ``y`` (|y| < 2^22): the device's rint compiled; the interpreter's
    fp32 adds (numpy) round the same way."""
    if _DEVICE_RINT:
        r = libdevice.rint(y)
    else:
        r = (y + _ROUNDER) - _ROUNDER
    return r


@triton.jit
def _shift_round(m, s):
    """``m >> s`` rounded half to even (int32 ``m`` >= 0, 1 <= ``s`` <= 31)."""
    return (m + ((1 << (s - 1)) - 1) + ((m >> s) & 1)) >> s


@triton.jit
def _fp8_bits(f, MAN: tl.constexpr, BIAS: tl.constexpr, LIMIT: tl.constexpr):
    """fp32 ``f`` as the bits of an fp8 with ``MAN`` mantissa bits and exponent bias ``BIAS``, clamped
    to +-``LIMIT`` and rounded half to even (torch's cast; NaN -> 0x7F with its sign), as int32."""
    nan = f != f
    f = tl.minimum(tl.maximum(f, -LIMIT), LIMIT)
    bits = f.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # Normal results: rebias the exponent, round the mantissa (a carry moves into the exponent).
    normal = _shift_round(a - ((127 - BIAS) << 23), 23 - MAN)
    # Below the smallest normal: the significand (implicit one included) shifted to 2^(1 - BIAS - MAN) units.
    shift = tl.minimum(tl.maximum(151 - BIAS - MAN - (a >> 23), 1), 31)
    subnormal = _shift_round((a & 0x7FFFFF) | 0x800000, shift)
    code = tl.where(a >= ((128 - BIAS) << 23), normal, subnormal)
    return tl.where(nan, 0x7F, code) | sign


@triton.jit
def _bf16_bits(f):
    """fp32 ``f`` rounded half to even to bfloat16, as its bits (int32; NaN -> 0x7FC0, torch's)."""
    bits = f.to(tl.int32, bitcast=True)
    r = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(f != f, 0x7FC0, r)


@triton.jit
def store_rows(
    x,
    Dst,
    dst,
    Scales,
    scale_at,
    mask,
    row_mask,
    layer_scale,
    layer_inv,
    STORE_MODE: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """Write rows ``x [heads, D]`` (any float dtype, masked lanes 0) at offsets ``dst`` of the pool
    buffer ``Dst`` (int16 view for BF16) in ``STORE_MODE``. int8: each row's scale at ``scale_at`` of
    ``Scales`` (the fp32 view). fp8: divided by ``layer_scale`` (or times ``layer_inv``, its fp32
    reciprocal, where ``RECIPROCAL``: torch's CUDA rule)."""
    if STORE_MODE == _INT8:
        xf = x.to(tl.float32)
        amax = tl.max(tl.abs(xf), 1)
        positive = amax > 0
        inv = tl.where(positive, tl.math.div_rn(1.0, tl.where(positive, amax, 1.0)) * 127.0, 0.0)
        q = tl.minimum(tl.maximum(_rint(xf * inv[:, None]), -127.0), 127.0)
        tl.store(Dst + dst, q.to(tl.int8), mask=mask)
        if RECIPROCAL:
            scale = amax * _INV_INT8_MAX
        else:
            scale = tl.math.div_rn(amax, 127.0)
        tl.store(Scales + scale_at, scale, mask=row_mask)
    elif STORE_MODE == _FP8_E4M3 or STORE_MODE == _FP8_E5M2:
        if RECIPROCAL:
            f = x.to(tl.float32) * layer_inv
        else:
            f = tl.math.div_rn(x.to(tl.float32), layer_scale)
        if STORE_MODE == _FP8_E4M3:
            code = _fp8_bits(f, 3, 7, 448.0)
        else:
            code = _fp8_bits(f, 2, 15, 57344.0)
        tl.store(Dst + dst, code.to(tl.uint8), mask=mask)
    elif STORE_MODE == _BF16:
        tl.store(Dst + dst, _bf16_bits(x.to(tl.float32)).to(tl.int16), mask=mask)
    else:
        tl.store(Dst + dst, x.to(Dst.dtype.element_ty), mask=mask)
