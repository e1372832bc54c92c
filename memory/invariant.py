"""The memory invariant: every KV slot is free, cached by the tree, or held by a running request.

The scheduler calls :func:`check_memory_invariant` whenever it goes idle (and server
info exposes the report). Idle means no running request: then nothing may be
protected, every ReqToTokenPool row must be free, and every slot is either free or
cached (``available + evictable + protected == max_total_tokens``). A violation names
the leaked slots so the bug can be traced to the code path that dropped them.

While requests run, pass ``active_rows`` (row index -> number of valid entries) to
account for the slots they own as well; without it only the cheaper checks run.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memory.allocator import BaseTokenToKVPoolAllocator
from memory.prefix_cache import BasePrefixCache
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator
from memory.swa_invariant import check_swa_memory

logger = logging.getLogger(__name__)

_MAX_LISTED = 64


@dataclass
class InvariantReport:
    ok: bool
    available: int
    evictable: int
    protected: int
    leaked_slots: list[int] = field(default_factory=list)
    double_owned_slots: list[int] = field(default_factory=list)
    message: str = ""
    # Models with sliding-window layers: the SWA pool's numbers (memory.swa_invariant.SWAReport).
    swa: dict[str, Any] | None = None


def check_memory_invariant(
    allocator: BaseTokenToKVPoolAllocator | SWATokenToKVPoolAllocator,
    tree_cache: BasePrefixCache,
    req_to_token_pool: ReqToTokenPool,
    max_total_tokens: int,
    idle: bool,
    active_rows: Mapping[int, int] | None = None,
) -> InvariantReport:
    """Check the accounting and ownership of every KV slot; log and return what is wrong."""
    p = allocator.page_size
    hybrid = allocator if isinstance(allocator, SWATokenToKVPoolAllocator) else None
    # (the full pool's own count: a hybrid SWA allocator's available_size is the smaller of its two pools)
    available = hybrid.full_available_size() if hybrid is not None else allocator.available_size()
    evictable = tree_cache.evictable_size()
    protected = tree_cache.protected_size()
    problems: list[str] = []

    n_slots = (allocator.num_pages + 1) * p
    usable = torch.ones(n_slots, dtype=torch.bool)
    usable[:p] = False  # the padding page (slot 0) belongs to nobody
    free = allocator.free_slot_mask().cpu()
    double: set[int] = set()
    if allocator.free_page_count_with_duplicates() * p != int(free.sum()):
        problems.append("a page is on the free list twice")

    tree_slots = tree_cache.cached_slots().cpu()
    if tree_slots.numel() and (int(tree_slots.min()) < p or int(tree_slots.max()) >= n_slots):
        problems.append("the tree references slots outside the pool")
        tree_slots = tree_slots[(tree_slots >= p) & (tree_slots < n_slots)]
    tree_count = torch.bincount(tree_slots, minlength=n_slots)
    in_tree = tree_count > 0
    double.update((tree_count > 1).nonzero().flatten().tolist())
    double.update((free & in_tree).nonzero().flatten().tolist())
    if int(in_tree.sum()) != evictable + protected:
        problems.append(
            f"tree holds {int(in_tree.sum())} distinct slots but evictable + protected = {evictable + protected}"
        )

    # Pages owned by running requests (slots in their rows that the tree does not own).
    owners = torch.zeros(allocator.num_pages + 1, dtype=torch.int64)
    for row, length in (active_rows or {}).items():
        slots = req_to_token_pool.req_to_token[row, :length].to(torch.int64).cpu()
        if length and (int(slots.min()) < p or int(slots.max()) >= n_slots):
            problems.append(f"request row {row} references slots outside the pool")
            continue
        double.update(slots[free[slots]].tolist())
        owners[torch.unique(slots[~in_tree[slots]] // p)] += 1
    for page in (owners > 1).nonzero().flatten().tolist():
        double.update(range(page * p, (page + 1) * p))
    own = (owners > 0).repeat_interleave(p) & ~in_tree

    if idle:
        if protected != 0:
            problems.append(f"protected_size is {protected} while idle")
        if req_to_token_pool.available_size() != req_to_token_pool.size:
            problems.append(
                f"{req_to_token_pool.size - req_to_token_pool.available_size()} request rows are still allocated while idle"
            )
    accounted = available + evictable + protected + int(own.sum())
    if (idle or active_rows is not None) and accounted != max_total_tokens:
        problems.append(
            f"available {available} + evictable {evictable} + protected {protected} + request-owned {int(own.sum())}"
            f" = {accounted} != max_total_tokens {max_total_tokens}"
        )
    elif accounted > max_total_tokens:
        problems.append(f"accounted {accounted} tokens > max_total_tokens {max_total_tokens}")

    leaked: list[int] = []
    if idle or active_rows is not None:
        leaked = (usable & ~free & ~in_tree & ~own).nonzero().flatten().tolist()
        if leaked:
            problems.append(f"{len(leaked)} leaked slots: {leaked[:_MAX_LISTED]}")
    double_owned = sorted(double)
    if double_owned:
        problems.append(f"{len(double_owned)} slots owned twice: {double_owned[:_MAX_LISTED]}")
    swa = None
    if hybrid is not None:  # the SWA pool too (memory.swa_invariant)
        swa_report = check_swa_memory(hybrid, tree_cache, req_to_token_pool, idle, active_rows)
        problems.extend(swa_report.problems)
        swa = dataclasses.asdict(swa_report)

    message = "; ".join(problems) if problems else "ok"
    if problems:
        logger.error("memory invariant violated: %s", message)
    return InvariantReport(not problems, available, evictable, protected, leaked, double_owned, message, swa)


def check_host_invariant(
    host_allocator: BaseTokenToKVPoolAllocator, host_slots: torch.Tensor, host_evictable: int, host_protected: int
) -> InvariantReport:
    """The host tier of a hierarchical cache (:mod:`memory.hiradix_cache`): every host slot is free or
    held by exactly one tree node (``host_slots``: all of them, in any order), and
    ``available + evictable + protected == host size``. Host slots belong to the tree alone,
    so this holds whether or not requests are running."""
    p = host_allocator.page_size
    available = host_allocator.available_size()
    problems: list[str] = []
    n_slots = (host_allocator.num_pages + 1) * p
    usable = torch.ones(n_slots, dtype=torch.bool)
    usable[:p] = False
    free = host_allocator.free_slot_mask()
    if host_allocator.free_page_count_with_duplicates() * p != int(free.sum()):
        problems.append("a host page is on the free list twice")
    slots = host_slots.to(torch.int64).cpu()
    if slots.numel() and (int(slots.min()) < p or int(slots.max()) >= n_slots):
        problems.append("the tree references host slots outside the host pool")
        slots = slots[(slots >= p) & (slots < n_slots)]
    count = torch.bincount(slots, minlength=n_slots)
    held = count > 0
    double = sorted(set((count > 1).nonzero().flatten().tolist()) | set((free & held).nonzero().flatten().tolist()))
    if int(held.sum()) != host_evictable + host_protected:
        problems.append(
            f"the tree holds {int(held.sum())} distinct host slots but host evictable + protected = "
            f"{host_evictable + host_protected}"
        )
    accounted = available + host_evictable + host_protected
    if accounted != host_allocator.size:
        problems.append(
            f"host available {available} + evictable {host_evictable} + protected {host_protected}"
            f" = {accounted} != host size {host_allocator.size}"
        )
    leaked = (usable & ~free & ~held).nonzero().flatten().tolist()
    if leaked:
        problems.append(f"{len(leaked)} leaked host slots: {leaked[:_MAX_LISTED]}")
    if double:
        problems.append(f"{len(double)} host slots owned twice: {double[:_MAX_LISTED]}")
    message = "; ".join(problems) if problems else "ok"
    if problems:
        logger.error("host memory invariant violated: %s", message)
    return InvariantReport(not problems, available, host_evictable, host_protected, leaked, double, message)
