"""Memory subsystem: request rows, the KV pool, slot allocators and the prefix caches.

Ownership in one line each (details in each module):
- ReqToTokenPool rows: handed out by the prefix cache's ``attach_rows`` (when the
  scheduler's batch builder carries out a first prefill), freed by its
  ``cache_finished_req`` / ``release_req``.
- KV slots: free -> allocator; cached -> RadixCache (until evicted); otherwise -> the
  running request whose row holds them.
- A request's cache state (row, prefix, lock node, host hit, SWA bookkeeping): its
  ``CacheHandle``, written only by the prefix cache's methods.
"""

from memory.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from memory.chunk_cache import ChunkCache
from memory.invariant import InvariantReport, check_memory_invariant
from memory.kv_pool import MHATokenToKVPool
from memory.prefix_cache import BasePrefixCache, HitStats, KVCacheEvent, MatchResult, request_kv_len
from memory.radix_cache import RadixCache
from memory.req_state import CacheHandle, CacheRequest, SimpleCacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.tree_node import TreeNode

__all__ = [
    "BasePrefixCache",
    "BaseTokenToKVPoolAllocator",
    "CacheHandle",
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
