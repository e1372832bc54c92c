"""Turn scheduled requests into a ForwardBatch: take request rows and KV slots, fill req_to_token.

Memory taken here is owned by the requests from then on: a request's row (handed out
through the tree cache's ``attach_rows``, which records it in the request's cache handle)
and every KV slot past its cached prefix are released by the tree cache's
``cache_finished_req`` (or kept for reuse by ``cache_unfinished_req``).

A prefill carries out admission's ``PrefillPlan``: this is the one place a request's
``fill_ids`` are written. A decode of requests whose last token is still being computed
(overlap scheduling) takes their lengths from ``Req.scheduled_len`` and their input
tokens from the step in flight (``FutureInputs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence, cast

import torch

from memory.prefix_cache import BasePrefixCache
from runtime.engine.forward_batch import ForwardBatch, ForwardMode
from runtime.engine.sampling.batch_info import SamplingBatchInfo
from scheduler_proc import input_logprobs
from scheduler_proc.long_rope import RopeSwitch
from scheduler_proc.lora_slots import LoraSlots
from scheduler_proc.memory_setup import Allocator
from scheduler_proc.model_worker import ForwardRunner, FutureInputs
from scheduler_proc.prefill_adder import PlannedExtend, kv_slots_for_extend
from scheduler_proc.req import Req

if TYPE_CHECKING:
    from runtime.text.grammar import RequestGrammar


class OutOfMemory(RuntimeError):
    """The KV pool cannot hold this batch even after evicting the prefix cache."""


class BatchBuilder:
    def __init__(
        self,
        model_runner: ForwardRunner,
        allocator: Allocator,
        tree_cache: BasePrefixCache,
        page_size: int,
        rope_switch: RopeSwitch,
        lora: LoraSlots | None = None,
    ) -> None:
        self.runner = model_runner
        self.lora = lora  # multi-LoRA: the slots each batch's adapters sit in (ForwardBatch.lora)
        # Whether extend rows carry each request's rotation (ForwardBatch.long_rope; scheduler_proc.long_rope).
        self.rope_switch = rope_switch
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.page_size = page_size
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.device = model_runner.device

    # ------------------------------------------------------------------ memory

    def ensure_available(self, num_tokens: int) -> bool:
        """Evict unlocked prefix-cache entries until ``num_tokens`` slots are free."""
        short = num_tokens - self.allocator.available_size()
        if short > 0:
            self.tree_cache.evict(short)
        return self.allocator.available_size() >= num_tokens

    def _last_loc(self, rows: list[int], lens: list[int]) -> torch.Tensor:
        """KV slot of each request's last stored token (-1 where it has none)."""
        table = self.req_to_token_pool.req_to_token
        rows_t = torch.tensor(rows, dtype=torch.int64, device=table.device)
        lens_t = torch.tensor(lens, dtype=torch.int64, device=table.device)
        last = table[rows_t, (lens_t - 1).clamp(min=0)].to(torch.int64)
        return torch.where(lens_t > 0, last, torch.full_like(last, -1))

    def decode_tokens_needed(self, reqs: Sequence[Req]) -> int:
        """Slots a decode step takes: one per request, or one page per request crossing a page boundary."""
        if self.page_size == 1:
            return len(reqs)
        # The token being computed sits at position scheduled_len-1; a page starts there.
        return self.page_size * sum(1 for r in reqs if (r.scheduled_len - 1) % self.page_size == 0)

    # ------------------------------------------------------------------ batches

    def _sampling(self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]] | None = None) -> SamplingBatchInfo:
        """The batch's sampling state, one row per request; with ``drafts`` (a verify batch) one row
        per token of each request: row j of a request samples as its next step would after drafts
        ``[:j]`` were taken (their history for penalties, min_new_tokens and the seeded step, and a
        constrained request's grammar mask after them)."""
        counts = [1 + len(d) for d in drafts] if drafts is not None else [1] * len(reqs)
        starts = [sum(counts[:i]) for i in range(len(reqs))]
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        mask = None
        if constrained:  # their matchers have taken every token so far: no step is in flight for them
            from runtime.text.grammar import fill_bitmask

            assert not any(reqs[i].num_inflight for i in constrained), "a grammar's mask needs its last token"
            grammars = [cast("RequestGrammar", reqs[i].grammar) for i in constrained]
            mask = fill_bitmask(grammars, [starts[i] for i in constrained], sum(counts), self.runner.vocab_size)
            for i, grammar in zip(constrained, grammars):
                if drafts is not None and drafts[i]:  # the rows after each draft token (spec.verify cut them valid)
                    grammar.fill_after(drafts[i], mask, starts[i])
        outputs = [_outputs_for_sampling(r) for r in reqs]
        expand = range(len(reqs)) if drafts is None else [i for i, c in enumerate(counts) for _ in range(c)]
        histories = (
            outputs
            if drafts is None
            else [outputs[i] + list(drafts[i][:j]) for i, c in enumerate(counts) for j in range(c)]
        )
        return SamplingBatchInfo.from_requests(
            [reqs[i].sampling_params for i in expand],
            [reqs[i].origin_input_ids for i in expand],
            histories,
            self.runner.vocab_size,
            self.runner.eos_token_ids,
            self.device,
            vocab_mask=mask,
            vocab_mask_rows=[starts[i] + j for i in constrained for j in range(counts[i])] or None,
            token_ids_logprob=[reqs[i].token_ids_logprob for i in expand],
        )

    def build_extend(self, items: Sequence[PlannedExtend]) -> ForwardBatch:
        """Prefill each planned request's ``extend_len`` tokens after its cached prefix."""
        return self._to_batch(ForwardMode.EXTEND, [self._extend_parts(items)])[0]

    def build_decode(
        self, reqs: Sequence[Req], inflight_rows: Mapping[Req, int] | None = None
    ) -> tuple[ForwardBatch, FutureInputs | None]:
        """One new token per request at position scheduled_len - 1: its last sampled token,
        or, for a request in ``inflight_rows``, that row of the step in flight's tokens."""
        return self._to_batch(ForwardMode.DECODE, [self._decode_parts(reqs, inflight_rows or {})])

    def build_verify(self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]) -> ForwardBatch:
        """Speculative verification (``ForwardMode.VERIFY``, page size 1, no step in flight): each
        request's last token and its ``drafts`` (maybe none) at positions ``scheduled_len - 1`` on,
        each with a KV slot of its own, causal after the request's KV; every token is sampled.
        The slots of drafts the step rejects are the caller's to free (``spec.verify``)."""
        assert self.page_size == 1 and not any(r.num_inflight for r in reqs)
        counts = [1 + len(d) for d in drafts]
        if not self.ensure_available(sum(counts)):
            raise OutOfMemory("verify needs more KV slots than are free")
        out_cache_loc = self.allocator.alloc(sum(counts))
        if out_cache_loc is None:
            raise OutOfMemory("allocator refused verify slots")
        rows = _rows(reqs)
        prefix_lens = [r.scheduled_len - 1 for r in reqs]
        offset = 0
        for row, p, n in zip(rows, prefix_lens, counts):
            self.req_to_token_pool.write(row, p, out_cache_loc[offset : offset + n])
            offset += n
        parts = _Parts(
            list(reqs),
            [t for r, d in zip(reqs, drafts) for t in [r.output_ids[-1], *d]],
            [p + j for p, n in zip(prefix_lens, counts) for j in range(n)],
            rows,
            [p + n for p, n in zip(prefix_lens, counts)],
            prefix_lens,
            counts,
            out_cache_loc,
        )
        return self._to_batch(ForwardMode.VERIFY, [parts], drafts)[0]

    def build_mixed(self, items: Sequence[PlannedExtend], decode_reqs: Sequence[Req]) -> ForwardBatch:
        """Prefill ``extend_reqs`` and decode ``decode_reqs`` in one forward (MIXED).

        The extend part is allocated first; if the decode part then does not fit
        (``_decode_parts`` allocates nothing when it raises), the prefill runs alone
        and the batch's mode says so.
        """
        extend = self._extend_parts(items)
        try:
            decode = self._decode_parts(decode_reqs, {})
        except OutOfMemory:
            return self._to_batch(ForwardMode.EXTEND, [extend])[0]
        return self._to_batch(ForwardMode.MIXED, [extend, decode])[0]

    def _extend_parts(self, items: Sequence[PlannedExtend]) -> "_Parts":
        pool = self.req_to_token_pool
        reqs = [item.req for item in items]
        for item in items:
            assert item.prefix_len == len(item.req.cache_handle.prefix_indices), "the plan's prefix is the locked one"
            assert item.req.num_inflight == 0, "a request prefills only with all its tokens on the host"
            item.req.begin_extend(item.prefix_len, item.extend_len)
        prefix_lens = [item.prefix_len for item in items]
        seq_lens = [len(r.fill_ids) for r in reqs]
        extend_lens = [s - p for s, p in zip(seq_lens, prefix_lens)]
        total = sum(extend_lens)
        slots = sum(kv_slots_for_extend(p, s, self.page_size) for p, s in zip(prefix_lens, seq_lens))
        if not self.ensure_available(slots):
            raise OutOfMemory(f"need {slots} KV slots, {self.allocator.available_size()} free after eviction")
        new_rows = [r for r in reqs if r.cache_handle.req_pool_idx is None]
        if not self.tree_cache.attach_rows(new_rows):  # (each row starts with its request's prefix)
            raise OutOfMemory("no free request slot")
        for req in new_rows:
            req.kv_committed_len = len(req.cache_handle.prefix_indices)
        rows = _rows(reqs)
        if self.page_size == 1:
            out_cache_loc = self.allocator.alloc(total)
        else:
            out_cache_loc = self.allocator.alloc_extend(
                torch.tensor(prefix_lens, dtype=torch.int64, device=self.device),
                torch.tensor(seq_lens, dtype=torch.int64, device=self.device),
                self._last_loc(rows, prefix_lens),
                total,
            )
        if out_cache_loc is None:
            self.tree_cache.detach_rows(new_rows)
            raise OutOfMemory(f"allocator refused {total} KV slots")
        offset = 0
        for row, p, n in zip(rows, prefix_lens, extend_lens):
            pool.write(row, p, out_cache_loc[offset : offset + n])
            offset += n
        input_ids = [t for r, p in zip(reqs, prefix_lens) for t in r.fill_ids[p:]]
        positions = [i for p, s in zip(prefix_lens, seq_lens) for i in range(p, s)]
        return _Parts(list(reqs), input_ids, positions, rows, seq_lens, prefix_lens, extend_lens, out_cache_loc)

    def _decode_parts(self, reqs: Sequence[Req], inflight_rows: Mapping[Req, int]) -> "_Parts":
        rows = _rows(reqs)
        seq_lens = [r.scheduled_len for r in reqs]
        prefix_lens = [s - 1 for s in seq_lens]
        if not self.ensure_available(self.decode_tokens_needed(reqs)):
            raise OutOfMemory("decode needs more KV slots than are free")
        if self.page_size == 1:
            out_cache_loc = self.allocator.alloc(len(reqs))
        else:
            out_cache_loc = self.allocator.alloc_decode(
                torch.tensor(seq_lens, dtype=torch.int64, device=self.device), self._last_loc(rows, prefix_lens)
            )
        if out_cache_loc is None:
            raise OutOfMemory("allocator refused decode slots")
        table = self.req_to_token_pool.req_to_token
        rows_t = torch.tensor(rows, dtype=torch.int64, device=table.device)
        pos_t = torch.tensor(prefix_lens, dtype=torch.int64, device=table.device)
        table[rows_t, pos_t] = out_cache_loc.to(table.dtype)
        # A token still in flight is a placeholder (0) the worker fills from the device.
        input_ids = [0 if r.num_inflight else r.output_ids[-1] for r in reqs]
        future = [(i, inflight_rows[r]) for i, r in enumerate(reqs) if r.num_inflight]
        return _Parts(
            list(reqs), input_ids, prefix_lens, rows, seq_lens, prefix_lens, [1] * len(reqs), out_cache_loc, future
        )

    def _to_batch(
        self,
        mode: ForwardMode,
        parts: list["_Parts"],
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[ForwardBatch, FutureInputs | None]:
        def cat(name: str) -> list[int]:
            return [x for p in parts for x in getattr(p, name)]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        reqs = [r for p in parts for r in p.reqs]
        seq_lens, prefix_lens, extend_lens = cat("seq_lens"), cat("prefix_lens"), cat("extend_lens")
        out_cache_loc = torch.cat([p.out_cache_loc.to(torch.int64) for p in parts])
        future: list[tuple[int, int]] = []
        offset = 0
        for p in parts:
            future.extend((offset + i, src) for i, src in p.future)
            offset += len(p.input_ids)
        future_inputs = None
        if future:
            both = t([i for i, _ in future] + [src for _, src in future]).view(2, -1)
            future_inputs = FutureInputs(positions=both[0], source_rows=both[1])
        extends = mode in (ForwardMode.EXTEND, ForwardMode.MIXED)  # (decode and verify rows go by position)
        token_types = _token_types(parts) if extends else None  # (a decode step has no prompt tokens)
        rope_flags = self.rope_switch.extend_flags(reqs) if extends else None
        batch = ForwardBatch(
            forward_mode=mode,
            input_ids=t(cat("input_ids")),
            positions=t(cat("positions")),
            req_pool_indices=t(cat("rows")),
            seq_lens=t(seq_lens),
            prefix_lens=t(prefix_lens),
            extend_lens=t(extend_lens),
            out_cache_loc=out_cache_loc,
            req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool=self.runner.token_to_kv_pool,
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            sampling_info=self._sampling(reqs, drafts),
            return_logprob=any(r.return_logprob for r in reqs),
            top_logprobs_num=max((r.top_logprobs_num for r in reqs), default=0),
            # Logits at more than the last position only for prefills that ask for prompt logprobs.
            input_logprobs=None
            if mode in (ForwardMode.DECODE, ForwardMode.VERIFY)
            else input_logprobs.plan_batch(reqs, prefix_lens, extend_lens, self.device),
            long_rope=None if rope_flags is None else torch.tensor(rope_flags, dtype=torch.bool, device=self.device),
            token_type_ids=None if token_types is None else t(token_types),
            lora=self.lora.plan(reqs) if self.lora is not None else None,
        )
        return batch, future_inputs


def _rows(reqs: Sequence[Req]) -> list[int]:
    """The ReqToTokenPool rows of requests that all hold one (being prefilled or decoded; not
    checked here, per decode step: a request without a row makes the index tensor fail)."""
    return cast(list[int], [r.cache_handle.req_pool_idx for r in reqs])


def _token_types(parts: Sequence["_Parts"]) -> list[int] | None:
    """Each packed token's segment (an encoder's pair: the second text's tokens 1), by its position
    in its request; None when no request of the batch has types (all 0)."""
    if not any(r.token_type_ids for p in parts for r in p.reqs):
        return None
    types: list[int] = []
    for p in parts:
        offset = 0
        for req, n in zip(p.reqs, p.extend_lens):
            own = req.token_type_ids or []
            types.extend(own[i] if i < len(own) else 0 for i in p.positions[offset : offset + n])
            offset += n
    return types


def _outputs_for_sampling(req: Req) -> list[int]:
    """The output ids the sampler sees: it reads only their count when a token is in flight
    (the seeded step, min_new_tokens); penalties, which read values, never overlap."""
    if not req.num_inflight:
        return req.output_ids
    return req.output_ids + [-1] * req.num_inflight


@dataclass
class _Parts:
    """The host-side pieces of one batch section (an extend part or a decode part)."""

    reqs: list[Req]
    input_ids: list[int]
    positions: list[int]
    rows: list[int]
    seq_lens: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: torch.Tensor
    # (index in this part's input_ids, row of the step in flight) of each future input token.
    future: list[tuple[int, int]] = field(default_factory=list)
