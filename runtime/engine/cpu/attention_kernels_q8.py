"""Decode attention over a quantized decode-key mirror (``csrc/attention_q8.c``), and the copies it reads.

A quantized KV cache (``memory.kv_format``: int8 with a scale per token and head, fp8 e4m3 / e5m2 with
a scale per layer) keeps its decode mirror (``runtime.engine.cpu.decode_mirror``) quantized too: one
byte per value, so a decode step reads half the bytes of a bf16 mirror (a quarter of an fp32 one).
``QuantizedKeys`` is one layer's copies: codes ``k`` ``[n, Hkv, D, cap]`` (K transposed, as the bf16
mirror keeps it) and ``v`` ``[n, Hkv, cap, D]`` in the pool's storage dtype, int8's per-key scales
``[n, Hkv, cap]`` fp32, fp8's layer scales.

Where the values are made: only inside attention. ``decode_attention`` is ``attention_kernels``'
decode kernel for these copies (the same contract: an append stored first, ``init`` continuing a
shared prefix's softmax, ``kv_row`` for a verify step's rows), widening each code to fp32 in
registers as it reads it (int8: the code, its key's scale on the score and on the probability;
fp8: the code's bits as an fp16, the layer's scales folded into the queries and probabilities);
scores, softmax and sums in fp32. AVX-512, AVX2 (with F16C) and plain C builds, so it applies at
every level. Its append takes the pool's stored rows (``PoolAppend``): the mirror then holds exactly
the pool's bytes. ``dequantized`` is the torch paths' read of the copies (a step the kernel does not
take, e.g. a soft-capped layer: a pass over them).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from memory.kv_format import KVCacheFormat
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.attention_abi import data_ptr_or_none
from runtime.engine.cpu.kernel_library import declare
from runtime.engine.cpu.kv_quant_kernels import FORMAT_CODES

MAX_GROUP = 16  # csrc: MAX_G, MAX_D
MAX_HEAD_DIM = 256
QUERY_DTYPES = (torch.bfloat16, torch.float32)

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
declare(
    "decode_attention_q8",
    (_ptr, _i64, _int, _int)  # q, q_stride, q is bf16, format
    + (_ptr, _ptr, _ptr, _ptr, _f32, _f32)  # kt codes, v codes, k scales, v scales, k layer scale, v layer scale
    + (_ptr, _i64, _i64)  # bias, cap, width
    + (_ptr, _ptr, _i64, _i64, _i64, _i64, _f32)  # out, lse, n, hkv, group, d, scale
    + (_ptr, _ptr, _i64, _ptr, _ptr)  # k_pool, v_pool, pool slots, loc, pos
    + (_ptr, _ptr, _ptr, _i64),  # init_o, init_lse, kv_row, kv_rows
    _int,
)


@dataclass
class QuantizedKeys:
    """One layer's quantized mirror copies: codes ``k`` (K^T ``[n, Hkv, D, cap]``) and ``v``
    (``[n, Hkv, cap, D]``) of ``format.storage``; for int8 each key's scales ``k_scales``/``v_scales``
    ``[n, Hkv, cap]`` fp32 (None for fp8); fp8's layer scales ``k_scale``/``v_scale`` (1.0 for int8)."""

    format: KVCacheFormat
    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K^T, V)`` values in ``dtype`` (``KVCacheFormat.dequantize``'s values: code * scale in fp32)."""
        if self.format.is_fp8:
            k = self.k.view(self.format.fp8_dtype).float() * self.k_scale
            v = self.v.view(self.format.fp8_dtype).float() * self.v_scale
        else:
            assert self.k_scales is not None and self.v_scales is not None
            k = self.k.float() * self.k_scales.unsqueeze(2)
            v = self.v.float() * self.v_scales.unsqueeze(3)
        return k.to(dtype), v.to(dtype)


@dataclass
class PoolAppend:
    """A step's new keys and values for the kernel to copy into the mirror before it attends: the
    pool's stored rows (``k_pool``/``v_pool`` ``[slots, Hkv, row_width]``, already written this
    forward) at slots ``loc`` (int64 ``[n]``) go to key index ``pos[b]`` (int64 ``[n]``) of query
    row b's mirror row. Taking the stored bytes keeps the mirror equal to the pool."""

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    loc: torch.Tensor
    pos: torch.Tensor


def supports(q: torch.Tensor, keys: QuantizedKeys, bias: torch.Tensor | None) -> bool:
    """Whether ``decode_attention`` takes these operands as they are (else use the torch paths)."""
    if q.dim() != 4 or keys.format.name not in FORMAT_CODES or q.dtype not in QUERY_DTYPES:
        return False
    n, hkv, group, d = q.shape
    if group > MAX_GROUP or d > MAX_HEAD_DIM or q.device.type != "cpu" or q.stride()[1:] != (group * d, d, 1):
        return False
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False
    rows, cap = keys.k.shape[0], keys.k.shape[-1]
    if keys.k.shape != (rows, hkv, d, cap) or keys.v.shape != (rows, hkv, cap, d):
        return False
    codes = (keys.k, keys.v)
    if not all(t.dtype == keys.format.storage and t.is_contiguous() and t.device.type == "cpu" for t in codes):
        return False
    scales = (keys.k_scales, keys.v_scales)
    if keys.format.name == "int8" and not all(
        s is not None and s.dtype == torch.float32 and s.shape == (rows, hkv, cap) and s.is_contiguous() for s in scales
    ):
        return False
    return kernel_library.load() is not None


def append_supported(append: PoolAppend, keys: QuantizedKeys, rows: int) -> bool:
    """Whether ``decode_attention`` can copy ``append`` (``rows`` query rows' new tokens) itself."""
    hkv, d = keys.k.shape[1], keys.k.shape[2]
    pools = (append.k_pool, append.v_pool)
    width = keys.format.row_width(d)
    return (
        all(
            t.dtype == keys.format.storage and t.is_contiguous() and t.dim() == 3 and t.shape[1:] == (hkv, width)
            for t in pools
        )
        and append.v_pool.shape == append.k_pool.shape
        and all(t.dtype == torch.int64 and t.shape == (rows,) and t.is_contiguous() for t in (append.loc, append.pos))
    )


def decode_attention(
    q: torch.Tensor,
    keys: QuantizedKeys,
    bias: torch.Tensor | None,
    scale: float,
    width: int,
    with_lse: bool,
    append: PoolAppend | None = None,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [n, Hkv, group, D] in q's dtype, lse [n, Hkv, group] fp32 or None)``: queries ``q``
    ``[n, Hkv, group, D]`` (bf16 or fp32; request rows may be strided) against keys ``[0, width)`` of
    their mirror rows in ``keys``, a key bias ``bias`` fp32 ``[n, 1, 1, cap]`` (0 / -inf) or None.

    ``append`` (checked with ``append_supported``): copy the step's stored rows first. ``init``:
    ``(out, lse)`` fp32 of the same queries over earlier keys (``prefix_attention``): the softmax
    continues from it. ``kv_row`` (int64 ``[n]``): query row b reads mirror row ``kv_row[b]``
    (None: row b). Call only when ``supports(...)`` is True."""
    lib = kernel_library.load()
    assert lib is not None
    n, hkv, group, d = q.shape
    rows, cap = keys.k.shape[0], keys.k.shape[-1]
    assert kv_row is None or (kv_row.dtype == torch.int64 and kv_row.shape == (n,) and kv_row.is_contiguous())
    assert (kv_row is not None or rows == n) and 0 <= width <= cap
    assert append is None or append_supported(append, keys, n)
    if init is not None:
        assert init[0].shape == (n, hkv, group, d) and init[1].shape == (n, hkv, group)
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in init)
    out = q.new_empty(n, hkv, group, d)
    lse = torch.empty(n, hkv, group, dtype=torch.float32) if with_lse else None
    rc = lib.decode_attention_q8(
        q.data_ptr(),
        q.stride(0),
        1 if q.dtype == torch.bfloat16 else 0,
        FORMAT_CODES[keys.format.name],
        keys.k.data_ptr(),
        keys.v.data_ptr(),
        data_ptr_or_none(keys.k_scales),
        data_ptr_or_none(keys.v_scales),
        float(keys.k_scale),
        float(keys.v_scale),
        data_ptr_or_none(bias),
        cap,
        width,
        out.data_ptr(),
        data_ptr_or_none(lse),
        n,
        hkv,
        group,
        d,
        float(scale),
        data_ptr_or_none(append.k_pool if append is not None else None),
        data_ptr_or_none(append.v_pool if append is not None else None),
        append.k_pool.shape[0] if append is not None else 0,
        data_ptr_or_none(append.loc if append is not None else None),
        data_ptr_or_none(append.pos if append is not None else None),
        data_ptr_or_none(init[0] if init is not None else None),
        data_ptr_or_none(init[1] if init is not None else None),
        data_ptr_or_none(kv_row),
        rows,
    )
    if rc != 0:
        raise ValueError(
            f"quantized decode attention kernel rejected group={group}, head_dim={d} "
            "(or an append slot, position or mirror row)"
        )
    return out, lse
