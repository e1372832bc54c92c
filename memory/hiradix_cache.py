"""HiRadixCache: the radix tree over two tiers, the device KV pool and a host KV pool.

A node's KV lives on the device (``value``), on the host (``host_value``), or on both.
Two rules keep a match cheap to use:

- the device part of every path is a prefix of it: a node on the device has every
  ancestor on the device (eviction takes device *leaves*, nodes whose children are all
  host-only, and a load brings a whole path back), so ``match_prefix`` returns the device
  part and then the host part after it;
- every node is somewhere: a node that leaves the device without a host copy leaves the
  tree, and its (host-only) subtree with it.

Write policies (SGLang's names): ``write_through`` backs a node up when it is inserted;
``write_back`` only when the device evicts it (synchronously: its device slots are freed
once the copy is done). Either way, device eviction keeps host-backed nodes in the tree
as host-only nodes; host eviction (LRU) takes host-only leaves and drops them.

Ownership: device slots in ``value`` and host slots in ``host_value`` are the tree's. A
node being backed up or loaded is locked (``lock_ref``) from the moment its copy is queued
until the copy completed, so neither tier evicts it meanwhile. Queued copies are issued as
one batch per direction by ``issue_transfers`` (once per scheduler step); the previous
batch is completed first, so on cuda a copy overlaps the step it was issued with.

Sizes: ``evictable_size``/``protected_size`` count device tokens (as in RadixCache);
``host_sizes`` counts host tokens, evictable where the node is host-only and unlocked.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Iterator, Literal

import torch

from memory.allocator import SlotAllocator
from memory.host_pool import HostKVPool
from memory.kv_transfer import KVTransfer, TransferOp
from memory.prefix_cache import KVCacheEvent, MatchResult
from memory.radix_cache import RadixCache
from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.tree_node import TreeNode

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back")


@dataclass
class TierStats:
    """Token counters of the host tier since start (or the last reset)."""

    loaded_tokens: int = 0  # host hits: tokens copied back to the device
    backed_up_tokens: int = 0  # tokens copied to the host
    device_evicted_tokens: int = 0  # tokens evicted from the device (to the host, or dropped)
    device_dropped_tokens: int = 0  # of those, tokens that left the tree (no host copy)
    host_evicted_tokens: int = 0  # tokens evicted from the host (they left the tree)
    load_bytes: int = 0
    load_seconds: float = 0.0  # time the loads took, measured where they were completed
    backup_bytes: int = 0


class HiRadixCache(RadixCache):
    """RadixCache with a host tier; see the module docstring."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: SlotAllocator,
        host_pool: HostKVPool,
        transfer: KVTransfer,
        page_size: int = 1,
        eviction_policy: Literal["lru", "lfu"] = "lru",
        write_policy: str = "write_through",
        enable_kv_events: bool = False,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r} ({' or '.join(WRITE_POLICIES)})")
        if host_pool.page_size != page_size:
            raise ValueError(f"host pool page_size {host_pool.page_size} != page_size {page_size}")
        self.host_pool = host_pool
        self.host_allocator = host_pool.allocator
        self.transfer = transfer
        self.write_policy = write_policy
        self.tier_stats = TierStats()
        self._pending_backups: list[tuple[TreeNode, torch.Tensor, torch.Tensor]] = []
        self._pending_loads: list[tuple[TreeNode, torch.Tensor, torch.Tensor]] = []
        self._inflight: list[tuple[TransferOp, list[TreeNode]]] = []
        self._first_adopted = -1  # insert's offset of the first host-only node it put back on the device
        super().__init__(req_to_token_pool, allocator, page_size, eviction_policy, False, enable_kv_events)

    # ------------------------------------------------------------ bookkeeping
    def reset(self) -> None:
        """Drop both tiers (the caller clears the device allocator). Copies in flight finish
        first (they write slots that are free afterwards); queued ones are dropped."""
        self._complete()
        super().reset()
        self._pending_backups, self._pending_loads = [], []
        self.host_allocator.clear()

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def total_size(self) -> int:
        """Device tokens in the tree, counted by walking it (checks the two device counters)."""
        return sum(len(n.key) for n in self._nodes() if n.value is not None)

    def cached_slots(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n.value is not None]
        return torch.cat(values) if values else self._empty

    def cached_host_slots(self) -> torch.Tensor:
        """Every host slot the tree owns (for the host invariant); int64 on the cpu."""
        values = [n.host_value for n in self._nodes() if n.host_value is not None]
        return torch.cat(values) if values else torch.empty((0,), dtype=torch.int64)

    def host_sizes(self) -> tuple[int, int]:
        """Host tokens (evictable, protected): evictable where the node is host-only and unlocked;
        a node also on the device keeps its host copy until it leaves the tree."""
        evictable = protected = 0
        for node in self._nodes():
            if node.host_value is not None:
                if node.value is None and node.lock_ref == 0:
                    evictable += len(node.key)
                else:
                    protected += len(node.key)
        return evictable, protected

    def host_only_size(self) -> int:
        return sum(len(n.key) for n in self._nodes() if n.value is None)

    def _emit_tier(self, kind: Literal["stored", "removed"], node: TreeNode, tier: Literal["device", "host"]) -> None:
        if self.enable_kv_events:
            tokens, start = self._path_tokens(node)
            self._events.append(KVCacheEvent(kind, tokens, start, node.extra_key, tier))

    def _on_device(self, node: TreeNode, value: torch.Tensor) -> None:
        """``node`` (host-only) gets device slots ``value``: count them in the device sizes."""
        node.value = value
        if node.lock_ref > 0:
            self._protected_size += len(node.key)
        else:
            self._evictable_size += len(node.key)
        self._emit_tier("stored", node, "device")

    # ---------------------------------------------------------------- lookups
    def match_prefix(self, key: list[int], extra_key: str | None = None, count_hit: bool = True) -> MatchResult:
        """Longest cached prefix: the device part's slots and node, then the host-only part's length and node."""
        if count_hit:
            self._lookups += 1
            self._lookup_tokens += len(key)
        usable = len(key) // self.page_size * self.page_size
        dev, dev_node, host, host_node = self._walk(key[:usable], extra_key)
        indices = torch.cat(dev) if len(dev) > 1 else (dev[0] if dev else self._empty)
        host_len = sum(h.numel() for h in host)
        if count_hit:
            self._matched_tokens += indices.numel() + host_len
        return MatchResult(indices, dev_node, host_len, host_node)

    def _match(self, key: list[int], extra_key: str | None) -> tuple[list[torch.Tensor], TreeNode]:
        dev, dev_node, _, _ = self._walk(key, extra_key)
        return dev, dev_node

    def _walk(
        self, key: list[int], extra_key: str | None
    ) -> tuple[list[torch.Tensor], TreeNode, list[torch.Tensor], TreeNode]:
        """The match's device values and last device node, then its host-only values and last node."""
        nodes = self._match_nodes(key, extra_key)
        device = [n.value for n in nodes if n.value is not None]  # a prefix of ``nodes`` (module docstring)
        host_only = nodes[len(device) :]
        host = [n.host_value for n in host_only if n.host_value is not None]
        assert len(host) == len(host_only), "a node with no KV in either tier"
        dev_node = nodes[len(device) - 1] if device else self.root
        last = nodes[-1] if nodes else self.root
        return device, dev_node, host, last

    def _split_values(self, child: TreeNode, upper: TreeNode, split_len: int) -> None:
        """Both tiers' slots split where the key does (either may be None: not in that tier)."""
        value, host = child.value, child.host_value
        upper.value = None if value is None else value[:split_len]
        child.value = None if value is None else value[split_len:]
        upper.host_value = None if host is None else host[:split_len]
        child.host_value = None if host is None else host[split_len:]

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        """Cache ``key -> value``; return how many leading tokens were already on the device.

        Host-only nodes on the path take the request's slots (``value``) as their device
        copy, so the tree owns ``value[returned:]`` of the aligned part, as in RadixCache.
        """
        self._first_adopted = -1
        present = super().insert(key, value, extra_key)
        return present if self._first_adopted < 0 else self._first_adopted

    def _on_insert_path(self, node: TreeNode, value: torch.Tensor, off: int) -> None:
        if node.value is None:  # host-only: the request computed this KV again
            if self._first_adopted < 0:
                self._first_adopted = off
            slots = value[off : off + len(node.key)].to(device=self.device, dtype=torch.int64).clone()
            self._on_device(node, slots)

    def _on_insert_leaf(self, leaf: TreeNode) -> None:
        if self.write_policy == "write_through":
            self._queue_backup(leaf)

    # ---------------------------------------------------------------- locking
    def _sized_len(self, node: TreeNode) -> int:
        """Locks move only device tokens between evictable and protected (host-only nodes have none)."""
        return 0 if node.value is None else len(node.key)

    # -------------------------------------------------------------- transfers
    def _alloc_host(self, num_tokens: int) -> torch.Tensor | None:
        slots = self.host_allocator.alloc(num_tokens)
        if slots is None:
            self.evict_host(num_tokens - self.host_allocator.available_size())
            slots = self.host_allocator.alloc(num_tokens)
        return slots

    def _queue_backup(self, node: TreeNode) -> bool:
        """Give ``node`` host slots and queue its device -> host copy (locked until it completed)."""
        if not self._alloc_host_for(node):
            return False
        self.inc_lock_ref(node)
        self._pending_backups.append((node, node.device_value(), node.host_slots()))
        return True

    def load_back(self, node: TreeNode) -> torch.Tensor | None:
        """Bring the host-only nodes on the path to ``node`` back to the device (a match's host part).

        Returns their new device slots, in path order (empty if none are host-only), or None
        when the device has no room even after eviction. The copy is queued; the nodes stay
        locked until it completed, and ``issue_transfers`` must run before a forward reads them.
        """
        path: list[TreeNode] = []
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root and cur.value is None:
            path.append(cur)
            cur = cur.parent
        if not path:
            return self._empty
        path.reverse()
        num = sum(len(p.key) for p in path)
        self.inc_lock_ref(node)  # the device ancestors must not be evicted to make room
        slots = self.allocator.alloc(num)
        if slots is None:
            self.evict(num - self.allocator.available_size())
            slots = self.allocator.alloc(num)
        if slots is None:
            self.dec_lock_ref(node)
            return None
        off = 0
        for p in path:
            self._on_device(p, slots[off : off + len(p.key)])
            off += len(p.key)
        host = torch.cat([p.host_slots() for p in path])
        self._pending_loads.append((node, slots, host))
        self.tier_stats.loaded_tokens += num
        return slots

    def load_host_prefix(self, req: CacheRequest, room: int) -> int:
        """Bring ``req``'s host part (from its last ``match_request``) to the device when ``room``
        device tokens allow; its prefix then ends at the loaded node. Returns the tokens loaded.

        The match's host part is consumed either way (a later match records a fresh one)."""
        handle = req.cache_handle
        n, node = handle.host_hit_len, handle.last_host_node
        handle.host_hit_len, handle.last_host_node = 0, None
        if n <= 0 or node is None or n > room:
            return 0
        slots = self.load_back(node)
        if slots is None:
            return 0
        handle.prefix_indices = torch.cat((handle.prefix_indices, slots))
        handle.last_node = node
        return int(slots.numel())

    def issue_transfers(self, complete: bool = True) -> None:
        """Issue the queued copies (one batch per direction); first complete the ones issued
        before, unless ``complete`` is False (loads issued while the step's backups still run)."""
        if not (self._inflight or self._pending_backups or self._pending_loads):
            return  # (every scheduler step calls this twice; most have nothing to copy)
        if complete:
            self._complete()
        if self._pending_backups:
            nodes, dev, host = zip(*self._pending_backups)
            self._pending_backups = []
            op = self.transfer.to_host(torch.cat(dev), torch.cat(host))
            self._inflight.append((op, list(nodes)))
        if self._pending_loads:
            nodes, dev, host = zip(*self._pending_loads)
            self._pending_loads = []
            op = self.transfer.to_device(torch.cat(host), torch.cat(dev))
            self._inflight.append((op, list(nodes)))
        if not self.transfer.asynchronous:
            self._complete()

    def wait_transfers(self) -> None:
        """Issue what is queued and wait for every copy: afterwards no node is locked by a copy."""
        self.issue_transfers()
        self._complete()

    def pending_transfers(self) -> int:
        return len(self._pending_backups) + len(self._pending_loads) + len(self._inflight)

    def _complete(self) -> None:
        inflight, self._inflight = self._inflight, []
        for op, nodes in inflight:
            op.wait()
            self._count(op)
            for node in nodes:
                self.dec_lock_ref(node)

    def _count(self, op: TransferOp) -> None:
        stats = self.tier_stats
        if op.to_device:
            stats.load_bytes += op.nbytes
            stats.load_seconds += op.seconds
        else:
            stats.backed_up_tokens += op.num_tokens
            stats.backup_bytes += op.nbytes

    # --------------------------------------------------------------- eviction
    def _is_device_leaf(self, node: TreeNode, leaving: set[TreeNode]) -> bool:
        return (
            node is not self.root
            and node.value is not None
            and node.lock_ref == 0
            and all(c.value is None or c in leaving for c in node.children.values())
        )

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device slots (or all that is evictable), least valuable first.

        A node with a host copy stays in the tree as host-only; one without gets a copy first
        (both policies: write-through's insertion copy may have found the host full) and is
        dropped, with its host-only subtree, when the host has no room for it.
        """
        if num_tokens <= 0:
            return 0
        if self._evictable_size < num_tokens and self.pending_transfers():
            # Nodes being copied are locked: when they are needed (a decode step short of room,
            # a retraction), finish their copies now rather than retract or refuse.
            self.wait_transfers()
        leaving: set[TreeNode] = set()  # being copied to the host, leaving the device after
        heap = [(self._priority(n), n) for n in self._nodes() if self._is_device_leaf(n, leaving)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, node = heapq.heappop(heap)
            if not self._is_device_leaf(node, leaving) or node in leaving:
                continue  # already taken (pushed twice)
            evicted += len(node.key)
            freed.append(node.device_value())
            if node.host_value is not None:
                self._leave_device(node)
            elif self._alloc_host_for(node):
                leaving.add(node)  # still on the device (so host eviction spares it) until copied
            else:
                if any(c in leaving for c in node.children.values()):
                    self._copy_out(leaving)  # its children finish leaving before it drops them
                self.tier_stats.device_dropped_tokens += len(node.key)
                self._drop(node)
            parent = node.parent
            assert parent is not None
            if self._is_device_leaf(parent, leaving):
                heapq.heappush(heap, (self._priority(parent), parent))
        self._copy_out(leaving)
        if freed:
            self.allocator.free(torch.cat(freed))
        self.tier_stats.device_evicted_tokens += evicted
        return evicted

    def _copy_out(self, leaving: set[TreeNode]) -> None:
        """Copy the ``leaving`` nodes to their host slots now; they become host-only."""
        if not leaving:
            return
        nodes = list(leaving)
        op = self.transfer.to_host(
            torch.cat([n.device_value() for n in nodes]), torch.cat([n.host_slots() for n in nodes])
        )
        op.wait()  # the device slots are reused as soon as they are free
        self._count(op)
        for node in nodes:
            self._leave_device(node)
        leaving.clear()

    def _alloc_host_for(self, node: TreeNode) -> bool:
        host = self._alloc_host(len(node.key))
        if host is None:
            return False
        node.host_value = host
        self._emit_tier("stored", node, "host")
        return True

    def _leave_device(self, node: TreeNode) -> None:
        self._evictable_size -= len(node.key)
        self._emit_tier("removed", node, "device")
        node.value = None

    def _drop(self, node: TreeNode) -> None:
        """Remove an unlocked device leaf without a host copy, and its host-only subtree, from the tree."""
        parent = node.parent
        assert parent is not None and node.lock_ref == 0
        self._evictable_size -= len(node.key)
        self._emit_tier("removed", node, "device")
        node.value = None  # its device slots are the caller's to free
        host: list[torch.Tensor] = []
        stack = list(node.children.values())
        while stack:
            sub = stack.pop()
            assert sub.value is None and sub.host_value is not None and sub.lock_ref == 0
            self._emit_tier("removed", sub, "host")
            self._leaves.discard(sub)
            host.append(sub.host_slots())
            stack.extend(sub.children.values())
        del parent.children[self._child_key(node.key, 0, node.extra_key)]
        self._leaves.discard(node)  # RadixCache's leaf set (unused here) must not keep it alive
        if host:
            self.host_allocator.free(torch.cat(host))
            self.tier_stats.host_evicted_tokens += sum(h.numel() for h in host)

    def evict_host(self, num_tokens: int) -> int:
        """Drop at least ``num_tokens`` of host-only, unlocked leaves (cascading upwards), least recently used first."""
        if num_tokens <= 0:
            return 0

        def evictable(n: TreeNode) -> bool:
            return n is not self.root and n.value is None and not n.children and n.lock_ref == 0

        def lru(n: TreeNode) -> tuple[int, int]:  # the host tier is LRU whatever the device's policy
            return (n.last_access_time, n.id)

        heap = [(lru(n), n) for n in self._nodes() if evictable(n)]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        evicted = 0
        while evicted < num_tokens and heap:
            _, node = heapq.heappop(heap)
            assert node.host_value is not None
            freed.append(node.host_value)
            evicted += len(node.key)
            self._emit_tier("removed", node, "host")
            parent = node.parent
            assert parent is not None
            del parent.children[self._child_key(node.key, 0, node.extra_key)]
            self._leaves.discard(node)
            if evictable(parent):
                heapq.heappush(heap, (lru(parent), parent))
        if freed:
            self.host_allocator.free(torch.cat(freed))
        self.tier_stats.host_evicted_tokens += evicted
        return evicted
