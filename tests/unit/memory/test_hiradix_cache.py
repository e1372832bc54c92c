"""HiRadixCache, the radix tree over a device and a host KV pool: evict to host, match the host part,
load back bit for bit, write policies, host eviction, locks during copies, and random sequences
that keep both tiers' invariants and every node's KV intact.

The "device" pool is a second RAM pool here (as on a CPU server); the logic is the same on cuda.
Every KV slot written by a test holds a tag of the token prefix it would encode (per layer, K and
V differ), so a slot copied to the wrong place, freed early or reused shows up as a wrong tag.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memory.allocator import BaseTokenToKVPoolAllocator
from memory.hiradix_cache import HiRadixCache
from memory.host_pool import HostKVPool, host_pool_tokens
from memory.invariant import check_host_invariant, check_memory_invariant
from memory.kv_pool import MHATokenToKVPool
from memory.kv_transfer import KVTransfer, TransferOp, make_kv_transfer
from memory.req_to_token_pool import ReqToTokenPool
from memory.tree_node import TreeNode

LAYERS, HEADS, DIM = 2, 2, 3


class DeferredOp(TransferOp):
    """An op that completes only when the test says so (a copy still in flight)."""

    def __init__(self, inner: TransferOp, run) -> None:  # type: ignore[no-untyped-def]
        super().__init__(inner.num_tokens, inner.nbytes, inner.to_device)
        self._done = False
        self._run = run

    def wait(self) -> None:
        if not self._done:
            self._run()
            self._done = True


class DeferredTransfer(KVTransfer):
    """Copies happen at ``wait`` (like a copy stream's op completed at the next step)."""

    asynchronous = True

    def to_host(self, device_idx: torch.Tensor, host_idx: torch.Tensor) -> TransferOp:
        d, h = device_idx.clone(), host_idx.clone()
        return DeferredOp(TransferOp(h.numel(), 0, False), lambda: KVTransfer.to_host(self, d, h))

    def to_device(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> TransferOp:
        d, h = device_idx.clone(), host_idx.clone()
        return DeferredOp(TransferOp(h.numel(), 0, True), lambda: KVTransfer.to_device(self, h, d))


class Tiers:
    """A device pool, a host pool and the cache over them; ``tags`` is what each prefix's KV holds."""

    def __init__(
        self,
        device_tokens: int,
        host_tokens: int,
        page_size: int = 1,
        policy: str = "write_through",
        deferred: bool = False,
        eviction: str = "lru",
    ) -> None:
        self.p = page_size
        self.pool = MHATokenToKVPool(device_tokens, page_size, torch.float32, LAYERS, HEADS, DIM, "cpu")
        self.alloc = BaseTokenToKVPoolAllocator(device_tokens, page_size, "cpu", debug=True)
        self.host = HostKVPool(self.pool, host_tokens)
        transfer = (DeferredTransfer if deferred else KVTransfer)(self.pool, self.host)
        self.cache = HiRadixCache(
            ReqToTokenPool(2, 8, "cpu"),
            self.alloc,
            self.host,
            transfer,
            page_size,
            eviction_policy=eviction,
            write_policy=policy,
        )  # type: ignore[arg-type]

    @staticmethod
    def tag(prefix: tuple[int, ...], layer: int, v: bool) -> torch.Tensor:
        seed = hash((prefix, layer, v)) % (2**31)
        return torch.rand((HEADS, DIM), generator=torch.Generator().manual_seed(seed))

    def write(self, key: list[int], slots: torch.Tensor) -> None:
        for i, s in enumerate(slots.tolist()):
            for layer in range(LAYERS):
                self.pool.k_buffer[layer][s] = self.tag(tuple(key[: i + 1]), layer, False)
                self.pool.v_buffer[layer][s] = self.tag(tuple(key[: i + 1]), layer, True)

    def insert(self, key: list[int]) -> bool:
        """Compute ``key`` (fresh device slots, evicting if needed) and cache it, as a finished request would."""
        n = len(key) // self.p * self.p
        slots = self.alloc.alloc(n)
        if slots is None:
            self.cache.evict(n - self.alloc.available_size())
            slots = self.alloc.alloc(n)
        if slots is None:
            return False
        self.write(key[:n], slots)
        present = self.cache.insert(key[:n], slots)
        self.alloc.free(slots[:present])  # duplicates of what the device already holds
        return True

    def kv(self, buffers: tuple[list[torch.Tensor], list[torch.Tensor]], slots: torch.Tensor) -> torch.Tensor:
        k, v = buffers
        return torch.stack([t[slots] for t in k] + [t[slots] for t in v])

    def expected(self, key: list[int]) -> torch.Tensor:
        rows = [
            torch.stack([self.tag(tuple(key[: i + 1]), layer, v) for i in range(len(key))])
            for v in (False, True)
            for layer in range(LAYERS)
        ]
        return torch.stack(rows)

    def device_kv(self, slots: torch.Tensor) -> torch.Tensor:
        return self.kv((self.pool.k_buffer, self.pool.v_buffer), slots)

    def host_kv(self, slots: torch.Tensor) -> torch.Tensor:
        return self.kv((self.host.k_buffer, self.host.v_buffer), slots)

    def check(self, idle: bool = True) -> None:
        """Both invariants, the tier rules, and every node's KV in each tier it is in."""
        cache = self.cache
        report = check_memory_invariant(self.alloc, cache, cache.req_to_token_pool, self.alloc.size, idle=idle)
        assert report.ok, report.message
        ev, prot = cache.host_sizes()
        host = check_host_invariant(self.host.allocator, cache.cached_host_slots(), ev, prot)
        assert host.ok, host.message
        settled = cache.pending_transfers() == 0  # a queued or running copy's slots hold nothing yet
        stack: list[tuple[TreeNode, tuple[int, ...]]] = [(c, ()) for c in cache.root.children.values()]
        while stack:
            node, path = stack.pop()
            full = path + tuple(node.key)
            assert node.value is not None or node.host_value is not None
            if node.value is None:
                assert all(c.value is None for c in node.children.values()), "device part is not a prefix"
            want = self.expected(list(full))[:, len(path) :]
            if node.value is not None and settled:
                assert torch.equal(self.device_kv(node.value), want)
            if node.host_value is not None and settled:
                assert torch.equal(self.host_kv(node.host_value), want)
            stack.extend((c, full) for c in node.children.values())  # type: ignore[misc]


def test_evict_to_host_match_host_part_and_load_back_bit_for_bit() -> None:
    t = Tiers(device_tokens=16, host_tokens=32)
    key = list(range(1, 11))
    assert t.insert(key)
    t.cache.issue_transfers()  # write-through: the backup copy of the new node
    assert t.cache.tier_stats.backed_up_tokens == 10
    original = t.device_kv(t.cache.match_prefix(key).device_indices).clone()
    assert t.cache.evict(10) == 10
    assert t.alloc.available_size() == 16 and t.cache.evictable_size() == 0
    m = t.cache.match_prefix(key + [99])
    assert m.device_indices.numel() == 0 and m.last_node is t.cache.root
    assert m.host_hit_len == 10 and m.last_host_node.key == key
    t.check()
    slots = t.cache.load_back(m.last_host_node)
    assert slots is not None and slots.numel() == 10
    assert t.cache.protected_size() == 10  # locked until its copy completed
    t.cache.issue_transfers()
    assert t.cache.protected_size() == 0 and t.cache.evictable_size() == 10
    m = t.cache.match_prefix(key)
    assert m.device_indices.tolist() == slots.tolist() and m.host_hit_len == 0
    assert torch.equal(t.device_kv(m.device_indices), original)
    assert t.cache.tier_stats.loaded_tokens == 10
    t.check()


def test_partial_match_splits_across_tiers() -> None:
    t = Tiers(device_tokens=32, host_tokens=64, page_size=2)
    assert t.insert(list(range(1, 9)))
    t.cache.issue_transfers()
    t.cache.evict(8)
    assert t.insert(list(range(1, 5)))  # the first half comes back computed: it takes the new slots
    t.check()
    m = t.cache.match_prefix(list(range(1, 9)))
    assert m.device_indices.numel() == 4 and m.host_hit_len == 4
    m = t.cache.match_prefix(list(range(1, 7)) + [50, 51])
    assert m.device_indices.numel() == 4 and m.host_hit_len == 2
    assert t.cache.load_back(m.last_host_node).numel() == 2  # type: ignore[union-attr]
    t.cache.issue_transfers()
    t.check()
    assert torch.equal(
        t.device_kv(t.cache.match_prefix(list(range(1, 7))).device_indices), t.expected(list(range(1, 7)))
    )


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_write_policies(policy: str) -> None:
    t = Tiers(device_tokens=8, host_tokens=32, policy=policy)
    assert t.insert([1, 2, 3, 4])
    t.cache.issue_transfers()
    through = policy == "write_through"
    assert t.host.allocator.available_size() == (28 if through else 32)
    assert t.cache.tier_stats.backed_up_tokens == (4 if through else 0)
    t.check()
    assert t.insert([5, 6, 7, 8, 9, 10])  # evicts [1..4] to the host (write-back copies it now)
    assert t.cache.tier_stats.backed_up_tokens == 4
    m = t.cache.match_prefix([1, 2, 3, 4])
    assert m.device_indices.numel() == 0 and m.host_hit_len == 4
    t.cache.issue_transfers()  # write-through: the new node's copy
    t.check()
    assert t.cache.tier_stats.backed_up_tokens == (10 if through else 4)


def test_host_eviction_drops_least_recently_used() -> None:
    t = Tiers(device_tokens=4, host_tokens=8, policy="write_back")
    a, b, c, d = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]
    for key in (a, b, c):
        assert t.insert(key)
        t.check()
    assert [t.cache.match_prefix(k).host_hit_len for k in (a, b)] == [4, 4]  # the host is full now
    assert t.cache.tier_stats.host_evicted_tokens == 0
    t.cache.match_prefix(a)  # b is now the least recently used
    assert t.insert(d)  # c goes to the host; b leaves the tree
    assert t.cache.tier_stats.host_evicted_tokens == 4
    assert [t.cache.match_prefix(k).host_hit_len for k in (a, b, c)] == [4, 0, 4]
    assert t.cache.match_prefix(d).device_indices.numel() == 4
    t.check()


def test_device_leaf_without_host_room_leaves_the_tree() -> None:
    t = Tiers(device_tokens=20, host_tokens=4, policy="write_back")
    assert t.insert(list(range(1, 9)))
    assert t.insert(list(range(1, 13)))  # a child [9..12] under [1..8]
    t.cache.evict(4)  # the child goes to the host and fills it
    assert t.cache.match_prefix(list(range(1, 13))).host_hit_len == 4
    t.check()
    t.cache.evict(8)  # [1..8] needs 8 host slots: even without the child there are only 4
    assert t.cache.total_size() == 0 and t.cache.host_sizes() == (0, 0) and not t.cache.root.children
    assert t.host.allocator.available_size() == 4 and t.alloc.available_size() == 20
    assert t.cache.tier_stats.device_dropped_tokens == 8 and t.cache.tier_stats.host_evicted_tokens == 4
    t.check()


def test_locks_hold_while_a_copy_is_in_flight() -> None:
    t = Tiers(device_tokens=8, host_tokens=16, deferred=True)
    assert t.insert([1, 2, 3, 4])
    assert t.cache.protected_size() == 4  # queued backup
    t.cache.issue_transfers()  # issued, not completed
    assert t.cache.protected_size() == 4 and t.cache.evictable_size() == 0
    t.check(idle=False)
    t.cache.issue_transfers()  # the next step completes it
    assert t.cache.protected_size() == 0 and t.cache.pending_transfers() == 0
    assert t.cache.evict(8) == 4
    m = t.cache.match_prefix([1, 2, 3, 4])
    slots = t.cache.load_back(m.last_host_node)
    assert slots is not None
    t.cache.issue_transfers()
    # Loading: protected on the device, and the host may not drop its source.
    assert t.cache.protected_size() == 4 and t.cache.evict_host(16) == 0
    assert t.cache.host_sizes() == (0, 4)
    t.cache.wait_transfers()
    assert t.cache.host_sizes() == (0, 4)  # on both tiers: the host copy stays
    assert torch.equal(t.device_kv(slots), t.expected([1, 2, 3, 4]))
    t.check()


def test_eviction_short_of_room_finishes_copies_first() -> None:
    """A decode step or a retraction that needs the slots of a node still being copied waits for
    the copy (then evicts it) instead of failing."""
    t = Tiers(device_tokens=8, host_tokens=16, deferred=True)
    assert t.insert([1, 2, 3, 4])
    t.cache.issue_transfers()
    assert t.cache.evictable_size() == 0 and t.cache.pending_transfers() == 1
    assert t.cache.evict(4) == 4  # the backup completed first: the host holds the KV
    assert t.cache.pending_transfers() == 0 and t.cache.match_prefix([1, 2, 3, 4]).host_hit_len == 4
    t.check()


def test_events_name_the_tier() -> None:
    t = Tiers(device_tokens=4, host_tokens=8, policy="write_back")
    t.cache.enable_kv_events = True
    t.cache.take_events()
    assert t.insert([1, 2, 3, 4])
    assert t.insert([5, 6, 7, 8])
    kinds = [(e.kind, e.tier, e.token_ids) for e in t.cache.take_events()]
    assert kinds == [
        ("stored", "device", (1, 2, 3, 4)),
        ("stored", "host", (1, 2, 3, 4)),
        ("removed", "device", (1, 2, 3, 4)),
        ("stored", "device", (5, 6, 7, 8)),
    ]


def test_host_pool_sizing_and_transfer_choice() -> None:
    assert host_pool_tokens(1000, 100, 4, 2.0, 0) == 2000
    assert host_pool_tokens(1000, 1 << 20, 4, 2.0, 0.5) == 512  # --hicache-size wins
    assert host_pool_tokens(10, 100, 16, 0.1, 0) == 16  # at least one page
    pool = MHATokenToKVPool(8, 1, torch.float32, 1, 1, 1, "cpu")
    host = HostKVPool(pool, 8)
    assert not host.pinned and type(make_kv_transfer(pool, host)) is KVTransfer


# --------------------------------------------------------------------------- random sequences
KEYS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 10, 11, 12], [20, 21, 22, 23], [1, 2, 30, 31]]


def _key(rng: random.Random) -> list[int]:
    base = rng.choice(KEYS)
    return base[: rng.randint(1, len(base))] + [rng.randint(40, 43) for _ in range(rng.randint(0, 6))]


def _run(t: Tiers, ops: list[tuple[int, int]]) -> None:
    locked: list[TreeNode] = []
    for op, arg in ops:
        rng = random.Random(arg)
        if op == 0:
            t.insert(_key(rng))
        elif op == 1:
            m = t.cache.match_prefix(_key(rng))
            if m.host_hit_len:
                slots = t.cache.load_back(m.last_host_node)
                if slots is not None and rng.random() < 0.5:  # a request holds it a while
                    t.cache.inc_lock_ref(m.last_host_node)
                    locked.append(m.last_host_node)
        elif op == 2:
            t.cache.evict(arg % 20)
        elif op == 3:
            t.cache.evict_host(arg % 20)
        elif op == 4:
            t.cache.issue_transfers() if arg % 3 else t.cache.wait_transfers()
        elif op == 5 and locked:
            t.cache.dec_lock_ref(locked.pop(arg % len(locked)))
        t.check(idle=False)
    for node in locked:
        t.cache.dec_lock_ref(node)
    t.cache.wait_transfers()
    t.check()
    t.cache.evict(10**9)
    t.cache.evict_host(10**9)
    assert t.alloc.available_size() == t.alloc.size and t.host.allocator.available_size() == t.host.allocator.size
    t.check()


OPS = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 10**6)), min_size=1, max_size=60)


@settings(max_examples=40, deadline=None)
@given(
    ops=OPS,
    page_size=st.sampled_from([1, 2]),
    policy=st.sampled_from(["write_through", "write_back"]),
    deferred=st.booleans(),
    eviction=st.sampled_from(["lru", "lfu"]),
)
def test_random_sequences_keep_both_invariants(
    ops: list[tuple[int, int]], page_size: int, policy: str, deferred: bool, eviction: str
) -> None:
    t = Tiers(
        device_tokens=16, host_tokens=24, page_size=page_size, policy=policy, deferred=deferred, eviction=eviction
    )
    _run(t, ops)


def test_a_parent_dropped_while_its_child_is_leaving_for_the_host() -> None:
    """write_back, a host too small for the parent: the child gets the last host room and is
    copied out, then the parent, with no room, is dropped with it (no half-copied child left)."""
    t = Tiers(device_tokens=16, host_tokens=4, policy="write_back")
    assert t.insert(list(range(1, 7))) and t.insert(list(range(1, 9)))  # parent [1..6], child [7, 8]
    assert t.cache.evict(8) == 8
    t.check()
    assert t.alloc.available_size() == 16
    assert t.cache.match_prefix(list(range(1, 9))).device_indices.numel() == 0
