"""SWAChunkCache: ``ChunkCache`` (no prefix sharing) for a model with sliding-window layers.

Every KV slot belongs to the request that allocated it, so the request can give back the
SWA half of every token that slid out of the window as it goes, during chunked prefill
as well as decode (``free_out_of_window``): its SWA usage stays near W tokens however long
it runs. At the end, ``release_req`` frees the full slots with whatever SWA slots remain.
"""

from __future__ import annotations

from memory.chunk_cache import ChunkCache
from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator, free_own_out_of_window


class SWAChunkCache(ChunkCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SWATokenToKVPoolAllocator, window: int) -> None:
        super().__init__(req_to_token_pool, allocator, page_size=1)
        self.swa_allocator = allocator
        self.window = window

    def free_out_of_window(self, req: CacheRequest, kv_len: int) -> int:
        """Free the SWA slots of ``req``'s tokens before ``kv_len - W + 1`` (see ``swa_allocator``)."""
        return free_own_out_of_window(
            self.swa_allocator, self.req_to_token_pool.req_to_token, req.cache_handle, kv_len, self.window, 0
        )

    def release_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        super().release_req(req, kv_len)
        req.cache_handle.swa_evicted_len = 0  # a later row starts with every SWA slot

    def swa_evictable_size(self) -> int:
        return 0

    def swa_protected_size(self) -> int:
        return 0
