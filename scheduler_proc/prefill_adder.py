"""PrefillAdder: decides which waiting requests fit into the next prefill batch.

The token budget is what the KV pool can still give (free + evictable slots)
minus what the running requests are expected to need to finish decoding,
scaled by ``new_token_ratio`` (not every request runs to max_new_tokens). A
prompt longer than the remaining chunk budget is truncated to a chunk and
becomes the batch's chunked request; its prefix is cached between chunks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from memory.allocator import SlotAllocator
from memory.prefix_cache import BasePrefixCache
from scheduler_proc.req import Req

if TYPE_CHECKING:
    from scheduler_proc.hicache import HostTier

# A request's future decode reservation is clipped so one huge max_new_tokens
# cannot block admission of everyone else (SGLang uses the same idea).
CLIP_MAX_NEW_TOKENS = 4096


class AddResult(enum.Enum):
    CONTINUE = 0  # added; more may fit
    NO_TOKEN = 1  # out of KV budget: stop adding
    OTHER = 2  # some other limit (batch input tokens, running requests): stop adding


@dataclass(frozen=True)
class PlannedExtend:
    """One request of a prefill plan: ``extend_len`` tokens after its locked cached prefix."""

    req: Req
    prefix_len: int
    extend_len: int

    @property
    def chunked(self) -> bool:
        """Only part of the request's known tokens is computed; it continues next round."""
        return self.prefix_len + self.extend_len < self.req.seqlen


@dataclass
class PrefillPlan:
    """What admission decided for the next prefill; the batch builder carries it out.

    ``rejected`` requests can never run (bigger than the whole pool); ``deferred_chunk`` is a
    chunked request whose next chunk found no room this round (it keeps its locked prefix).
    ``blocked`` (only with --priority-preemption): the request admission stopped at for want of
    KV memory (``blocked_shortfall`` tokens short) or of a request slot (shortfall 0); running
    requests of lower priority may give way to it (``scheduler_proc.priority``).
    """

    items: list[PlannedExtend] = field(default_factory=list)
    rejected: list[Req] = field(default_factory=list)
    deferred_chunk: Req | None = None
    blocked: Req | None = None
    blocked_shortfall: int = 0

    @property
    def reqs(self) -> list[Req]:
        return [item.req for item in self.items]

    @property
    def chunked_req(self) -> Req | None:
        """The request cut to a chunk, if any (always the plan's last)."""
        return self.items[-1].req if self.items and self.items[-1].chunked else None


def reserved_decode_tokens(req: Req, new_token_ratio: float) -> int:
    """KV a running request is expected to still need, per the current ratio."""
    return int(min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS) * new_token_ratio)


def round_down(n: int, page_size: int) -> int:
    return n - n % page_size


def kv_slots_for_extend(prefix_len: int, seq_len: int, page_size: int) -> int:
    """KV slots an extend from ``prefix_len`` to ``seq_len`` tokens takes: whole new pages
    (the prefix's partly used last page is filled first)."""
    pages = -(-seq_len // page_size) - -(-prefix_len // page_size)
    return pages * page_size


class PrefillAdder:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        allocator: SlotAllocator,
        running_reqs: Sequence[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        max_running_requests: int,
        page_size: int = 1,
        host_tier: HostTier | None = None,
    ) -> None:
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.host_tier = host_tier
        self.page_size = page_size
        self.rem_total_tokens = (
            allocator.available_size()
            + tree_cache.evictable_size()
            - sum(reserved_decode_tokens(r, new_token_ratio) for r in running_reqs)
        )
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size if chunked_prefill_size else None
        self.rem_running_slots = max_running_requests - len(running_reqs)
        self.planned: list[PlannedExtend] = []
        # On an idle server the first request is admitted on its prompt alone: a
        # reservation larger than the pool must not block it forever (it may stop
        # early; if it outgrows the pool, decode finishes it with an error).
        self.server_idle = not running_reqs
        self.new_chunked_req: Req | None = None
        # KV tokens the last request refused with NO_TOKEN lacked (its prefix lock charged).
        self.shortfall = 0

    @property
    def can_run(self) -> list[Req]:
        return [item.req for item in self.planned]

    def _lock(self, req: Req) -> int:
        """Lock the request's prefix. Locked tokens are no longer evictable: charge them, return the charge.

        With a host tier the prefix first grows by its host part, loaded into free (or evicted)
        slots: those are charged too, and count as cached tokens, not as prefill work."""
        before = self.allocator.available_size() + self.tree_cache.evictable_size()
        if self.host_tier is not None:
            self.host_tier.load_prefix(req, self.rem_total_tokens - len(req.cache_handle.prefix_indices))
        self.tree_cache.inc_lock_ref(req.cache_handle.last_node)
        charged = before - self.allocator.available_size() - self.tree_cache.evictable_size()
        self.rem_total_tokens -= charged
        return charged

    def _unlock(self, req: Req, charged: int) -> None:
        self.tree_cache.dec_lock_ref(req.cache_handle.last_node)
        self.rem_total_tokens += charged

    def add_chunked_req(self, req: Req) -> AddResult:
        """Continue a chunked prefill (its prefix is already locked)."""
        return self._add(req, locked=True)

    def add_one_req(self, req: Req) -> AddResult:
        if self.rem_running_slots <= 0:
            return AddResult.OTHER
        return self._add(req, locked=False)

    def _add(self, req: Req, locked: bool) -> AddResult:
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddResult.OTHER
        # Lock first: the request's own prefix stops being evictable room (SGLang does the same).
        charged = 0 if locked else self._lock(req)
        prefix_len = len(req.cache_handle.prefix_indices)
        extend_len = req.seqlen - prefix_len
        need = kv_slots_for_extend(prefix_len, prefix_len + extend_len, self.page_size)
        reserve = min(req.remaining_new_tokens(), CLIP_MAX_NEW_TOKENS)
        if self.server_idle and not self.can_run:
            reserve = min(reserve, max(self.rem_total_tokens - need, 0))
        fits_whole = extend_len <= self.rem_input_tokens and (
            self.rem_chunk_tokens is None or extend_len <= self.rem_chunk_tokens
        )
        if fits_whole:
            if need + reserve > self.rem_total_tokens:
                self.shortfall = need + reserve - self.rem_total_tokens
                if not locked:
                    self._unlock(req, charged)
                return AddResult.NO_TOKEN
            self._take(PlannedExtend(req, prefix_len, extend_len), need + reserve)
            return AddResult.CONTINUE
        # Chunk: as much as every limit allows, page aligned, leaving room for a partly used page.
        kv_room = self.rem_total_tokens - self.page_size
        limit = min(self.rem_input_tokens, self.rem_chunk_tokens or self.rem_input_tokens, kv_room)
        trunc = round_down(limit, self.page_size)
        if trunc <= 0:
            # A first chunk as large as the other limits allow would need this much more.
            self.shortfall = (
                min(self.rem_input_tokens, self.rem_chunk_tokens or self.rem_input_tokens)
                + self.page_size
                - self.rem_total_tokens
            )
            if not locked:
                self._unlock(req, charged)
            return AddResult.NO_TOKEN if kv_room <= limit else AddResult.OTHER
        self.new_chunked_req = req
        self._take(
            PlannedExtend(req, prefix_len, trunc), kv_slots_for_extend(prefix_len, prefix_len + trunc, self.page_size)
        )
        return AddResult.OTHER  # a chunked request ends the batch

    def _take(self, item: PlannedExtend, total_tokens: int) -> None:
        input_tokens = item.extend_len
        self.planned.append(item)
        self.rem_total_tokens -= total_tokens
        self.rem_input_tokens -= input_tokens
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= input_tokens
        self.rem_running_slots -= 1
