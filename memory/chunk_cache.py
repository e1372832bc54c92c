"""ChunkCache: the prefix-cache interface without any sharing (``--disable-radix-cache``).

Ownership: the cache owns nothing. A request owns all of its KV slots from
allocation until ``cache_finished_req``/``release_req``, which free them together with
the request's ReqToTokenPool row. Chunked prefill still works: between chunks the
request's own slots serve as its "prefix".
"""

from __future__ import annotations

from typing import Any

import torch

from memory.allocator import SlotAllocator
from memory.prefix_cache import BasePrefixCache, HitStats, KVCacheEvent, MatchResult, request_kv_len
from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: SlotAllocator, page_size: int = 1) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"ChunkCache page_size {page_size} != allocator page_size {allocator.page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.device = allocator.device
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._lookups = 0
        self._lookup_tokens = 0

    def match_prefix(self, key: list[int], extra_key: str | None = None, count_hit: bool = True) -> MatchResult:
        if count_hit:
            self._lookups += 1
            self._lookup_tokens += len(key)
        return MatchResult(self._empty, None)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        return 0

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        # The request keeps its own slots; they are its prefix for the next chunk.
        req.cache_handle.prefix_indices = self._row(req, len(req.fill_ids))

    def cache_finished_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        self.release_req(req, kv_len)

    def release_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        handle = req.cache_handle
        if handle.req_pool_idx is not None:
            kv_len = request_kv_len(req) if kv_len is None else kv_len
            self.allocator.free(self._row(req, kv_len))
            self._free_row(req)
        handle.last_node = None
        handle.prefix_indices = self._empty

    def inc_lock_ref(self, node: Any) -> int:
        return 0

    def dec_lock_ref(self, node: Any) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def cached_slots(self) -> torch.Tensor:
        return self._empty

    def reset(self) -> None:
        self._lookups = 0
        self._lookup_tokens = 0

    def hit_stats(self) -> HitStats:
        return HitStats(self._lookups, self._lookup_tokens, 0)

    def take_events(self) -> list[KVCacheEvent]:
        return []
