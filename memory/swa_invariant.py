"""The memory invariant of the SWA pool (models with sliding-window layers).

Every usable SWA slot is either free or the SWA half of exactly one full slot
(``full_to_swa``), and that full slot is held by the tree or a running request, never free.
In numbers: ``swa available + swa evictable + swa protected + request-owned == swa size``,
where the tree's share is what its tokens still map to and a request's share is what the
tokens past its tree prefix still map to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator

_MAX_LISTED = 64


@dataclass
class SWAReport:
    available: int
    evictable: int
    protected: int
    request_owned: int
    size: int
    problems: list[str] = field(default_factory=list)


def check_swa_memory(
    allocator: SWATokenToKVPoolAllocator,
    tree_cache: Any,
    req_to_token_pool: ReqToTokenPool,
    idle: bool,
    active_rows: Mapping[int, int] | None,
) -> SWAReport:
    """Check the SWA pool's accounting and ownership (see the module docstring)."""
    problems: list[str] = []
    mapping = allocator.full_to_swa.cpu()
    n_swa = allocator.swa.num_pages + 1
    swa_free = allocator.swa_free_slot_mask().cpu()
    if allocator.swa_free_count_with_duplicates() != int(swa_free.sum()):
        problems.append("an SWA slot is on the free list twice")
    mapped_full = (mapping > 0).nonzero().flatten()
    targets = mapping[mapped_full]
    if targets.numel() and int(targets.max()) >= n_swa:
        problems.append("full_to_swa points outside the SWA pool")
        targets = targets[targets < n_swa]
    count = torch.bincount(targets, minlength=n_swa)
    double = (count > 1).nonzero().flatten().tolist()
    if double:
        problems.append(f"{len(double)} SWA slots mapped twice: {double[:_MAX_LISTED]}")
    freed_but_mapped = (swa_free & (count > 0)).nonzero().flatten().tolist()
    if freed_but_mapped:
        problems.append(f"{len(freed_but_mapped)} free SWA slots still mapped: {freed_but_mapped[:_MAX_LISTED]}")
    full_free = allocator.free_slot_mask().cpu()
    dangling = mapped_full[full_free[mapped_full]].tolist()
    if dangling:
        problems.append(f"{len(dangling)} free full slots keep an SWA slot: {dangling[:_MAX_LISTED]}")

    tree = tree_cache.cached_slots().to(torch.int64).cpu()
    tree_swa = int((mapping[tree] > 0).sum()) if tree.numel() else 0
    evictable, protected = tree_cache.swa_evictable_size(), tree_cache.swa_protected_size()
    if tree_swa != evictable + protected:
        problems.append(
            f"the tree's tokens hold {tree_swa} SWA slots but swa evictable + protected = {evictable + protected}"
        )
    in_tree = torch.zeros(mapping.numel(), dtype=torch.bool)
    in_tree[tree] = True
    owned = 0
    for row, length in (active_rows or {}).items():
        slots = req_to_token_pool.req_to_token[row, :length].to(torch.int64).cpu()
        own = slots[~in_tree[slots]]
        owned += int((mapping[own] > 0).sum())
    available = allocator.swa_available_size()
    if idle or active_rows is not None:
        used = int((count > 0).sum())
        if available + evictable + protected + owned != allocator.swa_size:
            problems.append(
                f"swa available {available} + evictable {evictable} + protected {protected} + "
                f"request-owned {owned} != swa size {allocator.swa_size}"
            )
        unheld = (~swa_free & (count == 0)).nonzero().flatten()
        leaked = unheld[unheld > 0].tolist()  # slot 0 is padding
        if leaked:
            problems.append(f"{len(leaked)} leaked SWA slots: {leaked[:_MAX_LISTED]}")
        if used != tree_swa + owned:
            problems.append(f"{used} SWA slots are mapped but the tree and the requests hold {tree_swa + owned}")
    return SWAReport(available, evictable, protected, owned, allocator.swa_size, problems)
