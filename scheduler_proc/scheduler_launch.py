"""The scheduler's launches: carry out the next batch, a prefill (extend) or a decode, and make the
room a decode needs.

Why one module: ``Admission`` decides which waiting requests the next prefill takes, ``DecodeMemory``
who decodes and who gives way, ``PriorityPreemption`` whom a higher-priority request displaces, the
``RopeSwitch`` who must be recomputed, and ``BatchBuilder`` lays the batch out; this class carries
those decisions out for the one batch about to launch (moves requests between the queues, retracts,
counts, hands the batch to the model worker) and returns the ``LaunchedStep`` the step loop keeps in
flight. Every retraction it makes serves this launch, and only host state with no step in flight can
be retracted from, so this is where the step in flight is completed early (``StepResults.drain``)
when eviction alone is not enough.
"""

from __future__ import annotations

import logging

from memory.prefix_cache import BasePrefixCache
from runtime.engine.forward_batch import ForwardMode
from scheduler_proc import reports
from scheduler_proc.admission import Admission
from scheduler_proc.batch_builder import BatchBuilder, OutOfMemory
from scheduler_proc.decode_memory import DecodeMemory
from scheduler_proc.hicache import HostTier
from scheduler_proc.long_rope import RopeSwitch
from scheduler_proc.memory_setup import Allocator
from scheduler_proc.model_worker import LaunchedStep, ModelWorker
from scheduler_proc.output import OutputProcessor
from scheduler_proc.prefill_adder import PlannedExtend, PrefillPlan
from scheduler_proc.priority import PriorityPreemption
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import Req
from scheduler_proc.scheduler_release import RequestRelease
from scheduler_proc.scheduler_results import StepResults
from scheduler_proc.spec.verify import SpecDecoder

logger = logging.getLogger(__name__)


class BatchLauncher:
    """Chooses between the planned prefill and a decode, makes room for it, and launches it."""

    def __init__(
        self,
        queues: RequestQueues,
        admission: Admission,
        memory: DecodeMemory,
        preemption: PriorityPreemption | None,
        rope_switch: RopeSwitch,
        builder: BatchBuilder,
        worker: ModelWorker,
        spec: SpecDecoder | None,
        allocator: Allocator,
        tree_cache: BasePrefixCache,
        max_total_tokens: int,
        host_tier: HostTier | None,
        output: OutputProcessor,
        results: StepResults,
        release: RequestRelease,
        mixed_chunk: bool,
    ) -> None:
        self.queues = queues
        self.admission = admission
        self.memory = memory
        self.preemption = preemption
        self.rope_switch = rope_switch
        self.builder = builder
        self.worker = worker
        self.spec = spec
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.max_total_tokens = max_total_tokens
        self.host_tier = host_tier
        self.output = output
        self.stats = output.stats
        self.results = results
        self.release = release
        # --enable-mixed-chunk: the running requests decode in the same forward as a prefill.
        self.mixed_chunk = mixed_chunk

    def launch_next(self, admission_paused: bool) -> LaunchedStep | None:
        """Launch the next batch (None: nothing could run). ``admission_paused``: no waiting request
        starts (a weight update waits for the running ones, ``weight_update.py``)."""
        if self.host_tier:  # copies queued since the last step go out; loads go out before the launch
            self.host_tier.begin_step()
        queues = self.queues
        self._recompute_past_rope_switch()  # (before any batch that decodes the running requests)
        waiting = () if admission_paused else queues.waiting
        plan = self.admission.plan(waiting, queues.running, queues.chunked, self.memory.new_token_ratio)
        if self.host_tier:
            self.host_tier.issue_loads()
        for req in plan.rejected:
            queues.remove_waiting(req)
            self.release.release_unscheduled(req)
            self.output.finish(req, {"type": "abort", "message": "out of memory"}, error_code="out_of_memory")
        queues.set_chunked(plan.chunked_req or plan.deferred_chunk)
        if self.preemption is not None:
            self._preempt_for_priority(self.preemption, plan)
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

    def _kv_usage(self) -> float:
        return reports.kv_usage(self.allocator, self.tree_cache, self.max_total_tokens)

    # ------------------------------------------------------------------ prefill

    def _launch_extend(self, items: list[PlannedExtend]) -> LaunchedStep | None:
        """Prefill ``items``; with --enable-mixed-chunk the running requests decode in the same forward."""
        running = self.queues.running
        # A jump-forward's re-prefill rides with the running requests' decode: one forward, not two.
        mix = bool(running) and (self.mixed_chunk or any(item.req.jumped for item in items))
        try:
            batch = self.builder.build_mixed(items, running) if mix else self.builder.build_extend(items)
        except OutOfMemory as exc:
            # The adder budgets KV, so this is a budgeting slip: never retry the same batch
            # forever. Put back all but the first request and try it alone.
            logger.warning("prefill of %d requests could not allocate (%s)", len(items), exc)
            for item in reversed(items[1:]):
                self.release.requeue(item.req)
            if len(items) > 1:
                return self._launch_extend(items[:1])
            self.release.requeue(items[0].req)
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
            self._kv_usage(),
            len(self.queues.running),
            len(self.queues.waiting),
        )
        return LaunchedStep(pending, batch.forward_mode, list(items), decoding)

    # ------------------------------------------------------------------ decode

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
        inflight = self.results.inflight
        batch, future = (
            (self.builder.build_verify(reqs, drafts), None)
            if drafts is not None
            else self.builder.build_decode(reqs, inflight.decode_rows() if inflight else None)
        )
        self.stats["num_decode_batches"] += 1
        pending = self.worker.launch(batch, future)
        for req in reqs:
            req.num_inflight += 1
        self.memory.decoded()
        self.output.log_decode(len(reqs), sum(batch.seq_lens_cpu), self._kv_usage(), len(self.queues.waiting))
        return LaunchedStep(pending, batch.forward_mode, [], reqs, drafts)

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
        if self.results.inflight is not None:
            self.results.drain()
            reqs = memory.decode_candidates(queues.running)
            if builder.ensure_available(builder.decode_tokens_needed(reqs)):
                return reqs
        if queues.chunked is not None:
            # A half-prefilled prompt gives way first: its chunks become evictable cache,
            # and it resumes from whatever of them is still cached.
            self.release.requeue(queues.chunked)
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
                self.release.finish(req, {"type": "abort", "message": "out of memory"}, error_code="out_of_memory")
                return False
            req = order.pop(0)
            self.release.retract(req)
            retracted.append(req)
        if retracted:
            self.stats["num_retractions"] += 1
            self.stats["num_retracted_reqs"] += len(retracted)
            self.memory.retracted(len(retracted))
        return bool(queues.running)

    # ------------------------------------------------------------------ retractions that are not a shortage

    def _recompute_past_rope_switch(self) -> None:
        """Retract the running requests the model's ``RopeSwitch`` says must be recomputed (a LongRoPE
        request whose next forward would outgrow the switch with short-rotated KV re-prefills prompt +
        outputs with the long factors, as transformers' ``generate`` re-runs the sequence at that step).
        Before any batch that decodes them is planned; the step in flight is completed first
        (retraction needs the exact host state). Not a memory shortage: ``new_token_ratio`` stays."""
        if not self.rope_switch.must_recompute(self.queues.running):
            return
        self.results.drain()
        recompute = self.rope_switch.must_recompute(self.queues.running)  # (the drained step may finish some)
        for req in recompute:
            self.release.retract(req)
        self.stats["num_rope_recomputations"] += len(recompute)

    def _preempt_for_priority(self, preemption: PriorityPreemption, plan: PrefillPlan) -> None:
        """Retract the running requests ``PriorityPreemption`` picks for the request the plan was
        blocked at; with a step in flight, only mark it pending (the next step completes that step
        first and decides again). Not a sign of optimistic reservations: ``new_token_ratio`` stays."""
        preemption.pending = False
        victims = preemption.victims(plan, self.queues.running, self.memory.new_token_ratio)
        if not victims:
            return
        if self.results.inflight is not None:
            preemption.pending = True
            return
        for req in victims:
            self.release.retract(req)
        self.stats["num_priority_preemptions"] += len(victims)
        assert plan.blocked is not None
        logger.info("priority %d preempted %d running requests", plan.blocked.priority, len(victims))
