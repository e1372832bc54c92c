"""What the prefix caches need to know about a request, and the one record of its cache state.

A request's cache state (its row, the prefix it matched or holds, the lock node, the host
tier's continuation, the SWA bookkeeping) lives in a :class:`CacheHandle` on the request.
The prefix caches own it: only their methods (``match_request``, ``attach_rows`` /
``detach_rows``, ``cache_unfinished_req``, ``cache_finished_req``, ``release_req``,
``drop_match``, the hierarchical cache's ``load_host_prefix`` and the SWA caches'
``free_out_of_window``, through their shared ``swa_allocator.free_own_out_of_window``) write
its fields. Everyone else (the scheduler's policy, adder, batch builder...) reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from memory.tree_node import TreeNode


def _no_slots() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


@dataclass
class CacheHandle:
    """One request's claim on the prefix cache and its ReqToTokenPool row (written by the cache only).

    - ``req_pool_idx``: the request's row in ``ReqToTokenPool`` (None when it holds none). The
      row is taken by the cache's ``attach_rows`` (when the batch builder carries out the
      request's first prefill) and given back by ``cache_finished_req`` / ``release_req``;
      while the request holds it, the entries past its prefix point at slots the request owns.
    - ``prefix_indices``: KV slots of the cached prefix the request matched (waiting) or holds
      (int64). Its page-aligned part is owned by the tree and, once locked, protected by the
      lock on ``last_node``; with page_size > 1 an unaligned tail owned by the request may follow.
    - ``last_node``: where that prefix ends in the tree; the node the request holds a lock on
      once admission locked it (None or the root: none).
    - ``host_hit_len`` / ``last_host_node``: the last match's continuation in the host tier
      (hierarchical cache): tokens cached in host memory only, and the node where they end.
    - ``swa_evicted_len``: leading positions of the row whose SWA slots were given back
      (sliding-window models).
    - ``swa_tree_epoch``: the SWA radix cache's epoch at its last walk of this request's path.
    """

    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=_no_slots)
    last_node: TreeNode | None = None
    host_hit_len: int = 0
    last_host_node: TreeNode | None = None
    swa_evicted_len: int = 0
    swa_tree_epoch: int = -1


@runtime_checkable
class CacheRequest(Protocol):
    """The request state a prefix cache reads, and the handle it updates.

    - ``origin_input_ids`` / ``output_ids``: prompt and generated tokens.
    - ``fill_ids``: the tokens whose KV is in the row now (prompt[:prefilled], plus outputs).
    - ``extra_key``: namespace of the prefix (LoRA id, cache salt...); None for the default.
    - ``cache_handle``: the request's cache state (:class:`CacheHandle`), the cache's to write.
    """

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    extra_key: str | None
    cache_handle: CacheHandle


@dataclass
class SimpleCacheRequest:
    """Minimal concrete CacheRequest, used by tests and benchmarks."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    extra_key: str | None = None
    cache_handle: CacheHandle = field(default_factory=CacheHandle)
