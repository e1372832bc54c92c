"""MHATokenToKVPool: the per-layer K and V tensors that every token's KV lives in.

Owner: the ModelRunner creates it; the allocator hands out slot indices into it;
attention backends write new K/V at ``out_cache_loc`` and read through
``req_to_token``. Slot 0 is a padding slot that is never handed out, so padded
positions in kernels can point at it harmlessly.

The buffers hold the cache's format (``memory.kv_format``: the model's dtype, or quantized with
``--kv-cache-dtype``): rows of ``format.row_width(D)`` elements of ``format.storage`` per (token, KV
head). Whatever moves slots (copy-on-write, the host tier, SWA) moves whole rows and need not know
the format; whatever reads values goes through ``kv_rows`` (the torch paths) or a kernel that
dequantizes as it reads.
"""

from __future__ import annotations

import torch

from memory.kv_format import KVCacheFormat, KVRows, kv_cache_format


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, kv_format: KVCacheFormat) -> int:
    """Bytes of one token's K and V over every layer (the device pool's and the host tier's layout)."""
    return 2 * num_layers * kv_heads * kv_format.head_bytes(head_dim)


class MHATokenToKVPool:
    """``dtype``: the model's; ``kv_format`` (default: that dtype, unquantized) the buffers' format.
    ``self.dtype`` is the buffers' element dtype (``kv_format.storage``)."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: str | torch.device,
        kv_format: KVCacheFormat | None = None,
    ) -> None:
        if size <= 0 or page_size <= 0:
            raise ValueError(f"MHATokenToKVPool needs size > 0 and page_size > 0, got {size}, {page_size}")
        self.size = size
        self.page_size = page_size
        self._init_format(dtype, kv_format, num_layers, kv_heads, head_dim)
        self.device = torch.device(device)
        shape = (size + page_size, kv_heads, self.row_width)
        self.k_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(num_layers)]

    def _init_format(
        self, dtype: torch.dtype, kv_format: KVCacheFormat | None, num_layers: int, kv_heads: int, head_dim: int
    ) -> None:
        """The fields every pool shares: its format, row layout and per-layer fp8 scales (1.0 each)."""
        self.format = kv_format or kv_cache_format("auto", dtype)
        self.dtype = self.format.storage
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.row_width = self.format.row_width(head_dim)
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    def set_layer_scales(self, k_scales: list[float], v_scales: list[float]) -> None:
        """fp8 caches: each layer's K and V scale (a checkpoint's ``k_scale``/``v_scale``), before any store."""
        if len(k_scales) != self.num_layers or len(v_scales) != self.num_layers:
            raise ValueError(f"need {self.num_layers} K and V scales, got {len(k_scales)} and {len(v_scales)}")
        if any(s <= 0 for s in (*k_scales, *v_scales)):
            raise ValueError("KV cache scales must be > 0")
        self.k_scales, self.v_scales = [float(s) for s in k_scales], [float(s) for s in v_scales]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def kv_rows(self, layer_id: int) -> tuple[KVRows, KVRows]:
        """Layer ``layer_id``'s K and V as the torch paths read them (``KVRows.gather``)."""
        return (
            KVRows(self.k_buffer[layer_id], self.format, self.k_scales[layer_id]),
            KVRows(self.v_buffer[layer_id], self.format, self.v_scales[layer_id]),
        )

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` of shape ``[len(loc), kv_heads, head_dim]`` at slots ``loc`` (quantized
        to the cache's format: ``KVCacheFormat.quantize``, the reference of every kernel's store)."""
        self.k_buffer[layer_id][loc] = self.format.quantize(k, self.k_scales[layer_id])
        self.v_buffer[layer_id][loc] = self.format.quantize(v, self.v_scales[layer_id])

    def stored_values(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k``/``v`` as the cache holds them: quantized and read back (themselves for an unquantized
        cache of their dtype). An extend's new tokens attend to these, so that a prompt reads the same
        values whether its keys were computed in this forward, an earlier chunk or a cached prefix."""
        if not self.format.quantized and k.dtype == self.dtype:
            return k, v
        fmt, ks, vs = self.format, self.k_scales[layer_id], self.v_scales[layer_id]
        return fmt.dequantize(fmt.quantize(k, ks), ks, k.dtype), fmt.dequantize(fmt.quantize(v, vs), vs, v.dtype)

    def copy_slots(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """Copy every layer's KV from ``src_loc`` to ``dst_loc`` (copy-on-write of a shared partial page)."""
        for k, v in zip(self.k_buffer, self.v_buffer):
            k[dst_loc] = k[src_loc]
            v[dst_loc] = v[src_loc]

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.format)

    def describe(self) -> dict[str, object]:
        """``server_info``'s ``kv_cache``: the format and what a token costs."""
        return {
            "dtype": self.format.name,
            "description": self.format.describe(),
            "bytes_per_token": self.bytes_per_token(),
            "quantized": self.format.quantized,
        }
