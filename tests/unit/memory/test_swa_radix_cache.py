"""SWARadixCache without a model: which SWA halves a request's walk may take from the tree.

A small driver plays the scheduler's part for one request at a time (match, lock, row,
prefill in chunks with ``cache_unfinished_req`` and ``free_out_of_window`` after each, decode,
``cache_finished_req``) and checks both pools' invariant after every step. Window W = 16.
"""

from __future__ import annotations

import pytest
import torch

from memory.invariant import check_memory_invariant
from memory.req_state import SimpleCacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator
from memory.swa_radix_cache import SWARadixCache

WINDOW = 16
SIZE = 1024


def _cache() -> SWARadixCache:
    alloc = SWATokenToKVPoolAllocator(SIZE, SIZE, torch.zeros(SIZE + 1, dtype=torch.int64), "cpu", debug=True)
    return SWARadixCache(ReqToTokenPool(4, 512, "cpu"), alloc, WINDOW)


def _check(cache: SWARadixCache, active: dict[int, int] | None = None) -> None:
    report = check_memory_invariant(
        cache.swa_allocator,
        cache,
        cache.req_to_token_pool,
        cache.swa_allocator.size,
        idle=active is None,
        active_rows=active,
    )
    assert report.ok, report.message


def _serve(cache: SWARadixCache, prompt: list[int], outputs: list[int], chunk: int | None) -> int:
    """One request from match to finish; returns its cached (matched) tokens."""
    alloc, pool = cache.swa_allocator, cache.req_to_token_pool
    req = SimpleCacheRequest(list(prompt))
    cache.match_request(req, req.origin_input_ids)
    cached = int(req.cache_handle.prefix_indices.numel())
    cache.inc_lock_ref(req.cache_handle.last_node)
    assert cache.attach_rows([req])
    row = req.cache_handle.req_pool_idx
    assert row is not None
    pos = cached
    while pos < len(prompt):  # prefill, chunk by chunk
        end = min(len(prompt), pos + (chunk or len(prompt)))
        slots = alloc.alloc(end - pos)
        assert slots is not None
        pool.write(row, pos, slots.to(torch.int32))
        req.fill_ids = list(prompt[:end])
        cache.cache_unfinished_req(req)
        cache.free_out_of_window(req, end)
        _check(cache, {row: end})
        pos = end
    kv = len(prompt)
    for token in outputs:  # each decode step stores the KV of the token sampled before it
        req.output_ids.append(token)
        if len(req.output_ids) == 1:
            continue
        slot = alloc.alloc(1)
        assert slot is not None
        pool.write(row, kv, slot.to(torch.int32))
        kv += 1
        cache.free_out_of_window(req, kv)
        _check(cache, {row: kv})
    cache.cache_finished_req(req, kv)
    _check(cache)
    return cached


@pytest.mark.parametrize("chunk", [None, 8, 5], ids=["whole", "chunk8", "chunk5"])
def test_a_reused_prefix_stays_matchable_for_every_next_request(chunk: int | None) -> None:
    cache = _cache()
    prefix = list(range(1, 43))  # 42 tokens: more than two windows
    assert _serve(cache, prefix, [500, 501, 502, 503], chunk) == 0
    for i in range(5):
        suffix = [1000 + 100 * i + j for j in range(20)]
        assert _serve(cache, prefix + suffix, [2000 + i, 2100 + i, 2200 + i, 2300 + i], chunk) == 42, i
    # Bounded: the tree keeps live only windows before protected ends (the prefix's, each
    # sequence's last) plus the requests' last decode tokens, not the suffixes' early chunks.
    live = cache.swa_evictable_size()
    assert live <= (WINDOW - 1) + 6 * (WINDOW - 1 + 3), live
    assert live < cache.total_size() - 42
    cache.evict(cache.total_size())
    assert cache.total_size() == 0
    assert cache.swa_allocator.full_available_size() == cache.swa_allocator.swa_available_size() == SIZE
    _check(cache)


@pytest.mark.parametrize("chunk", [None, 8], ids=["whole", "chunk8"])
def test_a_branch_off_a_cached_sequence_keeps_its_end_window(chunk: int | None) -> None:
    """A cached sequence whose last window reaches above a branch point: a request that branches
    there (its match backed off, so it reuses nothing) must leave that window live."""
    cache = _cache()
    history = list(range(1, 43))
    _serve(cache, history, [500, 501, 502, 503], chunk)  # cached: history + 3 outputs with KV
    _serve(cache, history[:40] + list(range(900, 920)), [600, 601], chunk)
    assert _serve(cache, history + [500, 501, 502, 700], [800], chunk) == 45


def test_evict_makes_room_in_both_pools() -> None:
    """Cached sequences keep only their last window's SWA half: evicting n tokens from the oldest
    one frees n full slots but fewer SWA ones, so eviction goes on until both pools gained n."""
    alloc = SWATokenToKVPoolAllocator(256, 64, torch.zeros(257, dtype=torch.int64), "cpu", debug=True)
    cache = SWARadixCache(ReqToTokenPool(4, 512, "cpu"), alloc, WINDOW)
    _serve(cache, list(range(1, 41)), [500, 501], chunk=8)
    _serve(cache, list(range(101, 141)), [600, 601], chunk=8)
    before = alloc.available_size()
    assert before == alloc.swa_available_size() < alloc.full_available_size()  # the SWA pool is the short one
    cache.evict(20)
    assert alloc.available_size() >= before + 20
    _check(cache)
