"""The scheduler's decode room: KV for the next decode step, retraction, priority preemption, requeue.

Why a module of its own: every way a scheduled request gives its memory back and waits at the
front again lives here, next to the one caller that needs the room (the decode launch).
``DecodeMemory`` decides who decodes and who gives way, ``PriorityPreemption`` whom a
higher-priority request displaces; this mixin carries the decisions out through ``queues``
and ``tree_cache``. Only host state with no step in flight can be retracted from, so this is
where the step in flight is completed early when eviction alone is not enough.
"""

from __future__ import annotations

import logging

from scheduler_proc.prefill_adder import PrefillPlan
from scheduler_proc.req import Req
from scheduler_proc.scheduler_wiring import SchedulerWiring

logger = logging.getLogger(__name__)


class SchedulerDecodeRoomMixin(SchedulerWiring):
    """Makes room for decoding, and undoes scheduling decisions that cannot be carried out."""

    def _reserve_decode(self) -> list[Req]:
        """The requests of the next decode step, with KV room for each; [] when none can run.

        ``DecodeMemory`` decides who decodes and who gives way; this carries it out. Only the
        host state without a step in flight can be retracted from: when eviction is not enough,
        the step in flight is completed first (it may finish requests).
        """
        memory, builder, queues = self.memory, self.builder, self.queues
        reqs = memory.decode_candidates(queues.running)
        if builder.ensure_available(builder.decode_tokens_needed(reqs)):
            return reqs
        if self.inflight is not None:
            self.drain()
            reqs = memory.decode_candidates(queues.running)
            if builder.ensure_available(builder.decode_tokens_needed(reqs)):
                return reqs
        if queues.chunked is not None:
            # A half-prefilled prompt gives way first: its chunks become evictable cache,
            # and it resumes from whatever of them is still cached.
            self._requeue(queues.chunked)
            if builder.ensure_available(builder.decode_tokens_needed(queues.running)):
                return list(queues.running)
        return list(queues.running) if self._retract_until_decode_fits() else []

    def _retract_until_decode_fits(self) -> bool:
        """Retract requests in ``DecodeMemory.retraction_order`` until one decode step fits;
        False if none can run (the last one left, alone too big, finishes with an error)."""
        builder, queues = self.builder, self.queues
        order = self.memory.retraction_order(queues.running)
        retracted: list[Req] = []
        while order and not builder.ensure_available(builder.decode_tokens_needed(queues.running)):
            if len(queues.running) == 1:
                req = queues.running[0]
                queues.remove_running(req)
                self.finish(req, {"type": "abort", "message": "out of memory"}, error_code="out_of_memory")
                return False
            req = order.pop(0)
            self._retract(req)
            retracted.append(req)
        if retracted:
            self.stats["num_retractions"] += 1
            self.stats["num_retracted_reqs"] += len(retracted)
            self.memory.retracted(len(retracted))
        return bool(queues.running)

    def _retract(self, req: Req) -> None:
        """A running request (nothing of it in flight) gives its memory back and waits at the front:
        its KV becomes cache, and it resumes from whatever of it is still cached. It is settled on
        the model's RoPE switch again (``RopeSwitch.settle``, after its KV was cached under its old
        namespace): one past a LongRoPE switch re-prefills every token with the long factors."""
        self.queues.retract(req)
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_retracted = True
        self.rope_switch.settle(req)

    def _recompute_past_rope_switch(self) -> None:
        """Retract the running requests the model's ``RopeSwitch`` says must be recomputed (a LongRoPE
        request whose next forward would outgrow the switch with short-rotated KV re-prefills prompt +
        outputs with the long factors, as transformers' ``generate`` re-runs the sequence at that step).
        Before any batch that decodes them is planned; the step in flight is completed first
        (retraction needs the exact host state). Not a memory shortage: ``new_token_ratio`` stays."""
        if not self.rope_switch.must_recompute(self.queues.running):
            return
        self.drain()
        recompute = self.rope_switch.must_recompute(self.queues.running)  # (the drained step may finish some)
        for req in recompute:
            self._retract(req)
        self.stats["num_rope_recomputations"] += len(recompute)

    def _preempt_for_priority(self, plan: PrefillPlan) -> None:
        """Retract the running requests ``PriorityPreemption`` picks for the request the plan was
        blocked at; with a step in flight, only mark it pending (the next step completes that step
        first and decides again). Not a sign of optimistic reservations: ``new_token_ratio`` stays."""
        assert self.preemption is not None
        self.preemption.pending = False
        victims = self.preemption.victims(plan, self.queues.running, self.memory.new_token_ratio)
        if not victims:
            return
        if self.inflight is not None:
            self.preemption.pending = True
            return
        for req in victims:
            self._retract(req)
        self.stats["num_priority_preemptions"] += len(victims)
        assert plan.blocked is not None
        logger.info("priority %d preempted %d running requests", plan.blocked.priority, len(victims))

    def _requeue(self, req: Req) -> None:
        """Undo a scheduling decision that could not be carried out: ``req`` waits at the front again."""
        # The failed extend allocated nothing: its row (if any) holds what it held before.
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_chunked = False
        self.queues.requeue(req)
