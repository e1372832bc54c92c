"""The scheduler's side of the hybrid sliding-window memory (models with windowed layers).

When the model runner keeps the windowed layers' KV in a pool of their own
(``memory.swa_kv_pool.SWAKVPool``), the scheduler hands out full and SWA slots together
(``SWATokenToKVPoolAllocator``) and uses the SWA variants of the prefix caches (both chosen
by :mod:`scheduler_proc.memory_setup`). This module, after each step, gives back the SWA
slots of tokens that slid out of their request's window (``after_step``), and adds both
pools' numbers to server_info. For any other allocator both do nothing.

Overlap scheduling: ``after_step`` runs when step N's results are processed, possibly while
step N+1 runs. Step N+1's queries sit at positions ``kv_committed_len`` (as updated by step
N) or later, so freeing the positions before ``kv_committed_len - W + 1`` never takes a key
that a launched step still reads.
"""

from __future__ import annotations

from typing import Any, Sequence

from memory.prefix_cache import BasePrefixCache
from memory.swa_allocator import SWATokenToKVPoolAllocator
from memory.swa_chunk_cache import SWAChunkCache
from memory.swa_radix_cache import SWARadixCache
from scheduler_proc.req import Req


def after_step(tree_cache: BasePrefixCache, reqs: Sequence[Req]) -> None:
    """Free the SWA slots of the step's requests' tokens that left their window (hybrid caches only)."""
    if not isinstance(tree_cache, (SWAChunkCache, SWARadixCache)):
        return
    for req in reqs:
        if req.cache_handle.req_pool_idx is not None:
            tree_cache.free_out_of_window(req, req.kv_committed_len)


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
