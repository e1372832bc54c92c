"""How the KV cache stores a token's K and V: the model's dtype, or quantized (``--kv-cache-dtype``).

At long contexts and many users the KV cache, not the weights, fills memory and is what a decode
step reads; storing it in one byte a value holds twice the tokens of a bf16 cache (four times an
fp32 one) and reads half the bytes. The formats (SGLang's names, plus llama.cpp's q8_0 idea):

- ``auto``: the model's dtype, as before; ``bf16``: bfloat16 whatever the model's dtype.
- ``fp8_e4m3`` / ``fp8_e5m2``: one byte a value, divided first by a per-layer scale (1.0 unless the
  checkpoint carries ``k_scale``/``v_scale``), saturated at the format's largest value (a cast alone
  would make NaN of anything past it). Stored as the fp8 bit patterns in ``uint8`` buffers, so that
  every copy, gather and scatter of the pool (host tier, copy-on-write, SWA) is a byte move.
- ``int8``: symmetric per (token, KV head): one fp32 scale ``amax / 127`` and ``round(x * 127 / amax)``
  per value. The scale's four bytes follow the head's ``D`` values in the same row (a row of ``D + 4``
  int8), so the pool stays one tensor per layer whose rows move as they are; ``D`` is a multiple of 4
  in every model served, so the scales view as fp32 in place.

Where a format is read: attention kernels dequantize inside themselves (the C decode kernels, the
Triton kernels); the torch paths dequantize the rows they gather (``dequantize``), never the whole
cache. Where it is written: once, where K/V are stored (``quantize``, and the kernels' own stores,
which must give these bytes exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127.0
SCALE_BYTES = 4  # an int8 row's fp32 scale, after its D values

_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_FLOAT_NAMES = {
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float64: "float64",  # (the stub runner's)
}
# Each format's buffer element, looked up once (``storage`` is read on every reference store).
_STORAGE: dict[str, torch.dtype] = {
    **{name: dtype for dtype, name in _FLOAT_NAMES.items()},
    "int8": torch.int8,
    **{name: torch.uint8 for name in _FP8},  # (the fp8 bits)
}


@dataclass(frozen=True)
class KVCacheFormat:
    """The pool's element format: ``name`` (``float32``/``bfloat16``/``float16`` for an unquantized
    cache, else ``fp8_e4m3``/``fp8_e5m2``/``int8``) and ``compute`` (the model's dtype: what attention
    reads the values as)."""

    name: str
    compute: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name in _FP8 or self.name == "int8"

    @property
    def is_fp8(self) -> bool:
        return self.name in _FP8

    @property
    def fp8_dtype(self) -> torch.dtype:
        return _FP8[self.name]

    @property
    def storage(self) -> torch.dtype:
        """The pool buffers' element dtype."""
        return _STORAGE[self.name]

    def row_width(self, head_dim: int) -> int:
        """Elements of one (token, KV head) row of the pool: ``D``, or ``D + 4`` (int8: its scale)."""
        return head_dim + SCALE_BYTES if self.name == "int8" else head_dim

    def head_bytes(self, head_dim: int) -> int:
        """Bytes one token's K (or V) of one KV head takes."""
        return self.row_width(head_dim) * self.storage.itemsize

    def quantize(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        """``x [..., D]`` (any float dtype) as pool rows ``[..., row_width]`` of ``storage``: the
        reference every kernel's store must equal byte for byte. ``scale``: fp8's per-layer scale."""
        if not self.quantized:
            return x.to(self.storage)
        xf = x.float()
        if self.is_fp8:
            limit = torch.finfo(self.fp8_dtype).max
            return (xf / scale).clamp_(-limit, limit).to(self.fp8_dtype).view(torch.uint8)
        amax = xf.abs().amax(dim=-1, keepdim=True)
        # 127 / amax as torch computes a scalar over a tensor: fp32 reciprocal(amax), times 127 (two
        # roundings, not one division; csrc/kv_quant.c does the same), then one multiply per value;
        # an all-zero head has scale 0 and values 0.
        inv = torch.where(amax > 0, INT8_MAX / amax, torch.zeros_like(amax))
        q = (xf * inv).round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        row_scale = (amax / INT8_MAX).contiguous().view(torch.int8)  # [..., 4]: the fp32 bytes
        return torch.cat([q, row_scale], dim=-1)

    def dequantize(self, rows: torch.Tensor, scale: float = 1.0, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Pool rows ``[..., row_width]`` as values ``[..., D]`` in ``dtype`` (default ``compute``):
        ``q * scale`` computed in fp32. An unquantized cache's rows are returned as they are, cast."""
        out = dtype or self.compute
        if not self.quantized:
            return rows.to(out)
        if self.is_fp8:
            values = rows.view(self.fp8_dtype).float()
            return (values * scale if scale != 1.0 else values).to(out)
        d = rows.shape[-1] - SCALE_BYTES
        row_scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return (rows[..., :d].float() * row_scale).to(out)

    def describe(self) -> str:
        """``int8 (per token and head, fp32 scale)`` etc., for the start-up lines."""
        return {
            "int8": "int8 (symmetric per token and KV head, one fp32 scale)",
            "fp8_e4m3": "fp8_e4m3 (per-layer scale)",
            "fp8_e5m2": "fp8_e5m2 (per-layer scale)",
        }.get(self.name, self.name)


def kv_cache_format(kv_cache_dtype: str, model_dtype: torch.dtype) -> KVCacheFormat:
    """The format ``--kv-cache-dtype`` names (its choices: ``runtime.config.memory_args``) for a model
    computing in ``model_dtype``."""
    if kv_cache_dtype not in ("auto", "bf16", "bfloat16", "int8", *_FP8):
        raise ValueError(f"unknown KV cache dtype {kv_cache_dtype!r}")
    if kv_cache_dtype == "auto":
        return KVCacheFormat(_FLOAT_NAMES[model_dtype], model_dtype)
    if kv_cache_dtype in ("bf16", "bfloat16"):
        return KVCacheFormat("bfloat16", model_dtype)
    return KVCacheFormat(kv_cache_dtype, model_dtype)


@dataclass(frozen=True)
class KVRows:
    """One layer's K (or V) buffer as attention reads it: the storage, its format and the layer's fp8
    scale. ``gather`` is the torch paths' read: the rows at some slots, dequantized (only those)."""

    buffer: torch.Tensor  # [slots, Hkv, row_width] of format.storage
    format: KVCacheFormat
    scale: float = 1.0

    def gather(self, loc: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[len(loc), Hkv, D]`` values at slots ``loc`` (int64, flat)."""
        return self.format.dequantize(self.buffer.index_select(0, loc), self.scale, dtype)

    @property
    def heads(self) -> int:
        return self.buffer.shape[1]
