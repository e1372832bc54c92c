"""SWARadixCache: ``RadixCache`` for a model with sliding-window layers (full + SWA pools).

Every token the tree holds keeps both its full slot and its SWA slot, so any prefix the
tree matches can be extended: the windowed layers of the next token find the last W
tokens of the prefix in the SWA pool. Eviction frees both halves together.

A running request gives back the SWA slots of its *own* tokens (those past the prefix it
shares with the tree) once they slide out of its window (``free_out_of_window``). Such a
request's tokens then miss their SWA half, so when it finishes (or is retracted) none of
them is inserted: it is released as by ``release_req``. What it shared from the tree stays
cached. (SGLang goes further: its tree keeps prefixes whose SWA part was freed as
tombstones that still match where the window allows; not done here.)
"""

from __future__ import annotations

from typing import Literal

from memory.radix_cache import RadixCache
from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator, free_out_of_window


class SWARadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: SWATokenToKVPoolAllocator,
        window: int,
        eviction_policy: Literal["lru", "lfu"] = "lru",
        enable_kv_events: bool = False,
    ) -> None:
        super().__init__(req_to_token_pool, allocator, 1, eviction_policy=eviction_policy,  # type: ignore[arg-type]
                         enable_kv_events=enable_kv_events)
        self.swa_allocator = allocator
        self.window = window

    def free_out_of_window(self, req: CacheRequest, kv_len: int) -> int:
        """Free the SWA slots of ``req``'s own tokens before ``kv_len - W + 1`` (see ``swa_allocator``)."""
        return free_out_of_window(self.swa_allocator, self.req_to_token_pool.req_to_token, req, kv_len, self.window,
                                  self._held_len(req))

    def cache_finished_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        if req.req_pool_idx is not None and getattr(req, "swa_evicted_len", 0) > self._held_len(req):
            self.release_req(req, kv_len)  # some own tokens lost their SWA slots: nothing to insert
            return
        super().cache_finished_req(req, kv_len)
        req.swa_evicted_len = 0  # type: ignore[attr-defined]

    def release_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        super().release_req(req, kv_len)
        req.swa_evicted_len = 0  # type: ignore[attr-defined]

    def swa_evictable_size(self) -> int:
        return self.evictable_size()  # every cached token keeps its SWA slot

    def swa_protected_size(self) -> int:
        return self.protected_size()
