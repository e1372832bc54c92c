"""Which KV-slot allocator and which prefix cache a scheduler gets: the one place that decides.

The flags and the model runner's pool pick them together:

- an ``SWAKVPool`` (a model with sliding-window layers) gets the hybrid
  ``SWATokenToKVPoolAllocator`` and the SWA variant of the cache (``SWAChunkCache`` with
  ``--disable-radix-cache``, else ``SWARadixCache``; the host tier does not cover it);
- any other pool gets the plain allocator for its page size and ``ChunkCache``
  (``--disable-radix-cache``), ``RadixCache``, or, with ``--enable-hierarchical-cache``,
  ``HiRadixCache`` plus the ``HostTier`` the scheduler drives it through.

The scheduler owns what is returned (the allocator hands out its KV slots, the cache owns
its cached prefixes); the model runner keeps owning the pools themselves.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, cast

from memory.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from memory.chunk_cache import ChunkCache
from memory.hiradix_cache import HiRadixCache
from memory.host_pool import HostKVPool, host_pool_tokens
from memory.kv_transfer import make_kv_transfer
from memory.prefix_cache import BasePrefixCache
from memory.radix_cache import RadixCache
from memory.swa_allocator import SWATokenToKVPoolAllocator
from memory.swa_chunk_cache import SWAChunkCache
from memory.swa_kv_pool import SWAKVPool
from memory.swa_radix_cache import SWARadixCache
from runtime.config.args import ServerArgs
from scheduler_proc.hicache import HostTier

logger = logging.getLogger(__name__)

Allocator = TokenToKVPoolAllocator | PagedTokenToKVPoolAllocator | SWATokenToKVPoolAllocator


def create_allocator(runner: Any, page_size: int) -> Allocator:
    """The KV-slot allocator for the runner's pool: hybrid for an ``SWAKVPool``, else by page size."""
    pool = getattr(runner, "token_to_kv_pool", None)
    if isinstance(pool, SWAKVPool):
        return SWATokenToKVPoolAllocator(pool.size, pool.swa_size, pool.full_to_swa, runner.device)
    if page_size == 1:
        return TokenToKVPoolAllocator(runner.max_total_tokens, runner.device)
    return PagedTokenToKVPoolAllocator(runner.max_total_tokens, page_size, runner.device)


def create_tree_cache(
    args: ServerArgs, runner: Any, allocator: Allocator, kv_events: bool
) -> tuple[BasePrefixCache, HostTier | None]:
    """The prefix cache the flags and the allocator ask for, and its host tier (hierarchical cache only)."""
    pool, page = runner.req_to_token_pool, args.page_size
    # (ServerArgs restricts the flag to these choices; the caches check it again)
    eviction = cast(Literal["lru", "lfu"], args.radix_eviction_policy)
    if isinstance(allocator, SWATokenToKVPoolAllocator):
        window = runner.model_config.sliding_window
        if args.disable_radix_cache:
            return SWAChunkCache(pool, allocator, window), None
        if args.enable_hierarchical_cache:
            logger.warning("the hierarchical cache does not cover sliding-window pools: serving without the host tier")
        return SWARadixCache(pool, allocator, window, eviction_policy=eviction, enable_kv_events=kv_events), None
    if args.disable_radix_cache:
        return ChunkCache(pool, allocator, page), None
    if not args.enable_hierarchical_cache:
        return RadixCache(pool, allocator, page, eviction_policy=eviction, enable_kv_events=kv_events), None
    device_pool = runner.token_to_kv_pool
    tokens = host_pool_tokens(
        allocator.size, device_pool.bytes_per_token(), page, args.hicache_ratio, args.hicache_size
    )
    if tokens < allocator.size:
        logger.warning(
            "the host tier (%d tokens) is smaller than the KV pool (%d): write-through copies "
            "of what the pool holds may not fit",
            tokens,
            allocator.size,
        )
    host_pool = HostKVPool(device_pool, tokens)
    cache = HiRadixCache(
        pool,
        allocator,
        host_pool,
        make_kv_transfer(device_pool, host_pool),
        page,
        eviction_policy=eviction,
        write_policy=args.hicache_write_policy,
        enable_kv_events=kv_events,
    )
    return cache, HostTier(cache)
