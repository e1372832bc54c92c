"""The request lifecycle over the memory subsystem: match -> lock -> allocate -> cache_unfinished / cache_finished.

A small simulator plays the scheduler's part and tags every KV slot it writes with the
token prefix whose KV it would hold; after every step it checks the memory invariant
and that every request row and every tree node still points at slots holding the
right "KV" (so a slot freed too early, reused, or remapped wrongly is caught).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from memory.chunk_cache import ChunkCache
from memory.invariant import check_memory_invariant
from memory.prefix_cache import BasePrefixCache, request_kv_len
from memory.radix_cache import RadixCache
from memory.req_state import CacheRequest, SimpleCacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.tree_node import TreeNode


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def make_allocator(size: int, page_size: int) -> BaseTokenToKVPoolAllocator:
    if page_size == 1:
        return TokenToKVPoolAllocator(size, "cpu", debug=True)
    return PagedTokenToKVPoolAllocator(size, page_size, "cpu", debug=True)


class Sim:
    """Plays the scheduler: owns the requests, the fake KV contents and the checks."""

    def __init__(self, page_size: int, kv_size: int, radix: bool = True, chunk: int = 6, policy: str = "lru") -> None:
        self.p = page_size
        self.pool = ReqToTokenPool(6, 64, "cpu")
        self.alloc = make_allocator(kv_size, page_size)
        self.cache: BasePrefixCache
        if radix:
            self.cache = RadixCache(self.pool, self.alloc, page_size=page_size, eviction_policy=policy)  # type: ignore[arg-type]
        else:
            self.cache = ChunkCache(self.pool, self.alloc, page_size=page_size)
        self.chunk = chunk
        self.kv: dict[int, tuple[str | None, tuple[int, ...]]] = {}  # slot -> what its KV would encode
        self.running: list[SimpleCacheRequest] = []

    # ---------------------------------------------------------------- helpers
    def row(self, req: CacheRequest, n: int) -> list[int]:
        assert req.cache_handle.req_pool_idx is not None
        return self.pool.req_to_token[req.cache_handle.req_pool_idx, :n].tolist()

    def _alloc(self, need: int, fn):  # type: ignore[no-untyped-def]
        if self.alloc.available_size() < need:
            self.cache.evict(need - self.alloc.available_size())
        return fn()

    def _store(self, req: SimpleCacheRequest, start: int, slots: torch.Tensor) -> None:
        assert req.cache_handle.req_pool_idx is not None
        self.pool.write(req.cache_handle.req_pool_idx, start, slots)
        tokens = req.origin_input_ids + req.output_ids
        for i, s in enumerate(slots.tolist()):
            self.kv[s] = (req.extra_key, tuple(tokens[: start + i + 1]))

    # ------------------------------------------------------------- lifecycle
    def admit(self, prompt: list[int], extra_key: str | None = None) -> SimpleCacheRequest | None:
        return self.admit_batch([prompt], extra_key)[0]

    def admit_batch(self, prompts: list[list[int]], extra_key: str | None = None) -> list[SimpleCacheRequest | None]:
        """Prefill several new requests in one batch: all match and allocate before any is cached."""
        batch: list[SimpleCacheRequest | None] = []
        for prompt in prompts:
            req = SimpleCacheRequest(origin_input_ids=list(prompt), extra_key=extra_key)
            # Leave at least one prompt token to compute, as a scheduler must (it needs its logits).
            self.cache.match_request(req, prompt[:-1], count_hit=True)
            if not self.cache.attach_rows([req]):  # (a row starting with the matched prefix)
                batch.append(None)
                continue
            handle = req.cache_handle
            self.cache.inc_lock_ref(handle.last_node)  # lock before allocating: allocation may evict
            req.fill_ids = list(prompt[: handle.prefix_indices.numel()])
            if not self._extend(req):
                self.cache.release_req(req)
                batch.append(None)
                continue
            self.running.append(req)
            batch.append(req)
        for req in batch:  # "forward" done: cache what each request prefilled
            if req is not None:
                self._after_prefill(req)
        return batch

    def prefill_chunk(self, req: SimpleCacheRequest) -> bool:
        if not self._extend(req):
            return False
        self._after_prefill(req)
        return True

    def _extend(self, req: SimpleCacheRequest) -> bool:
        start = len(req.fill_ids)
        end = min(len(req.origin_input_ids), start + self.chunk)
        last = self.row(req, start)[-1] if start else -1
        out = self._alloc(
            end - start + self.p, lambda: self.alloc.alloc_extend(t([start]), t([end]), t([last]), end - start)
        )
        if out is None:
            return False
        self._store(req, start, out)
        req.fill_ids = req.origin_input_ids[:end]
        return True

    def _after_prefill(self, req: SimpleCacheRequest) -> None:
        if len(req.fill_ids) == len(req.origin_input_ids):
            req.output_ids.append(100 + sum(req.origin_input_ids) % 3)  # the prefill's sampled token
        self.cache.cache_unfinished_req(req)

    def decode(self, req: SimpleCacheRequest) -> bool:
        pos = len(req.origin_input_ids) + len(req.output_ids) - 1  # the newest token gets its KV now
        last = self.row(req, pos)[-1]
        out = self._alloc(self.p, lambda: self.alloc.alloc_decode(t([pos + 1]), t([last])))
        if out is None:
            return False
        self._store(req, pos, out)
        req.output_ids.append(100 + (req.output_ids[-1] + pos) % 3)
        return True

    def finish(self, req: SimpleCacheRequest) -> None:
        self.cache.cache_finished_req(req)
        self.running.remove(req)
        assert req.cache_handle.req_pool_idx is None and req.cache_handle.last_node is None

    def retract(self, req: SimpleCacheRequest) -> None:
        self.cache.release_req(req)
        self.running.remove(req)

    # ----------------------------------------------------------------- checks
    def kv_len(self, req: SimpleCacheRequest) -> int:
        return request_kv_len(req)

    def check(self) -> None:
        active = {r.cache_handle.req_pool_idx: self.kv_len(r) for r in self.running}
        report = check_memory_invariant(
            self.alloc,
            self.cache,
            self.pool,
            self.alloc.size,
            idle=not self.running,
            active_rows=active,  # type: ignore[arg-type]
        )
        assert report.ok, report.message
        for r in self.running:
            tokens = r.origin_input_ids + r.output_ids
            for i, s in enumerate(self.row(r, self.kv_len(r))):
                assert self.kv[s] == (r.extra_key, tuple(tokens[: i + 1])), f"row of {r.origin_input_ids} position {i}"
            held = r.cache_handle.prefix_indices.numel()
            assert self.row(r, held) == r.cache_handle.prefix_indices.tolist()
        if isinstance(self.cache, RadixCache):
            self._check_tree(self.cache.root, ())

    def _check_tree(self, node: TreeNode, path: tuple[int, ...]) -> None:
        for i, s in enumerate(node.value.tolist()):
            assert self.kv[s] == (node.extra_key, path[: len(path) - len(node.key) + i + 1])
        assert len(node.key) % self.p == 0
        for child in node.children.values():
            self._check_tree(child, path + tuple(child.key))

    def drain(self) -> None:
        """Finish everything, check the idle invariant, then evict all and expect a full pool."""
        for r in list(self.running):
            self.finish(r)
        self.check()
        self.cache.evict(10**9)
        assert self.alloc.available_size() == self.alloc.size
        assert self.cache.total_size() == 0
        assert self.pool.available_size() == self.pool.size


# --------------------------------------------------------------------------- fixed scenarios
def test_duplicate_prefix_race_page1() -> None:
    sim = Sim(page_size=1, kv_size=32, chunk=16)
    prompt = list(range(1, 9))
    a, b = sim.admit_batch([prompt, prompt])  # one batch: neither saw the other's KV in the tree
    assert a is not None and b is not None
    # a's cache_unfinished_req ran first and inserted its slots 1..8; b then found them cached.
    assert sim.row(a, 8) == list(range(1, 9))
    assert sim.row(b, 8) == list(range(1, 9))
    assert b.cache_handle.prefix_indices.tolist() == list(range(1, 9))
    assert a.cache_handle.last_node is b.cache_handle.last_node and a.cache_handle.last_node.lock_ref == 2
    assert sim.alloc.free_slot_mask()[9:17].all()  # b's own slots 9..16 are free again
    assert (sim.alloc.available_size(), sim.cache.protected_size(), sim.cache.evictable_size()) == (24, 8, 0)
    sim.check()
    assert sim.decode(a) and sim.decode(b)
    assert sim.row(a, 9)[8] == 17 and sim.row(b, 9)[8] == 18
    assert a.output_ids == b.output_ids
    sim.finish(a)
    assert (sim.cache.total_size(), sim.cache.protected_size(), sim.cache.evictable_size()) == (
        9,
        8,
        1,
    )  # b still holds 8
    sim.finish(b)  # b's slot 18 duplicates a's slot 17 and is freed
    report = check_memory_invariant(sim.alloc, sim.cache, sim.pool, 32, idle=True)
    assert report.ok and report.leaked_slots == [] and report.double_owned_slots == []
    assert (report.available, report.evictable, report.protected) == (23, 9, 0)
    assert sim.cache.match_prefix(prompt + a.output_ids[:1]).device_indices.tolist() == list(range(1, 9)) + [17]


def test_duplicate_prefix_race_paged() -> None:
    sim = Sim(page_size=4, kv_size=64, chunk=16)
    prompt = list(range(1, 11))  # 10 tokens: two whole pages + a tail of 2
    a, b = sim.admit_batch([prompt, prompt])
    assert a is not None and b is not None
    assert sim.row(a, 10) == list(range(4, 14))  # pages 1..3
    assert sim.row(b, 10) == list(range(4, 12)) + [24, 25]  # canonical pages 1, 2 + its own tail page 6
    assert b.cache_handle.prefix_indices.tolist() == list(range(4, 12)) + [24, 25]
    assert sorted(sim.alloc.release_pages.tolist()) == [4, 5]
    assert (sim.cache.total_size(), sim.cache.protected_size()) == (8, 8)
    sim.check()
    sim.finish(a)
    sim.finish(b)
    report = check_memory_invariant(sim.alloc, sim.cache, sim.pool, 64, idle=True)
    assert report.ok, report.message
    assert (report.available, report.evictable, report.protected) == (56, 8, 0)


def test_chunked_prefill_reuses_own_partial_page() -> None:
    sim = Sim(page_size=4, kv_size=64, chunk=6)
    prompt = list(range(1, 15))
    req = sim.admit(prompt)
    assert req is not None
    assert sim.row(req, 6) == [4, 5, 6, 7, 8, 9]
    assert req.cache_handle.prefix_indices.tolist() == [4, 5, 6, 7, 8, 9]  # 4 cached (locked) + own tail of 2
    assert sim.cache.protected_size() == 4
    assert sim.prefill_chunk(req)
    assert sim.row(req, 12) == list(range(4, 16))  # the second chunk filled page 2 first
    assert sim.cache.protected_size() == 12
    assert sim.prefill_chunk(req)
    sim.check()
    sim.drain()


def test_second_request_hits_the_cache_after_the_first_finishes() -> None:
    sim = Sim(page_size=1, kv_size=32, chunk=32)
    first = sim.admit([5, 6, 7, 8])
    assert first is not None and sim.decode(first)
    sim.finish(first)
    assert sim.cache.total_size() == 5  # prompt + the one generated token whose KV exists
    second = sim.admit([5, 6, 7, 8, first.output_ids[0], 9])
    assert second is not None
    assert sim.row(second, 5) == [1, 2, 3, 4, 5]
    assert sim.cache.hit_stats().matched_tokens == 5
    sim.check()
    sim.drain()


def test_abort_mid_prefill_frees_everything() -> None:
    for radix in (True, False):
        sim = Sim(page_size=4, kv_size=64, chunk=5, radix=radix)
        req = sim.admit(list(range(1, 20)))
        assert req is not None and req.output_ids == []
        sim.finish(req)  # kv_len falls back to the prefilled part
        sim.check()
        assert sim.alloc.available_size() + sim.cache.evictable_size() == 64
        assert sim.cache.evictable_size() == (4 if radix else 0)


def test_chunk_cache_keeps_own_slots_and_frees_all() -> None:
    sim = Sim(page_size=1, kv_size=32, radix=False, chunk=4)
    req = sim.admit([1, 2, 3, 4, 5, 6])
    assert req is not None
    assert req.cache_handle.prefix_indices.tolist() == [1, 2, 3, 4]
    assert sim.cache.match_prefix([1, 2, 3]).device_indices.numel() == 0
    assert sim.prefill_chunk(req) and sim.decode(req) and sim.decode(req)
    assert sim.alloc.available_size() == 32 - 8
    sim.check()
    sim.finish(req)
    assert sim.alloc.available_size() == 32 and sim.pool.available_size() == sim.pool.size
    sim.drain()


def test_invariant_reports_leaked_and_double_owned_slots() -> None:
    sim = Sim(page_size=1, kv_size=16)
    leaked = sim.alloc.alloc(2)
    assert leaked is not None
    report = check_memory_invariant(sim.alloc, sim.cache, sim.pool, 16, idle=True)
    assert not report.ok and report.leaked_slots == [1, 2]
    sim.alloc.free(leaked)
    assert sim.alloc.alloc(1).tolist() == [3]  # type: ignore[union-attr]
    assert isinstance(sim.cache, RadixCache)
    sim.cache.insert([7], t([5]))  # slot 5 is still on the free list; slot 3 is owned by nobody
    report = check_memory_invariant(sim.alloc, sim.cache, sim.pool, 16, idle=True)
    # The sizes add up (15 + 1 == 16); only the per-slot checks see the problem.
    assert not report.ok and report.double_owned_slots == [5] and report.leaked_slots == [3]
    row = sim.pool.alloc(1)
    assert row is not None
    report = check_memory_invariant(sim.alloc, sim.cache, sim.pool, 16, idle=True)
    assert "request rows are still allocated" in report.message


# --------------------------------------------------------------------------- random lifecycles
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [20, 21]]


def _prompt(rng: random.Random) -> list[int]:
    base = rng.choice(PREFIXES)
    return base[: rng.randint(1, len(base))] + [rng.randint(1, 4) for _ in range(rng.randint(0, 9))]


def _run_random_lifecycle(sim: Sim, ops: list[tuple[int, int]], extra_keys: list[str | None]) -> None:
    for op, arg in ops:
        rng = random.Random(arg)
        if op == 0 or not sim.running:
            sim.admit_batch([_prompt(rng) for _ in range(rng.randint(1, 3))], extra_key=rng.choice(extra_keys))
        else:
            req = sim.running[arg % len(sim.running)]
            prefilling = len(req.fill_ids) < len(req.origin_input_ids)
            if op == 1 and prefilling:
                sim.prefill_chunk(req)
            elif op == 1 or op == 2:
                if not prefilling and len(req.output_ids) < 8 and not sim.decode(req):
                    sim.retract(req)  # out of KV: give its memory back, as a scheduler's retract does
            elif op == 3:
                sim.finish(req)
            elif op == 4:
                sim.cache.evict(arg % 12)
            elif op == 5:
                sim.retract(req)
        sim.check()
    sim.drain()


OPS = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**6)), min_size=1, max_size=50)


@settings(max_examples=30, deadline=None)
@given(ops=OPS, page_size=st.sampled_from([1, 4]), policy=st.sampled_from(["lru", "lfu"]))
def test_random_lifecycle_radix(ops: list[tuple[int, int]], page_size: int, policy: str) -> None:
    sim = Sim(page_size=page_size, kv_size=20 * page_size if page_size > 1 else 40, chunk=5, policy=policy)
    _run_random_lifecycle(sim, ops, [None, None, "x"])


@settings(max_examples=15, deadline=None)
@given(ops=OPS, page_size=st.sampled_from([1, 4]))
def test_random_lifecycle_chunk_cache(ops: list[tuple[int, int]], page_size: int) -> None:
    sim = Sim(page_size=page_size, kv_size=20 * page_size if page_size > 1 else 40, radix=False, chunk=5)
    _run_random_lifecycle(sim, ops, [None])


@pytest.mark.parametrize("page_size", [1, 4])
def test_long_random_lifecycle(page_size: int) -> None:
    """One long seeded run (hypothesis keeps its runs short)."""
    rng = random.Random(page_size)
    sim = Sim(page_size=page_size, kv_size=24 * page_size if page_size > 1 else 48, chunk=5)
    ops = [(rng.choice([0, 0, 1, 1, 2, 2, 3, 4, 5]), rng.randint(0, 10**6)) for _ in range(400)]
    _run_random_lifecycle(sim, ops, [None, "x"])
    assert sim.cache.hit_stats().matched_tokens > 0
