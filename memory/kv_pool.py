"""MHATokenToKVPool: the per-layer K and V tensors that every token's KV lives in.

Owner: the ModelRunner creates it; the allocator hands out slot indices into it;
attention backends write new K/V at ``out_cache_loc`` and read through
``req_to_token``. Slot 0 is a padding slot that is never handed out, so padded
positions in kernels can point at it harmlessly.
"""

from __future__ import annotations

import torch


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's K and V over every layer (the device pool's and the host tier's layout)."""
    return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class MHATokenToKVPool:
    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        device: str | torch.device,
    ) -> None:
        if size <= 0 or page_size <= 0:
            raise ValueError(f"MHATokenToKVPool needs size > 0 and page_size > 0, got {size}, {page_size}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        shape = (size + page_size, kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` of shape ``[len(loc), kv_heads, head_dim]`` at slots ``loc``."""
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def copy_slots(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """Copy every layer's KV from ``src_loc`` to ``dst_loc`` (copy-on-write of a shared partial page)."""
        for k, v in zip(self.k_buffer, self.v_buffer):
            k[dst_loc] = k[src_loc]
            v[dst_loc] = v[src_loc]

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.kv_heads, self.head_dim, self.dtype)
