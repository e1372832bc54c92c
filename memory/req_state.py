"""What the prefix caches need to know about a request.

The scheduler's ``Req`` satisfies :class:`CacheRequest` structurally; the caches read
and *write* these attributes (``prefix_indices``, ``last_node``, and on finish
``req_pool_idx``), so they must be plain settable attributes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class CacheRequest(Protocol):
    """The request state a prefix cache reads and updates.

    - ``req_pool_idx``: the request's row in ``ReqToTokenPool`` (None when it holds none).
    - ``origin_input_ids`` / ``output_ids``: prompt and generated tokens.
    - ``fill_ids``: the tokens whose KV is in the row now (prompt[:prefilled], plus outputs).
    - ``prefix_indices``: KV slots of the cached prefix the request holds (int64). Its
      page-aligned part is owned by the tree and protected by the lock on ``last_node``;
      with page_size > 1 an unaligned tail owned by the request may follow.
    - ``last_node``: the tree node the request holds a lock on (None or the root: none).
    - ``extra_key``: namespace of the prefix (LoRA id, cache salt...); None for the default.
    """

    req_pool_idx: int | None
    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: Any
    extra_key: str | None


@dataclass
class SimpleCacheRequest:
    """Minimal concrete CacheRequest, used by tests and benchmarks."""

    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    fill_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty((0,), dtype=torch.int64))
    last_node: Any = None
    extra_key: str | None = None
