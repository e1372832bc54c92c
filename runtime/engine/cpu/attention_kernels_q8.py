"""Decode attention over a quantized decode-key mirror (``csrc/attention_q8.c``), and the copies it reads.

A quantized KV cache (``memory.kv_format``: int8 with a scale per token and head, fp8 e4m3 / e5m2 with
a scale per layer) keeps its decode mirror (``runtime.engine.cpu.decode_mirror``) quantized too: one
byte per value, so a decode step reads half the bytes of a bf16 mirror. ``QuantizedKeys`` is one
layer's copies: codes ``k`` ``[n, Hkv, D, cap]`` (K transposed, as the bf16 mirror keeps it) and ``v``
``[n, Hkv, cap, D]`` in the pool's storage dtype, int8's per-key scales ``[n, Hkv, cap]`` fp32, fp8's
layer scales.

Where the values are made: only inside attention. ``dequantized`` is the torch paths' read of the
copies (a step whose kernel does not apply, e.g. a soft-capped layer: a pass over them); the kernel
widens each code in registers as it reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memory.kv_format import KVCacheFormat


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
