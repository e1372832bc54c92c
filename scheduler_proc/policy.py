"""Schedule policies: the order in which waiting requests are offered to the PrefillAdder.

Cache-aware policies (lpm, dfs-weight) match every waiting request against the
radix tree first; on a long queue that costs more than it saves, so they fall
back to fcfs (as SGLang does), and with the radix cache disabled they are fcfs.

With ``--enable-priority-scheduling`` the policy's order is then sorted by priority,
larger first; the sort is stable, so requests of equal priority keep the policy's order
(fcfs: arrival, with retracted requests first). Without it nothing is sorted: the
no-priority path costs what it did.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any, Sequence

from memory.prefix_cache import BasePrefixCache
from memory.radix_cache import RadixCache
from scheduler_proc import input_logprobs
from scheduler_proc.req import Req

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
CACHE_AWARE = ("lpm", "dfs-weight")
# Beyond this many waiting requests, matching each one every step costs too much.
CACHE_AWARE_QUEUE_LIMIT = 128


def _negated_priority(req: Req) -> int:
    return -req.priority


class SchedulePolicy:
    def __init__(
        self, policy: str, tree_cache: BasePrefixCache, radix_enabled: bool, seed: int = 0, priority: bool = False
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy = policy
        self.tree_cache = tree_cache
        self.radix_enabled = radix_enabled
        self._rng = random.Random(seed)
        self.priority = priority  # sort by Req.priority (larger first) after the policy

    def order(self, waiting: Sequence[Req]) -> list[Req]:
        """Return the waiting queue in the order to try admitting (a new list)."""
        ordered = self._policy_order(waiting)
        if self.priority:
            ordered.sort(key=_negated_priority)  # stable: equal priorities keep the policy's order
        return ordered

    def effective_policy(self, queue_len: int) -> str:
        if self.policy in CACHE_AWARE and (not self.radix_enabled or queue_len > CACHE_AWARE_QUEUE_LIMIT):
            return "fcfs"
        return self.policy

    def _policy_order(self, waiting: Sequence[Req]) -> list[Req]:
        """The waiting queue in the schedule policy's order (a new list)."""
        policy = self.effective_policy(len(waiting))
        if policy == "fcfs":
            return list(waiting)
        if policy == "lof":
            return sorted(waiting, key=lambda r: -r.sampling_params.max_new_tokens)
        if policy == "random":
            shuffled = list(waiting)
            self._rng.shuffle(shuffled)
            return shuffled
        for req in waiting:
            self.match(req)
        if policy == "lpm":
            # Stable sort: ties keep arrival order. A host-tier hit counts: it is loaded, not computed.
            return sorted(waiting, key=lambda r: -len(r.cache_handle.prefix_indices) - r.cache_handle.host_hit_len)
        return self._dfs_weight(waiting)

    def match(self, req: Req) -> None:
        """Match ``req``'s known tokens against the tree (the cache records the match in the request's
        handle); at least one token is left to compute, and every prompt position whose logits its
        prompt logprobs still need."""
        known = req.known_ids()
        end = len(known) - 1
        limit = input_logprobs.match_limit(req)  # prompt logprobs need the logits from there on
        if limit is not None:
            end = min(end, limit)
        # Hit statistics are counted once per request by the scheduler, not per lookup here.
        self.tree_cache.match_request(req, known[:end])

    def _dfs_weight(self, waiting: Sequence[Req]) -> list[Req]:
        """Visit the tree depth first, heaviest subtree (most waiting requests) first.

        Requests that share a prefix run back to back, so the shared part is
        computed once and stays cached while its siblings use it.
        """
        by_node: dict[Any, list[Req]] = defaultdict(list)
        for req in waiting:
            by_node[req.cache_handle.last_node].append(req)
        weight: dict[Any, int] = defaultdict(int)
        children: dict[Any, list[Any]] = defaultdict(list)
        # (cache-aware policies run only over a radix tree: effective_policy falls back to fcfs otherwise)
        assert isinstance(self.tree_cache, RadixCache), "dfs-weight needs a radix tree"
        root = self.tree_cache.root
        for node, reqs in by_node.items():
            # Walk up to the root, adding this node's requests to every ancestor.
            cur, prev = node, None
            while cur is not None:
                if prev is not None and prev not in children[cur]:
                    children[cur].append(prev)
                weight[cur] += len(reqs)
                if cur is root:
                    break
                prev, cur = cur, cur.parent
        # Post-order: a node's heavier children first, then the requests ending at the node
        # itself, so requests that extend a shared prefix run next to each other.
        ordered: list[Req] = []
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                ordered.extend(by_node.get(node, []))
                continue
            stack.append((node, True))
            # Pushed lightest first, so the heaviest child is visited first.
            for child in sorted(children.get(node, []), key=lambda c: weight[c]):
                stack.append((child, False))
        return ordered
