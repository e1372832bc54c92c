"""The scheduler's side of the hybrid sliding-window memory (models with windowed layers).

When the model runner keeps the windowed layers' KV in a pool of their own
(``memory.swa_kv_pool.SWAKVPool``), the scheduler hands out full and SWA slots together
(``SWATokenToKVPoolAllocator``), uses the SWA variants of the prefix caches, and after each
step gives back the SWA slots of tokens that slid out of their request's window
(``after_step``). Otherwise everything here falls through to the plain allocator.

Overlap scheduling: ``after_step`` runs when step N's results are processed, possibly while
step N+1 runs. Step N+1's queries sit at positions ``kv_committed_len`` (as updated by step
N) or later, so freeing the positions before ``kv_committed_len - W + 1`` never takes a key
that a launched step still reads.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from memory.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from memory.prefix_cache import BasePrefixCache
from memory.swa_allocator import SWATokenToKVPoolAllocator
from memory.swa_chunk_cache import SWAChunkCache
from memory.swa_kv_pool import SWAKVPool
from memory.swa_radix_cache import SWARadixCache
from runtime.args import ServerArgs

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


def create_tree_cache(args: ServerArgs, runner: Any, allocator: Any,
                      kv_events: bool) -> tuple[BasePrefixCache, None] | None:
    """The SWA prefix cache for a hybrid allocator (no host tier); None for any other allocator."""
    if not isinstance(allocator, SWATokenToKVPoolAllocator):
        return None
    window = runner.model_config.sliding_window
    if args.disable_radix_cache:
        return SWAChunkCache(runner.req_to_token_pool, allocator, window), None
    if args.enable_hierarchical_cache:
        logger.warning("the hierarchical cache does not cover sliding-window pools: serving without the host tier")
    return SWARadixCache(runner.req_to_token_pool, allocator, window, eviction_policy=args.radix_eviction_policy,
                         enable_kv_events=kv_events), None


def after_step(tree_cache: BasePrefixCache, reqs: Sequence[Any]) -> None:
    """Free the SWA slots of the step's requests' tokens that left their window (hybrid caches only)."""
    free = getattr(tree_cache, "free_out_of_window", None)
    if free is None:
        return
    for req in reqs:
        if req.req_pool_idx is not None:
            free(req, req.kv_committed_len)


def swa_info(allocator: Any, tree_cache: Any) -> dict[str, Any]:
    """Both pools' numbers for server_info (empty for a model without a separate SWA pool)."""
    if not isinstance(allocator, SWATokenToKVPoolAllocator):
        return {}
    return {
        "swa_hybrid_memory": True,
        "full_available_tokens": allocator.full_available_size(),
        "swa_max_total_tokens": allocator.swa_size,
        "swa_available_tokens": allocator.swa_available_size(),
        "swa_evictable_tokens": tree_cache.swa_evictable_size(),
        "swa_protected_tokens": tree_cache.swa_protected_size(),
    }
