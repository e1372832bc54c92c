"""SWAKVPool: the KV pool of a model whose windowed layers keep only their last W tokens.

Two pools in one object. Full-attention layers keep K/V for every token in a pool of
``full_size`` slots, indexed by the slots ``req_to_token`` holds (the *full* slots, the
tokens' identity everywhere in the scheduler and the caches). Windowed layers keep K/V in
a pool of ``swa_size`` slots: a token has an SWA slot only while some window may still see
it. ``full_to_swa[full_slot]`` is that slot (0, the SWA pool's padding slot, when it has
none); the SWA allocator (``memory.swa_allocator``) writes it when it hands slots out and
clears it when it frees them.

Attention backends do not ask which pool a layer uses: they read ``get_kv_buffer(layer)``
and, for a windowed layer, translate the full slots they hold with ``translate_swa`` (the
K/V store and the windowed plans do). Slot 0 of each pool is padding, never handed out.
"""

from __future__ import annotations

import torch

from memory.kv_format import KVCacheFormat
from memory.kv_pool import MHATokenToKVPool


class SWAKVPool(MHATokenToKVPool):
    """Per-layer K/V buffers: full layers ``[full_size + page, Hkv, D]``, windowed ``[swa_size + page, Hkv, D]``.

    ``get_kv_buffer``/``set_kv_buffer``/``kv_rows`` are the plain pool's: a layer's own buffers, at the slots
    the caller passes (SWA slots for a windowed layer)."""

    def __init__(
        self,
        full_size: int,
        swa_size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_windows: tuple[int | None, ...],
        kv_heads: int,
        head_dim: int,
        device: str | torch.device,
        kv_format: KVCacheFormat | None = None,
    ) -> None:  # (its own layout: the plain pool's constructor is not called)
        if full_size <= 0 or swa_size <= 0:
            raise ValueError(f"SWAKVPool needs full_size > 0 and swa_size > 0, got {full_size}, {swa_size}")
        if page_size != 1:
            raise ValueError("the sliding-window KV pool is token-granular (page_size 1)")
        self.size = full_size  # the slots req_to_token refers to
        self.swa_size = swa_size
        self.page_size = page_size
        self._init_format(dtype, kv_format, len(layer_windows), kv_heads, head_dim)
        self.layer_windows = tuple(layer_windows)
        self.windowed = [w is not None for w in layer_windows]
        self.device = torch.device(device)
        self.k_buffer: list[torch.Tensor] = []
        self.v_buffer: list[torch.Tensor] = []
        for windowed in self.windowed:
            rows = (swa_size if windowed else full_size) + page_size
            self.k_buffer.append(torch.zeros((rows, kv_heads, self.row_width), dtype=self.dtype, device=self.device))
            self.v_buffer.append(torch.zeros((rows, kv_heads, self.row_width), dtype=self.dtype, device=self.device))
        # Owned here, written by the SWA allocator only.
        self.full_to_swa = torch.zeros(full_size + page_size, dtype=torch.int64, device=self.device)

    def translate_swa(self, loc: torch.Tensor) -> torch.Tensor:
        """The SWA slots of full slots ``loc`` (any shape; 0 where a token has none), in loc's dtype."""
        return self.full_to_swa[loc.to(torch.int64)].to(loc.dtype)

    def copy_slots(self, src_loc: torch.Tensor, dst_loc: torch.Tensor) -> None:
        """Copy every layer's KV from full slots ``src_loc`` to ``dst_loc`` (windowed layers: their SWA slots)."""
        src_swa, dst_swa = self.translate_swa(src_loc), self.translate_swa(dst_loc)
        for windowed, k, v in zip(self.windowed, self.k_buffer, self.v_buffer):
            src, dst = (src_swa, dst_swa) if windowed else (src_loc, dst_loc)
            k[dst] = k[src]
            v[dst] = v[src]

    def layer_bytes_per_token(self) -> int:
        return 2 * self.kv_heads * self.format.head_bytes(self.head_dim)

    def bytes_per_token(self) -> int:
        """Bytes of one full slot plus its share of the SWA pool (``swa_size / full_size`` of a slot)."""
        full_layers = self.windowed.count(False)
        swa_layers = self.num_layers - full_layers
        per_layer = self.layer_bytes_per_token()
        return int(per_layer * (full_layers + swa_layers * self.swa_size / self.size))

    def total_bytes(self) -> int:
        return sum(k.numel() * k.element_size() * 2 for k in self.k_buffer)


def swa_pool_sizes(
    budget_tokens_full_attention: int, ratio: float, full_layers: int, swa_layers: int
) -> tuple[int, int]:
    """``(full_size, swa_size)`` with ``swa_size = ratio * full_size`` in the memory that a full-attention
    pool of ``budget_tokens_full_attention`` tokens would take (every layer counted once per token)."""
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {ratio}")
    layers = full_layers + swa_layers
    full = int(budget_tokens_full_attention * layers / (full_layers + ratio * swa_layers))
    return full, max(1, int(full * ratio))
