"""A quantized pool's decode-mirror copies (``runtime.engine.cpu.decode_mirror``): made, gathered and
appended as the pool's codes, never as values.

The mirror decides when its copies are rebuilt or appended to and what they hold; this module does
the moves for a quantized pool (``memory.kv_format``: int8 rows of D codes and their fp32 scale, fp8
rows of D codes), into ``QuantizedKeys`` (codes K^T ``[n, Hkv, D, cap]``, V ``[n, Hkv, cap, D]``, int8's
per-key scales ``[n, Hkv, cap]``): the gather in C where the kernel applies (``kv_quant_kernels``), else
torch's index_select and copies, which move the same bytes; and says what the copies cost
(``nbytes_of_copies``) and whether the cascade runs over such a pool (``cascades``).
"""

from __future__ import annotations

import torch

from memory.kv_format import SCALE_BYTES, KVCacheFormat, KVRows
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import kv_quant_kernels
from runtime.engine.cpu.attention_kernels_q8 import QuantizedKeys


def head_dim_of(rows: KVRows) -> int:
    """D of a layer's pool rows (an int8 row is D codes and its 4-byte scale)."""
    return rows.buffer.shape[2] - (SCALE_BYTES if rows.format.name == "int8" else 0)


def new_copies(k_rows: KVRows, v_rows: KVRows, n: int, cap: int) -> QuantizedKeys:
    """Zeroed copies for ``n`` rows of ``cap`` keys (zeroed, not empty: a masked key's product with a
    NaN code would still poison its row's softmax)."""
    fmt, hkv, d = k_rows.format, k_rows.heads, head_dim_of(k_rows)
    int8 = fmt.name == "int8"
    return QuantizedKeys(
        fmt,
        torch.zeros(n, hkv, d, cap, dtype=fmt.storage),
        torch.zeros(n, hkv, cap, d, dtype=fmt.storage),
        torch.zeros(n, hkv, cap) if int8 else None,
        torch.zeros(n, hkv, cap) if int8 else None,
        k_rows.scale,
        v_rows.scale,
    )


def gather(keys: QuantizedKeys, k_rows: KVRows, v_rows: KVRows, loc: torch.Tensor, width: int) -> None:
    """Keys ``[0, width)`` of every row: the pool rows at ``loc`` (int64 ``[n * width]``, row by row)."""
    k_buf, v_buf = k_rows.buffer, v_rows.buffer
    if kv_quant_kernels.mirror_gather(
        k_buf, v_buf, keys.format, loc, width, keys.k, keys.v, keys.k_scales, keys.v_scales
    ):
        return
    n, hkv, d, _ = keys.k.shape
    rows_k = k_buf.index_select(0, loc).view(n, width, hkv, -1)
    rows_v = v_buf.index_select(0, loc).view(n, width, hkv, -1)
    keys.k[..., :width].copy_(rows_k[..., :d].permute(0, 2, 3, 1))
    keys.v[:, :, :width].copy_(rows_v[..., :d].transpose(1, 2))
    if keys.k_scales is not None and keys.v_scales is not None:
        keys.k_scales[..., :width].copy_(kv_quant_kernels.row_scales(rows_k).transpose(1, 2))
        keys.v_scales[..., :width].copy_(kv_quant_kernels.row_scales(rows_v).transpose(1, 2))


def append(
    keys: QuantizedKeys,
    k_rows: KVRows,
    v_rows: KVRows,
    loc: torch.Tensor,
    pos: torch.Tensor,
    kv_row: torch.Tensor | None,
) -> None:
    """The step's new keys: the rows the pool stored at slots ``loc`` (int64 ``[n]``) to key ``pos[i]`` of
    row ``kv_row[i]`` (None: row i). The kernel's own append (``PoolAppend``) does the same in C."""
    d = keys.k.shape[2]
    rows = kv_row if kv_row is not None else torch.arange(pos.shape[0])
    new_k, new_v = k_rows.buffer.index_select(0, loc), v_rows.buffer.index_select(0, loc)  # [n, Hkv, row]
    keys.k[rows, :, :, pos] = new_k[..., :d]
    keys.v[rows, :, pos] = new_v[..., :d]
    if keys.k_scales is not None and keys.v_scales is not None:
        keys.k_scales[rows, :, pos] = kv_quant_kernels.row_scales(new_k)
        keys.v_scales[rows, :, pos] = kv_quant_kernels.row_scales(new_v)


def cascades(pool: object) -> bool:
    """Whether a decode group's shared prefix is attended apart (cascade) over this pool: always for
    the model's dtype; for a quantized pool where the prefix kernel runs (``decode_mirror``'s doc says
    why)."""
    kv_format: KVCacheFormat = getattr(pool, "format")
    if not kv_format.quantized:
        return True
    return attn_kernels.prefix_supported(kv_format.compute, torch.device("cpu"), getattr(pool, "head_dim"))


def nbytes_of_copies(n: int, cap: int, prefix: int, hkv: int, d: int, layers: int, kv_format: KVCacheFormat) -> int:
    """Bytes of the mirror's copies of ``layers`` layers: ``n`` rows of ``cap`` keys in the pool's format
    (a quantized one's codes and int8's scales), and the shared prefix's ``prefix`` keys twice (its K^T /
    V and the packed copy for ``attn_kernels.prefix_attention``), in the pool's dtype or, for a quantized
    pool, dequantized to the model's."""
    if kv_format.quantized:
        own, value_bytes = n * cap * hkv * kv_format.head_bytes(d), kv_format.compute.itemsize
    else:
        value_bytes = kv_format.storage.itemsize
        own = n * cap * hkv * d * value_bytes
    return 2 * layers * (own + 2 * prefix * hkv * d * value_bytes)
