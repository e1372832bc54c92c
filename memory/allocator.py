"""KV-slot allocators: who may write which rows of the MHATokenToKVPool.

Ownership: the allocator owns every *free* KV slot. A slot it hands out belongs to
the caller (a running request's ``req_to_token`` row) until it is either freed back
here or inserted into the prefix cache, which then owns it until eviction frees it.
Slot 0 (page 0 when paged) is the padding slot of the KV pool and is never handed out.

The free list is an int64 tensor of free *pages* (a page is one token when
``page_size == 1``), so the hot path is a slice and a ``torch.cat`` -- no Python loop
over tokens. Freed pages go to ``release_pages`` and are merged (sorted) into
``free_pages`` only when an allocation would otherwise fall short; that keeps
allocation cheap and keeps handed-out slots roughly contiguous.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

AllocatorState = tuple[torch.Tensor, torch.Tensor]


class SlotAllocator(Protocol):
    """What the prefix caches use of a KV-slot allocator: ``BaseTokenToKVPoolAllocator``'s
    subclasses and the hybrid ``memory.swa_allocator.SWATokenToKVPoolAllocator`` both have it."""

    page_size: int
    device: torch.device

    def available_size(self) -> int: ...

    def alloc(self, need_size: int) -> torch.Tensor | None: ...

    def free(self, free_index: torch.Tensor) -> None: ...

    def free_group_begin(self) -> None: ...

    def free_group_end(self) -> None: ...


class FreeGroup:
    """Batched frees, shared by every allocator: between ``free_group_begin`` and
    ``free_group_end`` the slots passed to ``free`` are collected (``_defer_free``) and given
    back with one call at the end. The allocator that inherits it owns the collected slots
    until then, and sets ``device``, ``_in_free_group`` and ``_free_group`` up."""

    device: torch.device
    _in_free_group: bool
    _free_group: list[torch.Tensor]

    def free(self, free_index: torch.Tensor) -> None:
        raise NotImplementedError

    def _defer_free(self, free_index: torch.Tensor) -> bool:
        """True when ``free`` has nothing to do now: no slots, or a free group collects them."""
        if free_index.numel() == 0:
            return True
        if self._in_free_group:
            self._free_group.append(free_index)
            return True
        return False

    def free_group_begin(self) -> None:
        """Collect frees until ``free_group_end`` and return them with one concatenation."""
        self._in_free_group = True
        self._free_group = []

    def free_group_end(self) -> None:
        self._in_free_group = False
        group, self._free_group = self._free_group, []
        if group:
            self.free(torch.cat([g.to(device=self.device, dtype=torch.int64) for g in group]))


class BaseTokenToKVPoolAllocator(FreeGroup):
    """Page-granular allocator; ``page_size == 1`` is the token-granular special case.

    Slots are ``page * page_size + offset`` for pages ``1 .. size // page_size``.
    Every allocation method returns None and changes nothing when there is not
    enough room. ``debug=True`` validates every free (range, double free); it costs
    an O(size) mask per call, so it is meant for tests.
    """

    def __init__(self, size: int, page_size: int, device: str | torch.device, debug: bool = False) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        if size < page_size:
            raise ValueError(f"allocator size {size} is smaller than one page ({page_size})")
        self.page_size = page_size
        self.num_pages = size // page_size
        # Usable token capacity; a size that is not a page multiple loses its remainder.
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.debug = debug
        self.free_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._in_free_group = False
        self._free_group: list[torch.Tensor] = []
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        """Make every page free again (after a cache flush, or between tests)."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.release_pages = torch.empty((0,), dtype=torch.int64, device=self.device)
        self._in_free_group = False
        self._free_group = []

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return (self.free_pages.numel() + self.release_pages.numel()) * self.page_size

    def backup_state(self) -> AllocatorState:
        """Snapshot the free lists; tensors are never mutated in place, so no copy is needed."""
        return (self.free_pages, self.release_pages)

    def restore_state(self, state: AllocatorState) -> None:
        self.free_pages, self.release_pages = state

    def free_slot_mask(self) -> torch.Tensor:
        """Bool mask over slots ``0 .. (num_pages + 1) * page_size``: True where the slot is free."""
        pages = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        pages[self.free_pages] = True
        pages[self.release_pages] = True
        return pages.repeat_interleave(self.page_size)

    def free_page_count_with_duplicates(self) -> int:
        """Number of entries in the free lists (equals the distinct count unless a page was freed twice)."""
        return self.free_pages.numel() + self.release_pages.numel()

    # ------------------------------------------------------------- allocation
    def _take_pages(self, num_pages: int) -> torch.Tensor | None:
        if num_pages > self.free_pages.numel() and self.release_pages.numel() > 0:
            self._merge_and_sort_free()
        if num_pages > self.free_pages.numel():
            return None
        taken = self.free_pages[:num_pages]
        self.free_pages = self.free_pages[num_pages:]
        return taken

    def _merge_and_sort_free(self) -> None:
        merged = torch.cat((self.free_pages, self.release_pages))
        self.free_pages = torch.sort(merged).values
        self.release_pages = self.release_pages[:0]

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Take ``need_size`` slots (a multiple of page_size: whole pages) or return None."""
        if need_size < 0 or need_size % self.page_size != 0:
            raise ValueError(f"alloc({need_size}) must be a non-negative multiple of page_size {self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self._pages_to_slots(pages)

    def _pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
    ) -> torch.Tensor | None:
        """Slots for positions ``prefix_lens[i] .. seq_lens[i]`` of each request, packed in order.

        A request whose prefix ends inside a page first fills that page (the slots
        right after ``last_loc[i]``, the slot of its last stored token), then takes
        fresh pages. ``last_loc[i]`` is ignored when ``prefix_lens[i] == 0``.
        """
        prefix_lens = prefix_lens.to(torch.int64)
        seq_lens = seq_lens.to(torch.int64)
        if self.debug:
            expected = int((seq_lens - prefix_lens).sum().item())
            if expected != extend_num_tokens:
                raise ValueError(f"extend_num_tokens {extend_num_tokens} != sum(seq_lens - prefix_lens) {expected}")
        if self.page_size == 1:
            return self.alloc(extend_num_tokens)
        p = self.page_size
        # Pass CPU lengths: this count is then computed on the host without a device sync.
        num_new_pages = int(((seq_lens + p - 1) // p - (prefix_lens + p - 1) // p).sum().item())
        pages = self._take_pages(num_new_pages)
        if pages is None:
            return None
        dev = self.device
        prefix_lens = prefix_lens.to(dev)
        seq_lens = seq_lens.to(dev)
        last_loc = last_loc.to(device=dev, dtype=torch.int64)
        extend_lens = seq_lens - prefix_lens
        req_of_token = torch.repeat_interleave(
            torch.arange(extend_lens.numel(), device=dev), extend_lens, output_size=extend_num_tokens
        )
        token_starts = torch.cumsum(extend_lens, 0) - extend_lens
        pos = prefix_lens[req_of_token] + torch.arange(extend_num_tokens, device=dev) - token_starts[req_of_token]
        first_new_page_pos = ((prefix_lens + p - 1) // p * p)[req_of_token]
        pages_per_req = (seq_lens + p - 1) // p - (prefix_lens + p - 1) // p
        page_starts = torch.cumsum(pages_per_req, 0) - pages_per_req
        in_partial = pos < first_new_page_pos
        partial_slot = last_loc[req_of_token] + (pos - prefix_lens[req_of_token]) + 1
        page_idx = (page_starts[req_of_token] + (pos - first_new_page_pos) // p).clamp(min=0)
        if pages.numel() == 0:
            return partial_slot
        new_slot = pages[page_idx.clamp(max=pages.numel() - 1)] * p + pos % p
        return torch.where(in_partial, partial_slot, new_slot)

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for its newest token; ``seq_lens`` count that token already.

        A request takes a new page only when the token starts one
        (``(seq_len - 1) % page_size == 0``); otherwise it gets ``last_loc + 1``.
        """
        if self.page_size == 1:
            return self.alloc(seq_lens.numel())
        p = self.page_size
        seq_lens = seq_lens.to(torch.int64)
        needs_page = (seq_lens - 1) % p == 0
        pages = self._take_pages(int(needs_page.sum().item()))
        if pages is None:
            return None
        dev = self.device
        needs_page = needs_page.to(dev)
        last_loc = last_loc.to(device=dev, dtype=torch.int64)
        if pages.numel() == 0:
            return last_loc + 1
        page_idx = (torch.cumsum(needs_page.to(torch.int64), 0) - 1).clamp(min=0)
        return torch.where(needs_page, pages[page_idx] * p, last_loc + 1)

    # ------------------------------------------------------------------- free
    def free(self, free_index: torch.Tensor) -> None:
        """Give slots back. Paged: a page is freed once however many of its slots are passed."""
        if self._defer_free(free_index):
            return
        free_index = free_index.to(device=self.device, dtype=torch.int64)
        pages = free_index if self.page_size == 1 else torch.unique(free_index // self.page_size)
        if self.debug:
            self._check_free(pages)
        self.release_pages = torch.cat((self.release_pages, pages))

    def _check_free(self, pages: torch.Tensor) -> None:
        if pages.numel() and (int(pages.min()) < 1 or int(pages.max()) > self.num_pages):
            raise ValueError(f"freeing slots outside pages 1..{self.num_pages}: pages {pages.tolist()}")
        if self.page_size == 1 and torch.unique(pages).numel() != pages.numel():
            raise ValueError(f"the same slot is freed twice in one call: {pages.tolist()}")
        free = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        free[self.free_pages] = True
        free[self.release_pages] = True
        again = pages[free[pages]]
        if again.numel():
            raise ValueError(f"double free of pages {again.tolist()} (page_size {self.page_size})")


class TokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Token-granular allocator (page_size 1): slots ``1 .. size``."""

    def __init__(self, size: int, device: str | torch.device, page_size: int = 1, debug: bool = False) -> None:
        if page_size != 1:
            raise ValueError("TokenToKVPoolAllocator is for page_size 1; use PagedTokenToKVPoolAllocator")
        super().__init__(size, 1, device, debug)


class PagedTokenToKVPoolAllocator(BaseTokenToKVPoolAllocator):
    """Page-granular allocator: pages ``1 .. size // page_size``, whole pages per allocation."""

    def __init__(self, size: int, page_size: int, device: str | torch.device, debug: bool = False) -> None:
        super().__init__(size, page_size, device, debug)
