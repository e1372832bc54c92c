"""The interface the scheduler programs against: RadixCache and ChunkCache both implement it.

Who frees what (the contract of both caches):

- ``match_prefix`` hands out tree slots; the caller must ``inc_lock_ref(last_node)``
  before allocating anything (allocation may evict unlocked nodes).
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
from typing import Any, Literal

import torch

from memory.req_state import CacheRequest


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
    """Common interface; see the module docstring for who frees what."""

    page_size: int

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
