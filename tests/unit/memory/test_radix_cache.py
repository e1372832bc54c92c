"""RadixCache as a data structure: match/insert/split, extra_key, locks, eviction order, pages, events."""

from __future__ import annotations

import pytest
import torch

from memory.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from memory.prefix_cache import KVCacheEvent
from memory.radix_cache import RadixCache
from memory.req_to_token_pool import ReqToTokenPool


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_cache(size: int = 64, page_size: int = 1, **kwargs: object) -> RadixCache:
    pool = ReqToTokenPool(4, 64, "cpu")
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(size, "cpu", debug=True)
    else:
        alloc = PagedTokenToKVPoolAllocator(size, page_size, "cpu", debug=True)
    return RadixCache(pool, alloc, page_size=page_size, **kwargs)  # type: ignore[arg-type]


def insert_allocated(cache: RadixCache, key: list[int], extra_key: str | None = None) -> list[int]:
    """Insert ``key`` with freshly allocated slots (so eviction can free them); return the slots."""
    slots = cache.allocator.alloc(len(key))
    assert slots is not None
    assert cache.insert(key, slots, extra_key) == 0
    return slots.tolist()


def free_set(cache: RadixCache) -> set[int]:
    return set(cache.allocator.free_slot_mask().nonzero().flatten().tolist())


def test_insert_and_match_exact_values() -> None:
    cache = make_cache()
    assert cache.insert([1, 2, 3], t([10, 20, 30])) == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.device_indices.tolist() == [10, 20, 30]
    assert m.device_indices.dtype == torch.int64
    assert cache.match_prefix([1, 2]).device_indices.tolist() == [10, 20]
    assert cache.match_prefix([2, 3]).device_indices.tolist() == []
    assert cache.insert([1, 2, 3], t([11, 21, 31])) == 3
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == [10, 20, 30]
    assert cache.total_size() == 3 and cache.evictable_size() == 3 and cache.protected_size() == 0


def test_split_on_insert_and_on_match() -> None:
    cache = make_cache()
    assert cache.insert(list(range(1, 9)), t(list(range(101, 109)))) == 0
    assert cache.insert([1, 2, 9, 10], t([201, 202, 209, 210])) == 2
    assert cache.total_size() == 10 and cache.evictable_size() == 10
    m = cache.match_prefix([1, 2, 3, 4, 999])
    assert m.device_indices.tolist() == [101, 102, 103, 104]
    assert m.last_node.key == [3, 4]  # the node [3..8] was split at the match point
    assert cache.total_size() == 10 and cache.evictable_size() == 10
    assert cache.match_prefix([1, 2, 9, 10]).device_indices.tolist() == [101, 102, 209, 210]
    assert cache.match_prefix(list(range(1, 9))).device_indices.tolist() == list(range(101, 109))


def test_insert_rejects_mismatched_lengths() -> None:
    cache = make_cache()
    with pytest.raises(ValueError):
        cache.insert([1, 2], t([5]))


def test_extra_key_isolation() -> None:
    cache = make_cache()
    assert cache.insert([1, 2, 3], t([10, 20, 30])) == 0
    assert cache.insert([1, 2, 3], t([40, 50, 60]), extra_key="lora-a") == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == [10, 20, 30]
    assert cache.match_prefix([1, 2, 3], extra_key="lora-a").device_indices.tolist() == [40, 50, 60]
    assert cache.match_prefix([1, 2, 3], extra_key="lora-b").device_indices.tolist() == []
    assert cache.insert([1, 2, 7], t([41, 51, 71]), extra_key="lora-a") == 2
    assert cache.match_prefix([1, 2, 7]).device_indices.tolist() == [10, 20]
    assert cache.total_size() == 7


def test_lock_moves_sizes_and_shared_prefix_needs_both_unlocks() -> None:
    cache = make_cache()
    s12_34 = insert_allocated(cache, [1, 2, 3, 4])
    s56 = cache.allocator.alloc(2).tolist()  # type: ignore[union-attr]
    assert cache.insert([1, 2, 5, 6], t(s12_34[:2] + s56)) == 2
    m1 = cache.match_prefix([1, 2, 3, 4])
    m2 = cache.match_prefix([1, 2, 5, 6])
    assert cache.inc_lock_ref(m1.last_node) == -4
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    assert cache.inc_lock_ref(m2.last_node) == -2
    assert (cache.evictable_size(), cache.protected_size()) == (0, 6)
    assert cache.evict(100) == 0
    assert cache.dec_lock_ref(m1.last_node) == 2  # [1,2] stays locked through m2
    assert (cache.evictable_size(), cache.protected_size()) == (2, 4)
    before = free_set(cache)
    assert cache.evict(100) == 2
    assert free_set(cache) - before == set(s12_34[2:])
    assert cache.match_prefix([1, 2, 5, 6]).device_indices.tolist() == s12_34[:2] + s56
    assert cache.dec_lock_ref(m2.last_node) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(m2.last_node)


def test_two_locks_on_same_node_release_at_zero() -> None:
    cache = make_cache()
    insert_allocated(cache, [1, 2, 3])
    node = cache.match_prefix([1, 2, 3]).last_node
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert cache.dec_lock_ref(node) == 0
    assert (cache.evictable_size(), cache.protected_size()) == (0, 3)
    assert cache.evict(3) == 0
    assert cache.dec_lock_ref(node) == 3
    assert cache.evict(3) == 3
    assert cache.total_size() == 0 and cache.allocator.available_size() == 64


def test_lru_evicts_least_recently_matched_leaf_first() -> None:
    cache = make_cache()
    a = insert_allocated(cache, [1, 2, 3])
    b = insert_allocated(cache, [4, 5, 6])
    c = insert_allocated(cache, [7, 8])
    cache.match_prefix([4, 5, 6])
    cache.match_prefix([1, 2, 3])
    before = free_set(cache)
    assert cache.evict(1) == 2
    assert free_set(cache) - before == set(c)
    assert cache.evict(1) == 3
    assert free_set(cache) - before == set(c) | set(b)
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == a
    assert cache.evictable_size() == 3


def test_parent_becomes_evictable_when_last_child_goes() -> None:
    cache = make_cache()
    base = insert_allocated(cache, [1, 2, 3])
    x = cache.allocator.alloc(1).tolist()  # type: ignore[union-attr]
    y = cache.allocator.alloc(1).tolist()  # type: ignore[union-attr]
    assert cache.insert([1, 2, 3, 4], t(base + x)) == 3
    assert cache.insert([1, 2, 3, 5], t(base + y)) == 3
    cache.match_prefix([1, 2, 3, 5])  # [4] is now the oldest leaf
    before = free_set(cache)
    assert cache.evict(1) == 1
    assert free_set(cache) - before == set(x)
    # Evicting [5] leaves [1,2,3] childless; it cascades in the same call.
    assert cache.evict(2) == 4
    assert free_set(cache) - before == set(x) | set(y) | set(base)
    assert cache.total_size() == 0 and cache.evictable_size() == 0


def test_evict_more_than_evictable_frees_only_unlocked() -> None:
    cache = make_cache(size=32)
    locked = insert_allocated(cache, [1, 2, 3, 4])
    free_a = insert_allocated(cache, [5, 6])
    free_b = insert_allocated(cache, [7])
    cache.inc_lock_ref(cache.match_prefix([1, 2, 3, 4]).last_node)
    before = free_set(cache)
    assert cache.evict(1000) == 3
    assert free_set(cache) - before == set(free_a) | set(free_b)
    assert cache.allocator.available_size() == 32 - 4
    assert cache.match_prefix([1, 2, 3, 4]).device_indices.tolist() == locked
    assert (cache.evictable_size(), cache.protected_size(), cache.total_size()) == (0, 4, 4)


@pytest.mark.parametrize("policy, first_victim", [("lru", "a"), ("lfu", "b")])
def test_lfu_evicts_least_hit_even_if_recent(policy: str, first_victim: str) -> None:
    cache = make_cache(eviction_policy=policy)
    slots = {"a": insert_allocated(cache, [1, 2]), "b": insert_allocated(cache, [3, 4])}
    for _ in range(3):
        cache.match_prefix([1, 2])
    cache.match_prefix([3, 4])  # b is the most recent but has fewer hits
    before = free_set(cache)
    assert cache.evict(1) == 2
    assert free_set(cache) - before == set(slots[first_victim])


def test_paged_matches_whole_pages_only() -> None:
    cache = make_cache(size=64, page_size=4)
    slots = cache.allocator.alloc(12)
    assert slots is not None
    key = list(range(1, 11))  # 10 tokens: only 8 (two pages) are cached
    assert cache.insert(key, slots[:10]) == 0
    assert cache.total_size() == 8
    assert cache.match_prefix(key).device_indices.tolist() == slots[:8].tolist()
    assert cache.match_prefix(list(range(1, 8))).device_indices.tolist() == slots[:4].tolist()
    short = cache.match_prefix([1, 2, 3])
    assert short.device_indices.tolist() == [] and short.last_node is cache.root
    # A difference inside the second page: only the first page matches, and insert splits there.
    other = cache.allocator.alloc(4)
    assert other is not None
    assert cache.insert([1, 2, 3, 4, 5, 6, 99, 100], torch.cat((slots[:4], other))) == 4
    m = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 99, 0])
    assert m.device_indices.tolist() == slots[:4].tolist()
    assert len(m.device_indices) % 4 == 0
    assert cache.total_size() == 12
    cache.allocator.free(slots[8:])
    assert cache.evict(100) == 12
    assert cache.allocator.available_size() == 64


def test_hit_stats() -> None:
    cache = make_cache()
    cache.insert([1, 2, 3], t([10, 20, 30]))
    cache.match_prefix([1, 2, 3, 9])
    cache.match_prefix([5])
    cache.match_prefix([1, 2, 3], count_hit=False)
    stats = cache.hit_stats()
    assert (stats.lookups, stats.lookup_tokens, stats.matched_tokens) == (2, 5, 3)
    assert stats.hit_rate == pytest.approx(0.6)
    cache.reset_hit_stats()
    assert cache.hit_stats().hit_rate == 0.0


def test_kv_events_stored_and_removed() -> None:
    cache = make_cache(enable_kv_events=True)
    assert cache.take_events() == [KVCacheEvent("cleared", (), 0, None)]
    insert_allocated(cache, [1, 2, 3])
    insert_allocated(cache, [9], extra_key="k")
    s = cache.allocator.alloc(1)
    assert s is not None
    cache.insert([1, 2, 4], torch.cat((cache.match_prefix([1, 2]).device_indices, s)))
    assert cache.take_events() == [
        KVCacheEvent("stored", (1, 2, 3), 0, None),
        KVCacheEvent("stored", (9,), 0, "k"),
        KVCacheEvent("stored", (1, 2, 4), 2, None),
    ]
    assert cache.take_events() == []
    cache.match_prefix([9], extra_key="k")
    cache.match_prefix([1, 2, 4])
    assert cache.evict(2) == 2
    assert cache.take_events() == [
        KVCacheEvent("removed", (1, 2, 3), 2, None),
        KVCacheEvent("removed", (9,), 0, "k"),
    ]


def test_reset_and_disable() -> None:
    cache = make_cache()
    insert_allocated(cache, [1, 2, 3])
    cache.reset()
    cache.allocator.clear()
    assert cache.total_size() == 0 and cache.evictable_size() == 0
    assert cache.match_prefix([1, 2, 3]).device_indices.tolist() == []
    off = make_cache(disable=True)
    assert off.insert([1, 2, 3], t([10, 20, 30])) == 0
    assert off.match_prefix([1, 2, 3]).device_indices.tolist() == []
    assert off.total_size() == 0 and off.evict(10) == 0


def test_page_size_must_match_allocator() -> None:
    pool = ReqToTokenPool(2, 8, "cpu")
    with pytest.raises(ValueError):
        RadixCache(pool, TokenToKVPoolAllocator(8, "cpu"), page_size=4)
