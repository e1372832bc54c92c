"""The scheduler's launches: carry out the next batch, a prefill (extend) or a decode.

Why a module of its own: ``Admission`` decides which waiting requests the next prefill takes
and ``BatchBuilder`` lays out the batch; this mixin carries the plan out (moves requests
between the queues, counts, hands the batch to the model worker) and returns the
``LaunchedStep`` the step loop keeps in flight. Room for the decode comes from
``scheduler_decode_room``.
"""

from __future__ import annotations

import logging

from runtime.engine.forward_batch import ForwardMode
from scheduler_proc.batch_builder import OutOfMemory
from scheduler_proc.model_worker import LaunchedStep
from scheduler_proc.prefill_adder import PlannedExtend
from scheduler_proc.scheduler_wiring import SchedulerWiring

logger = logging.getLogger(__name__)


class SchedulerLaunchMixin(SchedulerWiring):
    """Chooses between the planned prefill and a decode, and launches it."""

    def _launch_next(self) -> LaunchedStep | None:
        if self.host_tier:  # copies queued since the last step go out; loads go out before the launch
            self.host_tier.begin_step()
        queues = self.queues
        self._recompute_past_rope_switch()  # (before any batch that decodes the running requests)
        # A weight update waits for the running requests: no new one starts meanwhile (weight_update.py).
        waiting = () if self.weight_update is not None else queues.waiting
        plan = self.admission.plan(waiting, queues.running, queues.chunked, self.memory.new_token_ratio)
        if self.host_tier:
            self.host_tier.issue_loads()
        for req in plan.rejected:
            queues.remove_waiting(req)
            self._release_unscheduled(req)
            self.output.finish(req, {"type": "abort", "message": "out of memory"}, error_code="out_of_memory")
        queues.set_chunked(plan.chunked_req or plan.deferred_chunk)
        if self.preemption is not None:
            self._preempt_for_priority(plan)
        for item in plan.items:
            req = item.req
            queues.take(req)
            if not req.admitted:
                req.admitted = True
                req.first_prefix_len = item.prefix_len
                self.stats["prompt_tokens"] += len(req.origin_input_ids)
                self.stats["cached_prompt_tokens"] += req.first_prefix_len
        if plan.items:
            return self._launch_extend(plan.items)
        if queues.running:
            return self._launch_decode()
        return None

    def _launch_extend(self, items: list[PlannedExtend]) -> LaunchedStep | None:
        """Prefill ``items``; with --enable-mixed-chunk the running requests decode in the same forward."""
        running = self.queues.running
        # A jump-forward's re-prefill rides with the running requests' decode: one forward, not two.
        mix = bool(running) and (self.args.enable_mixed_chunk or any(item.req.jumped for item in items))
        try:
            batch = self.builder.build_mixed(items, running) if mix else self.builder.build_extend(items)
        except OutOfMemory as exc:
            # The adder budgets KV, so this is a budgeting slip: never retry the same batch
            # forever. Put back all but the first request and try it alone.
            logger.warning("prefill of %d requests could not allocate (%s)", len(items), exc)
            for item in reversed(items[1:]):
                self._requeue(item.req)
            if len(items) > 1:
                return self._launch_extend(items[:1])
            self._requeue(items[0].req)
            return None
        self.stats["num_prefill_batches"] += 1
        decoding = list(running) if batch.forward_mode == ForwardMode.MIXED else []
        if decoding:  # the running requests make progress too
            self.stats["num_mixed_batches"] += 1
            self.admission.decoded()
            self.memory.decoded()
        pending = self.worker.launch(batch)
        for req in decoding:
            req.num_inflight += 1
        for item in items:
            if not item.chunked:  # it decodes from the next step on, its first token in flight
                item.req.num_inflight += 1
                self.queues.start_running(item.req)
        self.output.log_prefill(
            len(items),
            sum(i.extend_len for i in items),
            sum(i.prefix_len for i in items),
            self.kv_usage(),
            len(self.queues.running),
            len(self.queues.waiting),
        )
        return LaunchedStep(pending, batch.forward_mode, list(items), decoding)

    def _launch_decode(self) -> LaunchedStep | None:
        self.admission.decoded()
        reqs = self._reserve_decode()
        if not reqs:
            return None
        drafts = (
            None
            if self.spec is None
            else self.spec.propose(reqs, self.allocator.available_size(), self.rope_switch.draft_room)
        )
        batch, future = (
            (self.builder.build_verify(reqs, drafts), None)
            if drafts is not None
            else self.builder.build_decode(reqs, self.inflight.decode_rows() if self.inflight else None)
        )
        self.stats["num_decode_batches"] += 1
        pending = self.worker.launch(batch, future)
        for req in reqs:
            req.num_inflight += 1
        self.memory.decoded()
        self.output.log_decode(len(reqs), sum(batch.seq_lens_cpu), self.kv_usage(), len(self.queues.waiting))
        return LaunchedStep(pending, batch.forward_mode, [], reqs, drafts)
