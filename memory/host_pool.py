"""The host tier of the KV cache: a second KV pool in host RAM and the allocator of its slots.

Owner: the hierarchical radix cache (:mod:`memory.hiradix_cache`) owns every host slot it
stores in a node's ``host_value``; the rest are free in ``HostKVPool.allocator``. The
layout per layer is the device pool's (``[slots, kv_heads, row_width]`` for K and for V, in the
device pool's format: a quantized cache takes as few host bytes as device ones;
slot 0 a padding slot, whole pages when ``page_size > 1``), so a set of slots moves
between the tiers with one gather and one scatter per layer and a node's pages stay
pages in both tiers. When the device pool is on cuda the host buffers are pinned, so
copies to and from the device are true asynchronous DMA on the copy stream.
"""

from __future__ import annotations

import logging

import torch

from memory.allocator import BaseTokenToKVPoolAllocator
from memory.kv_pool import MHATokenToKVPool, kv_bytes_per_token

logger = logging.getLogger(__name__)

GIB = 1 << 30


def host_pool_tokens(
    device_tokens: int, bytes_per_token: int, page_size: int, hicache_ratio: float, hicache_size_gb: float
) -> int:
    """Host tokens for ``--hicache-size`` (GB; wins when > 0) or ``--hicache-ratio`` (host tokens per
    device token), rounded down to whole pages and at least one page."""
    if hicache_size_gb > 0:
        tokens = int(hicache_size_gb * GIB // bytes_per_token)
    else:
        tokens = int(device_tokens * hicache_ratio)
    return max(page_size, tokens // page_size * page_size)


class HostKVPool:
    """K and V of every layer for ``size`` host slots, shaped like ``device_pool``'s buffers."""

    def __init__(self, device_pool: MHATokenToKVPool, size: int) -> None:
        self.size = size
        self.page_size = device_pool.page_size
        self.dtype = device_pool.dtype  # the device pool's storage: a quantized cache is quantized here too
        self.format = device_pool.format
        self.num_layers = device_pool.num_layers
        self.kv_heads = device_pool.kv_heads
        self.head_dim = device_pool.head_dim
        # Pinned only when there is a device to DMA to; pinning needs a CUDA runtime.
        self.pinned = device_pool.device.type == "cuda"
        shape = (size + self.page_size, self.kv_heads, device_pool.row_width)
        self.k_buffer = [self._buffer(shape) for _ in range(self.num_layers)]
        self.v_buffer = [self._buffer(shape) for _ in range(self.num_layers)]
        self.allocator = BaseTokenToKVPoolAllocator(size, self.page_size, "cpu")
        logger.info(
            "host KV pool: %d tokens (%.3f GiB%s)",
            size,
            size * self.bytes_per_token() / GIB,
            ", pinned" if self.pinned else "",
        )

    def _buffer(self, shape: tuple[int, int, int]) -> torch.Tensor:
        return torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=self.pinned)

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.format)  # the device layout
