"""The interface the scheduler programs against: RadixCache and ChunkCache both implement it.

Who frees what (the contract of both caches):

- ``match_prefix`` hands out tree slots; ``match_request`` records them in a request's
  ``CacheHandle`` (:mod:`memory.req_state`). The caller must ``inc_lock_ref(last_node)``
  before allocating anything (allocation may evict unlocked nodes).
- ``attach_rows`` gives requests their ReqToTokenPool rows, starting with their prefix.
- ``cache_unfinished_req`` keeps the request alive: its row then points at canonical
  tree slots; duplicate slots it had allocated are freed here.
- ``cache_finished_req`` ends the request's claim on memory: it inserts what can be
  cached, frees every other KV slot of the request, drops the lock, **and frees the
  request's ReqToTokenPool row** (as SGLang does). The scheduler must not free the row
  again. ``release_req`` does the same without caching anything (retract, errors).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch

from memory.req_state import CacheRequest
from memory.req_to_token_pool import ReqToTokenPool


@dataclass
class MatchResult:
    """Longest cached prefix: its KV slots (int64, on the allocator's device) and the node where it ends.

    With a host tier (:mod:`memory.hiradix_cache`) the prefix may go on past the device part:
    its next ``host_hit_len`` tokens are cached in host memory only, up to ``last_host_node``
    (``last_node`` itself when there is no host part).
    """

    device_indices: torch.Tensor
    last_node: Any
    host_hit_len: int = 0
    last_host_node: Any = None


@dataclass(frozen=True)
class KVCacheEvent:
    """A change of the cached token set, for a cache-aware router.

    ``stored``: tokens ``token_ids[start:]`` became cached after the (already cached)
    prefix ``token_ids[:start]``. ``removed``: tokens ``token_ids[start:]`` were evicted;
    ``token_ids[:start]`` may still be cached. ``cleared``: everything was dropped
    (token_ids empty). Keys are namespaced by ``extra_key``. ``tier`` says which memory the
    tokens entered or left: ``device`` (the KV pool) or ``host`` (the hierarchical cache's
    host pool); ``cleared`` clears both.
    """

    kind: Literal["stored", "removed", "cleared"]
    token_ids: tuple[int, ...]
    start: int
    extra_key: str | None
    tier: Literal["device", "host"] = "device"


@dataclass(frozen=True)
class HitStats:
    """Prefix-cache hit statistics since the last reset (public ``match_prefix`` calls only)."""

    lookups: int
    lookup_tokens: int
    matched_tokens: int

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class BasePrefixCache(abc.ABC):
    """Common interface; see the module docstring for who frees what.

    The cache is the only writer of its requests' ``CacheHandle``: the concrete methods
    below and the implementations' lifecycle methods.
    """

    page_size: int
    req_to_token_pool: ReqToTokenPool
    _empty: torch.Tensor  # int64 [0] on the cache's device: the slots of no prefix

    def match_request(self, req: CacheRequest, key: list[int], count_hit: bool = False) -> None:
        """Record ``key``'s longest cached prefix in ``req``'s handle, unlocked: its device slots and
        end node, and its continuation in a host tier. For a waiting request, which holds no lock.
        Hit statistics are not counted by default (the scheduler counts a request once, not per lookup)."""
        result = self.match_prefix(key, extra_key=req.extra_key, count_hit=count_hit)
        handle = req.cache_handle
        handle.prefix_indices, handle.last_node = result.device_indices, result.last_node
        handle.host_hit_len, handle.last_host_node = result.host_hit_len, result.last_host_node

    def drop_match(self, req: CacheRequest) -> None:
        """A waiting request leaves without running: forget its match (it holds no lock and no row)."""
        handle = req.cache_handle
        handle.prefix_indices = self._empty
        handle.last_node = None
        handle.host_hit_len, handle.last_host_node = 0, None

    def attach_rows(self, reqs: Sequence[CacheRequest]) -> bool:
        """Give each of ``reqs`` (which hold none) a ReqToTokenPool row that starts with its prefix.

        The rows are the requests' until ``cache_finished_req`` / ``release_req`` give them back.
        Returns False, taking none, when the pool has too few free rows."""
        rows = self.req_to_token_pool.alloc(len(reqs))
        if rows is None:
            return False
        for req, row in zip(reqs, rows):
            handle = req.cache_handle
            handle.req_pool_idx = row
            if len(handle.prefix_indices):
                self.req_to_token_pool.write(row, 0, handle.prefix_indices)
        return True

    def detach_rows(self, reqs: Sequence[CacheRequest]) -> None:
        """Undo ``attach_rows(reqs)`` (the prefill they were for could not get its KV slots)."""
        rows = [req.cache_handle.req_pool_idx for req in reqs]
        self.req_to_token_pool.free([row for row in rows if row is not None])
        for req in reqs:
            req.cache_handle.req_pool_idx = None

    def _row(self, req: CacheRequest, length: int) -> torch.Tensor:
        """The KV slots of ``req``'s first ``length`` tokens, from its row (int64)."""
        row = req.cache_handle.req_pool_idx
        assert row is not None, "request holds no ReqToTokenPool row"
        return self.req_to_token_pool.req_to_token[row, :length].to(torch.int64)

    def _free_row(self, req: CacheRequest) -> None:
        """Give ``req``'s row back to the pool (the end of its claim: finish, release)."""
        handle = req.cache_handle
        assert handle.req_pool_idx is not None, "request holds no ReqToTokenPool row"
        self.req_to_token_pool.free(handle.req_pool_idx)
        handle.req_pool_idx = None

    @abc.abstractmethod
    def match_prefix(self, key: list[int], extra_key: str | None = None, count_hit: bool = True) -> MatchResult: ...

    @abc.abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, extra_key: str | None = None) -> int: ...

    @abc.abstractmethod
    def cache_unfinished_req(self, req: CacheRequest) -> None: ...

    @abc.abstractmethod
    def cache_finished_req(self, req: CacheRequest, kv_len: int | None = None) -> None: ...

    @abc.abstractmethod
    def release_req(self, req: CacheRequest, kv_len: int | None = None) -> None: ...

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> int: ...

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> int: ...

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abc.abstractmethod
    def evictable_size(self) -> int: ...

    @abc.abstractmethod
    def protected_size(self) -> int: ...

    @abc.abstractmethod
    def total_size(self) -> int: ...

    @abc.abstractmethod
    def cached_slots(self) -> torch.Tensor:
        """Every KV slot the cache owns (for the invariant checker); int64."""

    @abc.abstractmethod
    def reset(self) -> None: ...

    @abc.abstractmethod
    def hit_stats(self) -> HitStats: ...

    @abc.abstractmethod
    def take_events(self) -> list[KVCacheEvent]: ...


def request_kv_len(req: CacheRequest) -> int:
    """Number of tokens whose KV is in the request's row.

    Once a token has been generated the whole prompt was prefilled and every output but
    the newest has KV (``len(prompt) + len(outputs) - 1``); before that (aborted or
    retracted mid-prefill) it is the prefilled part, ``len(fill_ids)``.
    """
    if req.output_ids:
        return len(req.origin_input_ids) + len(req.output_ids) - 1
    return len(req.fill_ids)
