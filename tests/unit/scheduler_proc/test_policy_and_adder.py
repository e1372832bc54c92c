"""Unit tests of the schedule policies (on a real radix tree) and the PrefillAdder (on fakes)."""

from __future__ import annotations

import torch

from memory import RadixCache, ReqToTokenPool, TokenToKVPoolAllocator
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.policy import CACHE_AWARE_QUEUE_LIMIT, SchedulePolicy
from scheduler_proc.prefill_adder import AddResult, PrefillAdder
from scheduler_proc.req import Req


def req(rid: str, prompt: list[int], max_new_tokens: int = 16, output: list[int] | None = None) -> Req:
    r = Req(rid=rid, origin_input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=max_new_tokens))
    r.output_ids = list(output or [])
    return r


def tree_with(prefixes: list[list[int]]) -> RadixCache:
    pool = ReqToTokenPool(4, 256, "cpu")
    alloc = TokenToKVPoolAllocator(1024, "cpu")
    tree = RadixCache(pool, alloc, page_size=1)
    for p in prefixes:
        tree.insert(p, alloc.alloc(len(p)))
    return tree


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


# ---------------------------------------------------------------- policies


def test_fcfs_keeps_arrival_order() -> None:
    waiting = [req(f"r{i}", [i + 1] * (5 - i)) for i in range(5)]
    policy = SchedulePolicy("fcfs", tree_with([]), radix_enabled=True)
    assert rids(policy.order(waiting)) == ["r0", "r1", "r2", "r3", "r4"]


def test_lof_orders_by_max_new_tokens() -> None:
    waiting = [req("short", [1], 4), req("long", [2], 64), req("mid", [3], 16)]
    policy = SchedulePolicy("lof", tree_with([]), radix_enabled=True)
    assert rids(policy.order(waiting)) == ["long", "mid", "short"]


def test_lpm_orders_by_longest_cached_prefix() -> None:
    tree = tree_with([[1, 2, 3, 4, 5, 6, 7, 8], [9, 9]])
    waiting = [
        req("none", [50, 51, 52]),
        req("two", [9, 9, 10, 11]),
        req("six", [1, 2, 3, 4, 5, 6, 40]),
        req("three", [1, 2, 3, 30]),
    ]
    policy = SchedulePolicy("lpm", tree, radix_enabled=True)
    ordered = policy.order(waiting)
    assert rids(ordered) == ["six", "three", "two", "none"]
    assert [len(r.cache_handle.prefix_indices) for r in ordered] == [6, 3, 2, 0]


def test_lpm_falls_back_to_fcfs_without_radix_or_on_long_queue() -> None:
    tree = tree_with([[1, 2, 3]])
    waiting = [req("miss", [7, 7]), req("hit", [1, 2, 3, 4])]
    assert rids(SchedulePolicy("lpm", tree, radix_enabled=False).order(waiting)) == ["miss", "hit"]
    long_queue = waiting + [req(f"x{i}", [8]) for i in range(CACHE_AWARE_QUEUE_LIMIT)]
    assert rids(SchedulePolicy("lpm", tree, radix_enabled=True).order(long_queue))[:2] == ["miss", "hit"]


def test_dfs_weight_visits_heavier_subtrees_first() -> None:
    # Branch A (3 waiting requests) is heavier than branch B (1), though B arrived first.
    tree = tree_with([[1, 1, 1, 1], [2, 2, 2, 2]])
    waiting = [
        req("b0", [2, 2, 2, 2, 5]),
        req("a0", [1, 1, 1, 1, 5]),
        req("loose", [3, 3]),
        req("a1", [1, 1, 1, 1, 6]),
        req("a2", [1, 1, 1, 1, 7]),
    ]
    ordered = rids(SchedulePolicy("dfs-weight", tree, radix_enabled=True).order(waiting))
    assert ordered.index("a2") < ordered.index("b0")
    assert ordered[:3] == ["a0", "a1", "a2"] or set(ordered[:3]) == {"a0", "a1", "a2"}
    assert sorted(ordered) == sorted(rids(waiting))


# ---------------------------------------------------------------- PrefillAdder


class FakeAllocator:
    def __init__(self, available: int) -> None:
        self.available = available

    def available_size(self) -> int:
        return self.available


class FakeTree:
    def __init__(self, evictable: int = 0) -> None:
        self.evictable = evictable
        self.locked: list[object] = []

    def evictable_size(self) -> int:
        return self.evictable

    def inc_lock_ref(self, node: object) -> None:
        self.locked.append(node)

    def dec_lock_ref(self, node: object) -> None:
        self.locked.remove(node)


def adder(
    available: int,
    running: list[Req] | None = None,
    ratio: float = 1.0,
    max_prefill: int = 10_000,
    chunk: int | None = None,
    max_running: int = 64,
    evictable: int = 0,
) -> PrefillAdder:
    return PrefillAdder(
        FakeTree(evictable),
        FakeAllocator(available),
        running or [],
        ratio,
        max_prefill,
        chunk,
        max_running,
        page_size=1,
    )


def test_adder_admits_exactly_what_fits() -> None:
    # Each request needs 30 prompt + 10 decode = 40 tokens: two fit in 80, not a third.
    running = [req("busy", [1], max_new_tokens=0)]  # makes the server non-idle; reserves nothing
    a = adder(available=80, running=running)
    results = [a.add_one_req(req(f"r{i}", list(range(1, 31)), 10)) for i in range(3)]
    assert results == [AddResult.CONTINUE, AddResult.CONTINUE, AddResult.NO_TOKEN]
    assert rids(a.can_run) == ["r0", "r1"]
    assert a.rem_total_tokens == 0


def test_adder_counts_evictable_tokens_as_available() -> None:
    a = adder(available=10, evictable=40, running=[req("busy", [1], 0)])
    assert a.add_one_req(req("r", list(range(1, 31)), 10)) == AddResult.CONTINUE


def test_adder_counts_running_requests_reserve() -> None:
    # A running request with 50 tokens left at ratio 0.5 reserves 25.
    running = [req("run", [1, 2], max_new_tokens=60, output=[7] * 10)]
    a = adder(available=100, running=running, ratio=0.5)
    assert a.rem_total_tokens == 75
    assert a.add_one_req(req("fits", list(range(1, 51)), 20)) == AddResult.CONTINUE
    assert a.rem_total_tokens == 5
    assert a.add_one_req(req("no", [5, 6, 7, 8, 9], 1)) == AddResult.NO_TOKEN  # 5 + 1 > 5


def test_adder_chunks_the_overflowing_prompt_at_the_chunk_size() -> None:
    a = adder(available=1000, chunk=50)
    first = req("small", list(range(1, 21)), 4)
    long = req("long", list(range(1, 121)), 4)
    assert a.add_one_req(first) == AddResult.CONTINUE
    assert a.add_one_req(long) == AddResult.OTHER
    assert a.new_chunked_req is long
    planned = a.planned[-1]
    assert planned.req is long and planned.extend_len == 30  # 50 - 20 left in the chunk
    assert planned.chunked and not a.planned[0].chunked


def test_adder_respects_max_prefill_tokens_and_running_limit() -> None:
    a = adder(available=1000, max_prefill=25)
    assert a.add_one_req(req("a", list(range(1, 21)), 4)) == AddResult.CONTINUE
    # 5 prompt tokens remain in this batch's budget: the next prompt is chunked to 5.
    b = req("b", list(range(1, 21)), 4)
    assert a.add_one_req(b) == AddResult.OTHER and a.planned[-1].extend_len == 5
    full = adder(available=1000, running=[req(f"run{i}", [1]) for i in range(3)], max_running=3)
    assert full.add_one_req(req("c", [1, 2], 4)) == AddResult.OTHER


def test_adder_charges_whole_pages() -> None:
    """page_size 4: a 2-token prompt takes a whole page, and a prefix's partial page is filled first."""
    running = [req("busy", [1], max_new_tokens=0)]
    a = PrefillAdder(FakeTree(), FakeAllocator(8), running, 1.0, 10_000, None, 64, page_size=4)
    assert a.add_one_req(req("r0", [1, 2], max_new_tokens=0)) == AddResult.CONTINUE
    assert a.rem_total_tokens == 4
    assert a.add_one_req(req("r1", [1, 2], max_new_tokens=0)) == AddResult.CONTINUE
    assert a.add_one_req(req("r2", [1, 2], max_new_tokens=0)) == AddResult.NO_TOKEN
    continued = req("c", list(range(1, 11)), max_new_tokens=0)
    continued.cache_handle.prefix_indices = torch.arange(6)  # 6 tokens held: 2 of its second page are free
    fresh = PrefillAdder(FakeTree(), FakeAllocator(4), running, 1.0, 10_000, None, 64, page_size=4)
    assert fresh.add_one_req(continued) == AddResult.CONTINUE  # 10 - 6 = 4 tokens need one new page


def test_adder_locks_the_prefix_before_checking_and_unlocks_on_reject() -> None:
    """Locking a request's own cached prefix removes it from the evictable room it would need."""
    tree = tree_with([list(range(1, 51))])  # 50 evictable tokens
    running = [req("busy", [999], max_new_tokens=0)]
    small = PrefillAdder(tree, FakeAllocator(30), running, 1.0, 10_000, None, 64)
    r = req("r", list(range(1, 51)) + list(range(200, 240)), max_new_tokens=10)
    SchedulePolicy("fcfs", tree, radix_enabled=True).match(r)
    assert len(r.cache_handle.prefix_indices) == 50
    # Room before locking: 30 free + 50 evictable = 80 >= 40 + 10; after: 30 < 50.
    assert small.add_one_req(r) == AddResult.NO_TOKEN
    assert tree.protected_size() == 0 and tree.evictable_size() == 50  # lock released
    assert small.rem_total_tokens == 80
    roomy = PrefillAdder(tree, FakeAllocator(50), running, 1.0, 10_000, None, 64)
    assert roomy.add_one_req(r) == AddResult.CONTINUE
    assert tree.protected_size() == 50
