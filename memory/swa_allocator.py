"""SWATokenToKVPoolAllocator: full slots and the SWA slots mapped to them, handed out together.

A token of a model with windowed layers needs a *full* slot (its identity, and its K/V in
the full-attention layers) and, while some window may still see it, an *SWA* slot (its K/V
in the windowed layers). ``alloc`` takes one of each per token and records the pair in the
pool's ``full_to_swa`` map; ``free`` gives both back; ``free_swa`` gives back only the SWA
half of tokens that slid out of every window (the full slot stays with its owner, which may
still attend to it in the full-attention layers or cache it as a prefix).

Ownership: as for ``BaseTokenToKVPoolAllocator``, the free slots of both pools are owned
here; a handed-out pair belongs to the request (or the prefix cache) that holds the full
slot. ``available_size`` is what both pools can give (the smaller of the two): a token
cannot be stored without both halves.
Token-granular only (page_size 1).
"""

from __future__ import annotations

import torch

from memory.allocator import AllocatorState, FreeGroup, TokenToKVPoolAllocator
from memory.req_state import CacheHandle


class SWATokenToKVPoolAllocator(FreeGroup):
    """Same interface as ``BaseTokenToKVPoolAllocator`` (page_size 1), plus the SWA half's own calls.
    (Not a subclass of it: none of its page bookkeeping applies; the free groups are shared.)"""

    def __init__(
        self, full_size: int, swa_size: int, full_to_swa: torch.Tensor, device: str | torch.device, debug: bool = False
    ) -> None:
        self.full = TokenToKVPoolAllocator(full_size, device, debug=debug)
        self.swa = TokenToKVPoolAllocator(swa_size, device, debug=debug)
        if full_to_swa.numel() < full_size + 1:
            raise ValueError(f"full_to_swa has {full_to_swa.numel()} entries for {full_size} full slots")
        self.full_to_swa = full_to_swa  # the pool's map, written only here
        # Every slot starts free, so no pair exists yet: a map left by an earlier allocator over the
        # same pool (a second scheduler on one model runner) would otherwise pair free slots.
        self.full_to_swa.zero_()
        self.page_size = 1
        self.size = self.full.size
        self.swa_size = self.swa.size
        self.num_pages = self.full.num_pages
        self.device = self.full.device
        self.debug = debug
        self._in_free_group = False
        self._free_group: list[torch.Tensor] = []

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self.full_to_swa.zero_()
        self._in_free_group = False
        self._free_group = []

    def available_size(self) -> int:
        """Tokens that can be stored now: each needs a full and an SWA slot."""
        return min(self.full.available_size(), self.swa.available_size())

    def full_available_size(self) -> int:
        return self.full.available_size()

    def swa_available_size(self) -> int:
        return self.swa.available_size()

    def backup_state(self) -> tuple[AllocatorState, AllocatorState, torch.Tensor]:
        return self.full.backup_state(), self.swa.backup_state(), self.full_to_swa.clone()

    def restore_state(self, state: tuple[AllocatorState, AllocatorState, torch.Tensor]) -> None:
        full, swa, mapping = state
        self.full.restore_state(full)
        self.swa.restore_state(swa)
        self.full_to_swa.copy_(mapping)

    def free_slot_mask(self) -> torch.Tensor:
        """Free full slots (bool over ``0 .. size``)."""
        return self.full.free_slot_mask()

    def swa_free_slot_mask(self) -> torch.Tensor:
        return self.swa.free_slot_mask()

    def free_page_count_with_duplicates(self) -> int:
        return self.full.free_page_count_with_duplicates()

    def swa_free_count_with_duplicates(self) -> int:
        return self.swa.free_page_count_with_duplicates()

    # ------------------------------------------------------------- allocation
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` full slots, each mapped to a fresh SWA slot; None (nothing taken) when either is short."""
        if need_size < 0:
            raise ValueError(f"alloc({need_size}) must be non-negative")
        if need_size > self.available_size():
            return None
        full = self.full.alloc(need_size)
        swa = self.swa.alloc(need_size)
        assert full is not None and swa is not None, "available_size promised both"
        self.full_to_swa[full] = swa
        return full

    def alloc_extend(
        self, prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int
    ) -> torch.Tensor | None:
        return self.alloc(extend_num_tokens)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        return self.alloc(int(seq_lens.numel()))

    # ------------------------------------------------------------------- free
    def free(self, free_index: torch.Tensor) -> None:
        """Give full slots back, with whatever SWA slots they still have."""
        if self._defer_free(free_index):
            return
        full = free_index.to(device=self.device, dtype=torch.int64)
        self.free_swa(full)
        self.full.free(full)

    def free_swa(self, full_slots: torch.Tensor) -> int:
        """Give back the SWA slots of tokens no window sees any more; returns how many were freed.

        Tokens that already lost theirs are skipped, so a range may be passed more than once."""
        if full_slots.numel() == 0:
            return 0
        full = full_slots.to(device=self.device, dtype=torch.int64)
        swa = self.full_to_swa[full]
        held = swa > 0
        swa = swa[held]
        if swa.numel():
            self.swa.free(swa)
            self.full_to_swa[full[held]] = 0
        return int(swa.numel())


def free_own_out_of_window(
    allocator: SWATokenToKVPoolAllocator,
    req_to_token: torch.Tensor,
    handle: CacheHandle,
    kv_len: int,
    window: int,
    own_start: int,
) -> int:
    """Give back the SWA slots of a request's own tokens that no later query of it can see.

    The request's next query sits at position ``kv_len`` or later and sees keys from
    ``kv_len - window + 1`` on, so every position before that is done with in the windowed
    layers. Only the request's own tokens (from ``own_start``: a prefix cache's shared part
    is freed by the cache, not by one of its readers) are touched; ``handle.swa_evicted_len``
    records how far this went. The SWA caches' ``free_out_of_window`` is the only caller (the
    handle is theirs to write). Returns the number of SWA slots freed.
    """
    start = max(handle.swa_evicted_len, own_start)
    end = kv_len - window + 1
    if handle.req_pool_idx is None or end <= start:
        return 0
    freed = allocator.free_swa(req_to_token[handle.req_pool_idx, start:end])
    handle.swa_evicted_len = end
    return freed
