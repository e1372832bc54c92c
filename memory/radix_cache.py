"""RadixCache: a radix tree from token prefixes to the KV slots that hold them.

Ownership: every slot stored in a node's ``value`` is owned by the tree; it goes back
to the allocator only through ``evict`` (or ``reset``, which clears the allocator as
well). A node is *protected* while some request holds a lock on it or on a
descendant (``lock_ref > 0``), otherwise *evictable*; ``evictable_size`` and
``protected_size`` count tokens in each state, and together they are the tree's size.

With ``page_size > 1`` keys are compared page by page: only whole pages are ever
stored or matched, so a node's slots are always whole KV pages and a match length is
always a multiple of the page size.

Request lifecycle (match -> lock -> allocate -> forward -> cache_unfinished /
cache_finished) is documented in :mod:`memory.prefix_cache`.
"""

from __future__ import annotations

import heapq
import logging
from typing import Literal, cast

import torch

from memory.allocator import SlotAllocator
from memory.prefix_cache import BasePrefixCache, HitStats, KVCacheEvent, MatchResult, request_kv_len
from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.tree_node import ChildKey, TokenKey, TreeNode

logger = logging.getLogger(__name__)


def _common_prefix_len(node_key: list[int], key: list[int], off: int) -> int:
    """Length of the common prefix of ``node_key`` and ``key[off:]`` (fast path: one C-level compare)."""
    n = min(len(node_key), len(key) - off)
    if n == len(node_key):
        if key[off : off + n] == node_key:
            return n
    elif key[off : off + n] == node_key[:n]:
        return n
    i = 0
    while node_key[i] == key[off + i]:
        i += 1
    return i


class RadixCache(BasePrefixCache):
    """Prefix cache over ``allocator``'s KV slots; see the module docstring."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: SlotAllocator,
        page_size: int = 1,
        eviction_policy: Literal["lru", "lfu"] = "lru",
        disable: bool = False,
        enable_kv_events: bool = False,
    ) -> None:
        if page_size != allocator.page_size:
            raise ValueError(f"RadixCache page_size {page_size} != allocator page_size {allocator.page_size}")
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {eviction_policy!r} (lru or lfu)")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.disable = disable
        self.enable_kv_events = enable_kv_events
        self.device = allocator.device
        self._empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.reset()

    # ------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        """Drop every cached prefix. The caller must also ``allocator.clear()`` (the scheduler's flush does both)."""
        self._clock = 0
        self._next_id = 0
        self.root = self._new_node([], self._empty, None, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._leaves: set[TreeNode] = set()
        self._evictable_size = 0
        self._protected_size = 0
        self._lookups = 0
        self._lookup_tokens = 0
        self._matched_tokens = 0
        self._events: list[KVCacheEvent] = []
        if self.enable_kv_events:
            self._events.append(KVCacheEvent("cleared", (), 0, None))

    def _new_node(
        self, key: list[int], value: torch.Tensor, parent: TreeNode | None, extra_key: str | None
    ) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent, extra_key)
        self._next_id += 1
        return node

    def _tick(self) -> int:
        # A logical clock: deterministic LRU order even for operations within one timer tick.
        self._clock += 1
        return self._clock

    def _child_key(self, key: list[int], off: int, extra_key: str | None) -> ChildKey:
        head: TokenKey = key[off] if self.page_size == 1 else tuple(key[off : off + self.page_size])
        return head if extra_key is None else (extra_key, head)

    def _match_len(self, node_key: list[int], key: list[int], off: int) -> int:
        n = _common_prefix_len(node_key, key, off)
        return n if self.page_size == 1 else n // self.page_size * self.page_size

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens in the tree, counted by walking it (an independent check of the two counters)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += len(node.key)
            stack.extend(node.children.values())
        return total

    def cached_slots(self) -> torch.Tensor:
        values, stack = [], [self.root]
        while stack:
            node = stack.pop()
            values.append(node.device_value())
            stack.extend(node.children.values())
        return torch.cat(values) if values else self._empty

    def hit_stats(self) -> HitStats:
        return HitStats(self._lookups, self._lookup_tokens, self._matched_tokens)

    def reset_hit_stats(self) -> None:
        self._lookups = self._lookup_tokens = self._matched_tokens = 0

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def _path_tokens(self, node: TreeNode) -> tuple[tuple[int, ...], int]:
        parts: list[list[int]] = []
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            parts.append(cur.key)
            cur = cur.parent
        tokens = tuple(t for part in reversed(parts) for t in part)
        return tokens, len(tokens) - len(node.key)

    def _emit(self, kind: Literal["stored", "removed"], node: TreeNode) -> None:
        tokens, start = self._path_tokens(node)
        self._events.append(KVCacheEvent(kind, tokens, start, node.extra_key))

    # ---------------------------------------------------------------- lookups
    def match_prefix(self, key: list[int], extra_key: str | None = None, count_hit: bool = True) -> MatchResult:
        """Longest cached prefix of ``key`` (page-aligned); splits the node where the match ends."""
        if count_hit:
            self._lookups += 1
            self._lookup_tokens += len(key)
        if self.disable:
            return MatchResult(self._empty, self.root)
        usable = len(key) // self.page_size * self.page_size
        if usable < len(key):
            key = key[:usable]
        values, node = self._match(key, extra_key)
        indices = torch.cat(values) if len(values) > 1 else (values[0] if values else self._empty)
        if count_hit:
            self._matched_tokens += indices.numel()
        return MatchResult(indices, node)

    def _match(self, key: list[int], extra_key: str | None) -> tuple[list[torch.Tensor], TreeNode]:
        nodes = self._match_nodes(key, extra_key)
        # (every node of this tree has device slots: no per-node check on this path)
        return cast(list[torch.Tensor], [n.value for n in nodes]), (nodes[-1] if nodes else self.root)

    def _match_nodes(self, key: list[int], extra_key: str | None) -> list[TreeNode]:
        """The nodes of ``key``'s longest cached prefix, root side first (the last one split where
        the match ends); marks them accessed."""
        now = self._tick()
        node, off, nodes = self.root, 0, []
        node.last_access_time = now
        while off < len(key):
            child = node.children.get(self._child_key(key, off, extra_key))
            if child is None:
                break
            child.last_access_time = now
            child.hit_count += 1
            n = self._match_len(child.key, key, off)
            if n < len(child.key):
                nodes.append(self._split(child, n))
                break
            nodes.append(child)
            node = child
            off += n
        return nodes

    def _split(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut ``child`` after ``split_len`` tokens; return the new upper node (sizes are unchanged)."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        upper = self._new_node(child.key[:split_len], self._empty, parent, child.extra_key)
        upper.lock_ref = child.lock_ref
        upper.last_access_time = child.last_access_time
        upper.hit_count = child.hit_count
        parent.children[self._child_key(child.key, 0, child.extra_key)] = upper
        child.key = child.key[split_len:]
        self._split_values(child, upper, split_len)
        child.parent = upper
        upper.children[self._child_key(child.key, 0, child.extra_key)] = child
        return upper

    def _split_values(self, child: TreeNode, upper: TreeNode, split_len: int) -> None:
        """Give ``upper`` the first ``split_len`` tokens' slots of ``child`` (a subclass whose nodes
        keep more per token, or no device slots, splits that here too)."""
        value = child.device_value()
        upper.value, child.value = value[:split_len], value[split_len:]

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Cache ``key -> value`` (page-aligned part); return how many leading tokens were already cached.

        The tree takes ownership of the new slots only (``value[returned:]`` of the
        aligned part); the caller still owns ``value[:returned]`` and must free them
        if they are not the tree's own slots.
        """
        if self.disable:
            return 0
        if len(key) != value.numel():
            raise ValueError(f"insert: key has {len(key)} tokens but value has {value.numel()} slots")
        usable = len(key) // self.page_size * self.page_size
        if usable < len(key):
            key = key[:usable]
        now = self._tick()
        node, off = self.root, 0
        node.last_access_time = now
        while off < usable:
            child = node.children.get(self._child_key(key, off, extra_key))
            if child is None:
                break
            child.last_access_time = now
            n = self._match_len(child.key, key, off)
            node = self._split(child, n) if n < len(child.key) else child
            self._on_insert_path(node, value, off)
            off += n
            if n < len(child.key):
                break
        if off < usable:
            leaf = self._new_node(
                key[off:usable], value[off:usable].to(device=self.device, dtype=torch.int64).clone(), node, extra_key
            )
            leaf.last_access_time = now
            node.children[self._child_key(key, off, extra_key)] = leaf
            self._leaves.discard(node)
            self._leaves.add(leaf)
            self._evictable_size += usable - off
            if self.enable_kv_events:
                self._emit("stored", leaf)
            self._on_insert_leaf(leaf)
        return off

    def _on_insert_path(self, node: TreeNode, value: torch.Tensor, off: int) -> None:
        """Hook: ``insert`` passes through cached ``node``, which covers ``value[off:]``'s first tokens."""

    def _on_insert_leaf(self, leaf: TreeNode) -> None:
        """Hook: ``insert`` cached new tokens in ``leaf``."""

    # ---------------------------------------------------------------- locking
    def _sized_len(self, node: TreeNode) -> int:
        """Tokens of ``node`` that evictable/protected count: all of them (a tier without device
        slots, as in memory.hiradix_cache, counts none)."""
        return len(node.key)

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Protect the path root..node from eviction; returns the change of evictable_size (<= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root:
            assert node is not None, "node is not attached to this tree"
            if node.lock_ref == 0:
                n = self._sized_len(node)
                self._evictable_size -= n
                self._protected_size += n
                delta -= n
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one ``inc_lock_ref(node)``; returns the change of evictable_size (>= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root:
            assert node is not None, "node is not attached to this tree"
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            if node.lock_ref == 1:
                n = self._sized_len(node)
                self._evictable_size += n
                self._protected_size -= n
                delta += n
            node.lock_ref -= 1
            node = node.parent
        return delta

    # --------------------------------------------------------------- eviction
    def _priority(self, node: TreeNode) -> tuple[int, int, int]:
        if self.eviction_policy == "lfu":
            return (node.hit_count, node.last_access_time, node.id)
        return (node.last_access_time, node.id, 0)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` from unlocked leaves (cascading upwards), or all that is evictable.

        Returns the number of tokens freed; their slots are back in the allocator.
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(self._priority(leaf), leaf) for leaf in self._leaves if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, leaf = heapq.heappop(heap)
            freed.append(leaf.device_value())
            evicted += len(leaf.key)
            self._delete_leaf(leaf)
            parent = leaf.parent
            assert parent is not None
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._priority(parent), parent))
        if freed:
            self.allocator.free(torch.cat(freed))
        return evicted

    def _delete_leaf(self, leaf: TreeNode) -> None:
        parent = leaf.parent
        assert parent is not None
        if self.enable_kv_events:
            self._emit("removed", leaf)
        del parent.children[self._child_key(leaf.key, 0, leaf.extra_key)]
        self._leaves.discard(leaf)
        if parent is not self.root and not parent.children:
            self._leaves.add(parent)
        self._evictable_size -= len(leaf.key)

    # ------------------------------------------------------ request lifecycle
    def _held_len(self, req: CacheRequest) -> int:
        # The tree-owned (locked) part of prefix_indices; an unaligned tail is the request's own.
        return req.cache_handle.prefix_indices.numel() // self.page_size * self.page_size

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """After a prefill chunk: share the prefilled tokens through the tree and lock them for the request.

        Slots the request allocated for tokens that another request cached first are
        freed, and the request's row is pointed at the tree's slots instead.
        """
        handle = req.cache_handle
        kv_len = len(req.fill_ids)
        kv_indices = self._row(req, kv_len)
        if self.disable:
            handle.prefix_indices = kv_indices
            return
        aligned = kv_len // self.page_size * self.page_size
        key = list(req.fill_ids[:aligned])
        held = self._held_len(req)
        present = self.insert(key, kv_indices[:aligned], req.extra_key)
        values, new_last = self._match(key, req.extra_key)
        tree_indices = torch.cat(values) if values else self._empty
        assert tree_indices.numel() == aligned, f"re-match found {tree_indices.numel()} of {aligned} inserted tokens"
        # Remap first, then free the duplicates (their KV equals the tree's copy).
        if aligned > held:
            assert handle.req_pool_idx is not None
            self.req_to_token_pool.write(handle.req_pool_idx, held, tree_indices[held:])
        if present > held:
            self.allocator.free(kv_indices[held:present])
        self.inc_lock_ref(new_last)
        self.dec_lock_ref(handle.last_node)
        handle.last_node = new_last
        handle.prefix_indices = tree_indices if aligned == kv_len else torch.cat((tree_indices, kv_indices[aligned:]))

    def cache_finished_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        """Cache prompt + generated tokens that have KV, free the rest, unlock, and free the request's row.

        ``kv_len`` defaults to :func:`memory.prefix_cache.request_kv_len`.
        """
        if req.cache_handle.req_pool_idx is None:
            self._unlock(req)
            return
        kv_len = request_kv_len(req) if kv_len is None else kv_len
        if self.disable:
            self.release_req(req, kv_len)
            return
        kv_indices = self._row(req, kv_len)
        aligned = kv_len // self.page_size * self.page_size
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:aligned]
        held = self._held_len(req)
        present = self.insert(tokens, kv_indices[:aligned], req.extra_key)
        self.allocator.free_group_begin()
        if present > held:
            self.allocator.free(kv_indices[held:present])  # duplicates of tree slots
        self.allocator.free(kv_indices[aligned:])  # unaligned tail (page_size > 1)
        self.allocator.free_group_end()
        self._free_row(req)
        self._unlock(req)

    def release_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        """Drop a request without caching anything (retract, error): free its own slots, unlock, free its row."""
        if req.cache_handle.req_pool_idx is not None:
            kv_len = request_kv_len(req) if kv_len is None else kv_len
            held = 0 if self.disable else self._held_len(req)
            self.allocator.free(self._row(req, kv_len)[held:])
            self._free_row(req)
        self._unlock(req)

    def _unlock(self, req: CacheRequest) -> None:
        handle = req.cache_handle
        self.dec_lock_ref(handle.last_node)
        handle.last_node = None
        handle.prefix_indices = self._empty
