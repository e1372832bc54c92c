"""SWARadixCache: ``RadixCache`` over the hybrid pools of a model with sliding-window layers.

Every cached token keeps its full slot while the tree holds it. Its SWA slot (the windowed
layers' K/V) is only needed while some window can still see the token, so a node whose
tokens no window needs gives its SWA half back and stays in the tree as a *tombstone*: the
full-attention layers can still use it as a prefix, the windowed layers never look at it.

Which windows need a node: a *protected end* keeps the last ``W - 1`` tokens before it live,
the keys a next token there sees. The protected ends are

- every lock (``inc_lock_ref(node)``, taken by a request that matched or cached a prefix
  ending at ``node``): a running request's next tokens;
- every *anchor*, the end of a prefix a lookup reused (``match_prefix``): the next request
  with that prefix matches it only while its last window is live;
- every leaf: the end of a cached sequence (a finished conversation's next turn).

Anchors and leaves are the tree's: only eviction removes them (and the SWA half with the
node). A running request's own tokens past its locked prefix are its own (freed by
``free_out_of_window`` as they leave its window). When a request moves on
(``free_out_of_window``), the nodes on its path that no protected end covers become
tombstones (a node covered in part is split at the covered part's start first): the chunks
it cached itself as it went, and the tree's tokens no window of any kind needs. Its own
match point is an anchor, so reusing a prefix never takes that prefix's window away from
the requests that come next.

Matching: a prefix is usable only up to a point whose last ``W - 1`` tokens are all live
(or that starts at token 0 with every token live): ``match_prefix`` backs off to the last
such point. A finished request whose oldest own tokens lost their SWA half is inserted
with that part as a tombstone. Eviction frees both halves of a node (a tombstone only has
the full one), and goes on until both pools gained what was asked. SGLang's SWARadixCache works the same way in spirit; this is written for
this tree's lock and split rules.
"""

from __future__ import annotations

from typing import Literal

import torch

from memory.prefix_cache import MatchResult, request_kv_len
from memory.radix_cache import RadixCache
from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator, free_own_out_of_window
from memory.tree_node import TreeNode


class SWARadixCache(RadixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        allocator: SWATokenToKVPoolAllocator,
        window: int,
        eviction_policy: Literal["lru", "lfu"] = "lru",
        enable_kv_events: bool = False,
    ) -> None:
        self.window = window
        self.swa_allocator = allocator
        self._guards: dict[TreeNode, int] = {}  # lock end node -> locks held on it
        self._anchors: set[TreeNode] = set()  # ends of prefixes requests reused (kept live until evicted)
        # Bumped whenever a node may have become free of guards (a lock dropped, a prefix inserted):
        # a request's path is walked again only after that (``free_out_of_window``).
        self._epoch = 0
        super().__init__(
            req_to_token_pool, allocator, 1, eviction_policy=eviction_policy, enable_kv_events=enable_kv_events
        )

    # ------------------------------------------------------------ tree shape
    def reset(self) -> None:
        self._guards = {}
        self._anchors = set()
        super().reset()

    def _split_values(self, child: TreeNode, upper: TreeNode, split_len: int) -> None:
        super()._split_values(child, upper, split_len)
        upper.swa_tombstone = child.swa_tombstone
        # (guards and anchors are keyed by end node: the child keeps its end, the upper part is new)

    def _delete_leaf(self, leaf: TreeNode) -> None:
        super()._delete_leaf(leaf)
        self._anchors.discard(leaf)
        self._epoch += 1  # an end that kept its window live is gone: walks may free more

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Root's children down to ``node``, in order."""
        path = []
        cur: TreeNode | None = node
        while cur is not None and cur is not self.root:
            path.append(cur)
            cur = cur.parent
        return path[::-1]

    # ---------------------------------------------------------------- locking
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        if node is not None and node is not self.root and not self.disable:
            self._guards[node] = self._guards.get(node, 0) + 1
        return super().inc_lock_ref(node)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int:
        self._epoch += 1
        return super().insert(key, value, extra_key)

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        self._epoch += 1
        if node is not None and node is not self.root and not self.disable:
            left = self._guards.get(node, 0) - 1
            if left > 0:
                self._guards[node] = left
            else:
                self._guards.pop(node, None)
        return super().dec_lock_ref(node)

    def _protects(self, node: TreeNode) -> bool:
        """Whether ``node``'s end keeps the W - 1 tokens before it live: a lock ends there (a running
        request's next tokens see them), a request reused the prefix ending there (an anchor: the
        tree's, for the next request with that prefix), or it is a leaf (a cached sequence's end)."""
        return node in self._guards or node in self._anchors or not node.children

    def _guarded_from(self, path: list[TreeNode]) -> list[int | None]:
        """For each node of ``path`` (root side first), the first position a protected end (see
        ``_protects``) at or below it keeps live, or None. Off the path only the nodes ending fewer than
        W - 1 tokens below a path node's end are looked at: a deeper end's window starts below it."""
        reach = self.window - 1
        own: list[int | None] = [None] * len(path)  # the smallest start kept by path[i] or its off-path branches
        end = 0
        for i, node in enumerate(path):
            end += len(node.key)
            starts = [max(0, end - reach)] if self._protects(node) else []
            after = path[i + 1] if i + 1 < len(path) else None
            stack = [(child, len(child.key)) for child in node.children.values() if child is not after]
            while stack:
                child, depth = stack.pop()
                if depth >= reach:
                    continue
                if self._protects(child):
                    starts.append(end + depth - reach)  # (its descendants' windows start later)
                    continue
                stack.extend((grand, depth + len(grand.key)) for grand in child.children.values())
            if starts:
                own[i] = min(starts)
        first: list[int | None] = [None] * len(path)
        running: int | None = None
        for i in range(len(path) - 1, -1, -1):
            mine = own[i]
            if mine is not None:
                running = mine if running is None else min(running, mine)
            first[i] = running
        return first

    # ---------------------------------------------------------------- lookups
    def match_prefix(self, key: list[int], extra_key: str | None = None, count_hit: bool = True) -> MatchResult:
        """The longest cached prefix whose windowed layers have what the next token sees."""
        result = super().match_prefix(key, extra_key, count_hit)
        end = int(result.device_indices.numel())
        usable = self._usable_end(result.last_node) if end else 0
        if usable != end:
            if count_hit:
                self._matched_tokens -= end - usable
            values, node = self._match(key[:usable], extra_key)
            result = MatchResult(torch.cat(values) if values else self._empty, node)
        if usable:  # a reused prefix: its last window stays the tree's (no request's walk frees it)
            self._anchors.add(result.last_node)
        return result

    def _usable_end(self, node: TreeNode) -> int:
        """The last end of a node on the path whose preceding W - 1 tokens are all live (0 if none)."""
        best, run_start, pos = 0, 0, 0
        for cur in self._path(node):
            pos += len(cur.key)
            if cur.swa_tombstone:
                run_start = pos
            elif run_start == 0 or pos - (self.window - 1) >= run_start:
                best = pos
        return best

    # --------------------------------------------------------------- eviction
    def evict(self, num_tokens: int) -> int:
        """As ``RadixCache``'s, but until both pools gained ``num_tokens`` slots (or nothing is left to
        evict): a token stores only with both halves, and an evicted tombstone, or the tokens above a
        leaf's last window, give back only their full half, so ``num_tokens`` tokens may free fewer
        SWA slots (the tree's live SWA sits in the windows before protected ends)."""
        if self.disable or num_tokens <= 0:
            return 0
        target = self.allocator.available_size() + num_tokens
        evicted = 0
        while (short := target - self.allocator.available_size()) > 0:
            step = super().evict(short)
            if step == 0:
                break
            evicted += step
        return evicted

    # ------------------------------------------------------ request lifecycle
    def free_out_of_window(self, req: CacheRequest, kv_len: int) -> int:
        """Free the SWA slots ``req``'s next tokens will not see: its own, and the tree's on its
        path that no protected end covers (those nodes become tombstones; the last window of the
        prefix it reused is an anchor's, never freed here). Returns SWA slots freed."""
        handle = req.cache_handle
        freed = free_own_out_of_window(
            self.swa_allocator, self.req_to_token_pool.req_to_token, handle, kv_len, self.window, self._held_len(req)
        )
        node = handle.last_node
        if node is None or node is self.root or self.disable or handle.swa_tree_epoch == self._epoch:
            return freed  # nothing on its path can have lost its guards since the last walk
        handle.swa_tree_epoch = self._epoch
        path = self._path(node)
        limits = self._guarded_from(path)
        pos = 0
        for cur, limit in zip(path, limits):  # (a split below only adds a node above cur's lower part)
            start, pos = pos, pos + len(cur.key)
            if not cur.swa_tombstone:
                if limit is None or limit >= pos:
                    freed += self._tombstone(cur)
                elif limit > start:
                    freed += self._tombstone(self._split(cur, limit - start))
        return freed

    def cache_unfinished_req(self, req: CacheRequest) -> None:
        """As ``RadixCache``'s, after giving the tombstones the chunk lands on its live SWA slots."""
        if not self.disable:
            kv_len = len(req.fill_ids)
            self._revive(list(req.fill_ids[:kv_len]), self._row(req, kv_len), self._held_len(req), req.extra_key)
        super().cache_unfinished_req(req)

    def _revive(self, key: list[int], own: torch.Tensor, start: int, extra_key: str | None) -> None:
        """Tombstones on ``key``'s cached path from ``start`` on take the SWA slots of ``own`` (the
        caller's slots for the same tokens, whose KV is the same): the tree's tokens become live and
        the caller's duplicates keep only their full slots (freed when the tree remaps the row)."""
        values, node = self._match(key, extra_key)
        if not values:
            return
        mapping = self.swa_allocator.full_to_swa
        pos = 0
        for cur in self._path(node):
            a, b = pos, pos + len(cur.key)
            pos = b
            if b <= start or not cur.swa_tombstone:
                continue
            if a < start:  # keep the part before start as it is
                self._split(cur, start - a)
                a = start
            tree, mine = cur.device_value(), own[a:b]
            moved = tree != mine
            mapping[tree[moved]] = mapping[mine[moved]]
            mapping[mine[moved]] = 0
            cur.swa_tombstone = False

    def _tombstone(self, node: TreeNode) -> int:
        node.swa_tombstone = True
        return self.swa_allocator.free_swa(node.device_value())

    def cache_finished_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        """As ``RadixCache``'s, with the request's own tokens that lost their SWA slots inserted as a tombstone."""
        handle = req.cache_handle
        if handle.req_pool_idx is None or self.disable:
            super().cache_finished_req(req, kv_len)
            handle.swa_evicted_len = 0
            return
        kv_len = request_kv_len(req) if kv_len is None else kv_len
        kv_indices = self._row(req, kv_len)
        tokens = (list(req.origin_input_ids) + list(req.output_ids))[:kv_len]
        held = self._held_len(req)
        evicted = min(handle.swa_evicted_len, kv_len)
        self._revive(tokens, kv_indices, max(held, evicted), req.extra_key)
        present = self.insert(tokens, kv_indices, req.extra_key)
        if evicted > present:  # the new leaf's first evicted - present tokens have no SWA half
            _, node = self._match(tokens[:evicted], req.extra_key)
            self._tombstone(node)
        if present > held:
            self.allocator.free(kv_indices[held:present])  # duplicates of tree slots
        self._free_row(req)
        self._unlock(req)
        handle.swa_evicted_len = 0

    def release_req(self, req: CacheRequest, kv_len: int | None = None) -> None:
        super().release_req(req, kv_len)
        req.cache_handle.swa_evicted_len = 0

    # ------------------------------------------------------------- accounting
    def _live_sizes(self) -> tuple[int, int]:
        evictable = protected = 0
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.swa_tombstone:
                if node.lock_ref > 0:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
        return evictable, protected

    def swa_evictable_size(self) -> int:
        """Cached tokens with an SWA slot in unlocked nodes (eviction gives it back)."""
        return self._live_sizes()[0]

    def swa_protected_size(self) -> int:
        """Cached tokens with an SWA slot in locked nodes."""
        return self._live_sizes()[1]
