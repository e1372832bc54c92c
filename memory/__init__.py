"""Memory subsystem: request rows, the KV pool, slot allocators and the prefix caches.

Ownership in one line each (details in each module):
- ReqToTokenPool rows: allocated by the scheduler, freed by ``cache_finished_req`` /
  ``release_req`` of the prefix cache.
- KV slots: free -> allocator; cached -> RadixCache (until evicted); otherwise -> the
  running request whose row holds them.
"""

from memory.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from memory.chunk_cache import ChunkCache
from memory.invariant import InvariantReport, check_memory_invariant
from memory.kv_pool import MHATokenToKVPool
from memory.prefix_cache import BasePrefixCache, HitStats, KVCacheEvent, MatchResult, request_kv_len
from memory.radix_cache import RadixCache, TreeNode
from memory.req_state import CacheRequest, SimpleCacheRequest
from memory.req_to_token_pool import ReqToTokenPool

__all__ = [
    "BasePrefixCache",
    "BaseTokenToKVPoolAllocator",
    "CacheRequest",
    "ChunkCache",
    "HitStats",
    "InvariantReport",
    "KVCacheEvent",
    "MHATokenToKVPool",
    "MatchResult",
    "PagedTokenToKVPoolAllocator",
    "RadixCache",
    "ReqToTokenPool",
    "SimpleCacheRequest",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "check_memory_invariant",
    "request_kv_len",
]
