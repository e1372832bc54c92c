"""Admission: which waiting requests the next prefill takes, as a typed ``PrefillPlan``.

The policy orders the queue (matching prefixes where it is cache-aware), the
``PrefillAdder`` checks each request against the KV, token and request budgets, and
the result says, per request, how many cached tokens it starts from and how many it
computes now. Nothing here touches a request's ``fill_ids``: the batch builder writes
them when it carries the plan out (``Req.begin_extend``). Admission does take locks:
every planned request's prefix is locked by the adder, and a deferred chunk keeps its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from memory.allocator import SlotAllocator
from memory.prefix_cache import BasePrefixCache
from runtime.config.args import ServerArgs
from scheduler_proc.lora_slots import LoraSlots
from scheduler_proc.policy import SchedulePolicy
from scheduler_proc.prefill_adder import AddResult, PrefillAdder, PrefillPlan
from scheduler_proc.req import Req

if TYPE_CHECKING:
    from scheduler_proc.hicache import HostTier

# Decode never starves: at most this many prefill batches in a row while requests are running.
MAX_CONSECUTIVE_PREFILLS = 2
# Requests sharing at least this many leading tokens with one already in the batch wait a round.
IN_BATCH_PREFIX_TOKENS = 32


def _priority(req: Req) -> int:
    return req.priority


class Admission:
    """Plans prefills for one scheduler; owns the consecutive-prefill counter."""

    def __init__(
        self,
        args: ServerArgs,
        tree_cache: BasePrefixCache,
        allocator: SlotAllocator,
        max_total_tokens: int,
        max_running_requests: int,
        host_tier: HostTier | None = None,
        lora: LoraSlots | None = None,
    ) -> None:
        self.tree_cache = tree_cache
        # Multi-LoRA: a request whose adapter would not fit in the slots with the running ones' waits.
        self.lora = lora
        # A host tier's loads evict while planning: every request is matched right before it is added.
        self.host_tier = host_tier
        self.allocator = allocator
        self.radix_enabled = not args.disable_radix_cache
        self.policy = SchedulePolicy(
            args.schedule_policy,
            tree_cache,
            self.radix_enabled,
            seed=args.random_seed or 0,
            priority=args.enable_priority_scheduling,
        )
        # Report the request a plan stopped at, for priority preemption (scheduler_proc.priority).
        self.report_blocked = args.priority_preemption
        self.page_size = args.page_size
        self.max_total_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = args.max_prefill_tokens
        chunk = args.chunked_prefill_size
        self.chunked_prefill_size: int | None = chunk if chunk and chunk > 0 else None
        self.consecutive_prefills = 0

    def decoded(self) -> None:
        """The running requests made progress: prefills may take the next turns again."""
        self.consecutive_prefills = 0

    def plan(
        self, waiting: Sequence[Req], running: Sequence[Req], chunked_req: Req | None, new_token_ratio: float
    ) -> PrefillPlan:
        """The next prefill (empty when decode should run, or nothing fits)."""
        if not waiting and chunked_req is None:
            return PrefillPlan()
        if running and self.consecutive_prefills >= MAX_CONSECUTIVE_PREFILLS:
            # Let the running requests decode; a chunked prefill resumes next step.
            self.consecutive_prefills = 0
            return PrefillPlan(deferred_chunk=chunked_req)
        if len(running) >= self.max_running_requests and chunked_req is None:
            # No request slot: the first in priority order (the first of the largest) waits for one.
            return PrefillPlan(blocked=max(waiting, key=_priority) if self.report_blocked else None)
        adder = PrefillAdder(
            self.tree_cache,
            self.allocator,
            running,
            new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            self.max_running_requests,
            self.page_size,
            self.host_tier,
        )
        plan = PrefillPlan()
        if chunked_req is not None:
            result = adder.add_chunked_req(chunked_req)
            if chunked_req not in adder.can_run:
                # No room for its next chunk yet; decode makes progress meanwhile.
                plan.deferred_chunk = chunked_req
                if self.report_blocked:  # (or lower priorities give way to it)
                    self._note_blocked(plan, chunked_req, result, adder)
                return plan
        ordered = self.policy.order(waiting)
        matched = self.policy.effective_policy(len(waiting)) in ("lpm", "dfs-weight")
        in_batch_prefixes: set[tuple[int, ...]] = set()
        # the adapters every batch this plan leads to holds (the running and chunked requests'), once
        adapters = None
        if self.lora is not None:
            adapters = {r.lora_uid for r in running if r.lora_uid is not None}
            if chunked_req is not None and chunked_req.lora_uid is not None:
                adapters.add(chunked_req.lora_uid)
        for req in ordered:
            if adder.new_chunked_req is not None:
                break
            if not matched or self.host_tier is not None:
                self.policy.match(req)
            if req.seqlen + self.page_size >= self.max_total_tokens:
                plan.rejected.append(req)  # could not run even alone on an empty pool
                continue
            if self._defer_for_in_batch_prefix(req, in_batch_prefixes):
                continue
            if adapters is not None and not self._adapter_fits(req, adapters, adder):
                continue
            result = adder.add_one_req(req)
            if result != AddResult.CONTINUE:
                if self.report_blocked and not adder.planned and adder.new_chunked_req is None:
                    self._note_blocked(plan, req, result, adder)
                break
        plan.items = list(adder.planned)
        if plan.items:
            self.consecutive_prefills += 1
        return plan

    @staticmethod
    def _note_blocked(plan: PrefillPlan, req: Req, result: AddResult, adder: PrefillAdder) -> None:
        """Record that nothing was admitted because ``req`` lacked KV memory (or a request slot):
        the one case where preempting lower priorities helps (a full prefill budget, say, does not)."""
        if result == AddResult.NO_TOKEN:
            plan.blocked, plan.blocked_shortfall = req, max(adder.shortfall, 1)
        elif adder.rem_running_slots <= 0:
            plan.blocked = req

    def _adapter_fits(self, req: Req, adapters: set[str], adder: PrefillAdder) -> bool:
        """Its adapter and those of the running and chunked requests (``adapters``) and of the planned
        ones fit in the LoRA slots."""
        assert self.lora is not None
        if req.lora_uid is None or req.lora_uid in adapters:
            return True
        return self.lora.admits(req.lora_uid, adapters | {item.req.lora_uid for item in adder.planned})

    def _defer_for_in_batch_prefix(self, req: Req, seen: set[tuple[int, ...]]) -> bool:
        """Hold back a request that shares its start with one already in this prefill batch.

        Both would compute the shared tokens; waiting one round lets the first cache
        them, so the rest hit the cache (SGLang's in-batch prefix caching check). A
        prompt shorter than the threshold only clashes with an identical prompt: the
        samples of a parallel-sampling (n > 1) request share their prompt this way.
        """
        if not self.radix_enabled or len(req.cache_handle.prefix_indices) >= IN_BATCH_PREFIX_TOKENS:
            return False
        key = tuple(req.known_ids()[:IN_BATCH_PREFIX_TOKENS])
        if key in seen:
            return True
        seen.add(key)
        return False
