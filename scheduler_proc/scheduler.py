"""The scheduler: continuous batching over one model worker, SGLang's request lifecycle.

Per step: take new messages, pick a batch (a prefill of waiting requests planned by
``Admission``, or a decode of the running ones), launch it, then process the results:
append each token, check whether the request finished, and hand its KV to the prefix
cache (``cache_unfinished_req`` keeps it running, ``cache_finished_req`` releases it).

Overlap (``OverlapModelWorker``): step N+1 is launched before step N's results are
processed, so the host's bookkeeping runs while the device computes. A request then has
at most one token in flight (``Req.num_inflight``). Anything that needs the exact host
state first (any prefill: processing it inserts its prompt into the prefix cache; an
abort, a retraction, penalties over the output history, a mixed batch, a control request)
completes the step in flight before planning.
A request that finishes at step N after being placed in step N+1 drops that extra token;
its memory is released once, when its last step in flight completes.

Memory owners: the scheduler's ``allocator`` hands out KV slots, the model runner owns
the pools, ``tree_cache`` owns cached prefixes, and each running request owns its row
plus the slots past its locked prefix. The scheduler owns its ``queues``: only its own
methods move a request between them; admission and ``DecodeMemory`` decide, this class
carries the decisions out (and releases memory through ``tree_cache``).
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch

from memory.invariant import InvariantReport
from memory.prefix_cache import BasePrefixCache
from runtime.config.args import ServerArgs
from runtime.engine.forward_batch import ForwardMode
from runtime.protocol.messages import LoadReport, SchedAbortReq, SchedControlOut, SchedControlReq, SchedulerInput, \
    TokenizedGenerateReq
from scheduler_proc import input_logprobs, reports, swa_memory
from scheduler_proc.admission import Admission
from scheduler_proc.batch_builder import BatchBuilder, OutOfMemory
from scheduler_proc.deadlines import TIMEOUT_MESSAGE, Deadlines
from scheduler_proc.decode_memory import DecodeMemory
from scheduler_proc.grammar_queue import GrammarQueue
from scheduler_proc.jump_forward import jump_forward
from scheduler_proc.memory_setup import create_allocator, create_tree_cache
from scheduler_proc.model_worker import ForwardRunner, LaunchedStep, StepResult, can_plan_ahead, \
    create_model_runner, create_model_worker, overlap_default
from scheduler_proc.output import OutputProcessor
from scheduler_proc.prefill_adder import PlannedExtend, PrefillPlan
from scheduler_proc.priority import PriorityPreemption
from scheduler_proc.queue_bound import OVERLOADED, QueueBound
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import Req, StopChecker
from scheduler_proc.spec.verify import SpecDecoder

logger = logging.getLogger(__name__)

CLIENT_ABORT = "aborted by the client"


class Scheduler:
    """One TP rank's scheduler. Usable in-process (tests call ``handle_message``/``step``)."""

    def __init__(self, server_args: ServerArgs, tp_rank: int = 0, model_runner: ForwardRunner | None = None,
                 kv_events: bool = False) -> None:
        self.args = server_args
        self.tp_rank = tp_rank
        if model_runner is None:
            model_runner = create_model_runner(server_args, tp_rank)
        self.runner = model_runner
        self.page_size = server_args.page_size
        self.context_len: int = model_runner.context_len
        self.max_running_requests: int = model_runner.max_running_requests
        self.allocator = create_allocator(model_runner, self.page_size)  # (hybrid with windowed layers)
        self.req_to_token_pool = model_runner.req_to_token_pool
        # The allocator rounds the pool down to whole pages: that is the real capacity.
        self.max_total_tokens: int = self.allocator.size
        self.tree_cache: BasePrefixCache
        # host_tier: the hierarchical cache's per-step copies and load-back (scheduler_proc.hicache).
        self.tree_cache, self.host_tier = create_tree_cache(server_args, model_runner, self.allocator, kv_events)
        self.admission = Admission(server_args, self.tree_cache, self.allocator, self.max_total_tokens,
                                   self.max_running_requests, self.host_tier)
        self.builder = BatchBuilder(model_runner, self.allocator, self.tree_cache, self.page_size)
        self.output = OutputProcessor(StopChecker(set(model_runner.eos_token_ids), self.context_len),
                                      server_args.stream_interval, server_args.decode_log_interval)
        self.stats = self.output.stats
        self.memory = DecodeMemory(self.context_len)
        self.spec = SpecDecoder.create(server_args, self.context_len, self.stats,  # None: no speculation
                                       torch.device(model_runner.device))
        self.preemption = PriorityPreemption() if server_args.priority_preemption else None
        overlap = server_args.disable_overlap_schedule
        overlap = overlap_default(torch.device(model_runner.device)) if overlap is None else not overlap
        self.worker = create_model_worker(model_runner, overlap)
        self.queues = RequestQueues()
        # Constrained requests wait here until their grammar is compiled (off this thread).
        self.grammars = GrammarQueue(lambda: self.output.stop_checker.load_tokenizer(server_args),
                                     model_runner.vocab_size, model_runner.eos_token_ids,
                                     server_args.grammar_compile_timeout, tp_rank, server_args.tp_size)
        # Jump-forward re-prefills through the prefix cache: without one it would recompute everything.
        self.jump_forward = not (server_args.disable_jump_forward or server_args.disable_radix_cache)
        # --max-queued-requests (scheduler_proc/queue_bound.py) and request deadlines
        # (scheduler_proc/deadlines.py: rank 0 decides; under TP its expiries reach the others as aborts).
        self.queue_bound = QueueBound(server_args.max_queued_requests)
        self.deadlines = Deadlines()
        self.inflight: LaunchedStep | None = None
        self._was_idle = True
        self.last_invariant: InvariantReport | None = None

    # ------------------------------------------------------------------ inputs

    def handle_message(self, msg: SchedulerInput) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.stats["num_received"] += 1
            self.add_request(msg)
        elif isinstance(msg, SchedAbortReq):
            self.abort(msg.rid, msg.reason or CLIENT_ABORT)
        elif isinstance(msg, SchedControlReq):
            self.output.outbox.append(SchedControlOut(msg.rid, msg.kind, self.control(msg.kind)))

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        """Queue a request the tokenizer validated (prompt length, vocabulary, parameters), unless
        the queue is full (--max-queued-requests): then it is refused at once with ``overloaded``."""
        refusal = self.queue_bound.admit(self.num_waiting())
        if refusal is not None:
            self.stats["num_refused_overloaded"] += 1
            self.output.error(msg.rid, OVERLOADED, refusal)
            return
        req = Req(rid=msg.rid, origin_input_ids=list(msg.input_ids), sampling_params=msg.sampling_params,
                  stream=msg.stream, return_logprob=msg.return_logprob, top_logprobs_num=msg.top_logprobs_num,
                  logprob_start_len=msg.logprob_start_len,
                  priority=msg.priority if self.args.enable_priority_scheduling else 0)
        assert 0 < req.seqlen < self.context_len, f"{req.rid}: {req.seqlen} prompt tokens reached the scheduler"
        if req.sampling_params.stop_strs:
            self.output.stop_checker.load_tokenizer(self.args)
        input_logprobs.begin(req)  # (max_new_tokens 0 still prefills: its prompt logprobs, its cache entry)
        if msg.deadline is not None and self.tp_rank == 0:
            self.deadlines.add(req, msg.deadline)
        if req.sampling_params.constraint is not None:
            self.grammars.add(req)
            return
        self.queues.add(req)

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar is ready join the queue; failed ones end with the reason."""
        ready, failed = self.grammars.poll()
        for req in ready:
            self.queues.add(req)
        for req, reason in failed:
            self.output.finish(req, {"type": "abort", "message": reason}, error_code="invalid_request")

    def abort(self, rid: str, message: str = CLIENT_ABORT) -> None:
        """Abort one request (or all when rid is ''): queued ones at once, others at the next step.
        ``message`` is the finish reason's (``timeout`` for an expired deadline)."""
        hit = 0
        for req in self.grammars.remove(rid):
            hit += 1
            self.stats["num_aborted"] += 1
            self.output.finish(req, {"type": "abort", "message": message})
        for req in [r for r in self.queues.waiting if rid in ("", r.rid)]:
            hit += 1
            self.queues.remove_waiting(req)
            self.stats["num_aborted"] += 1
            self._release_unscheduled(req)
            self.output.finish(req, {"type": "abort", "message": message})
        for req in self.queues.holders():
            if rid in ("", req.rid) and req.to_abort is None:
                hit += 1
                req.to_abort = message
        if message == TIMEOUT_MESSAGE:
            self.stats["num_timed_out"] += hit

    def num_waiting(self) -> int:
        """Requests received and not running: what --max-queued-requests bounds."""
        return len(self.queues.waiting) + len(self.grammars)

    def expired_rids(self) -> list[str]:
        """The live requests whose deadline has passed (rank 0 decides; scheduler_proc.deadlines)."""
        return [req.rid for req in self.deadlines.expired()]

    # ------------------------------------------------------------------ one step

    def step(self) -> bool:
        """Launch the next batch if there is work, and process the previous one. True if one launched."""
        if len(self.deadlines) and self.args.tp_size == 1:  # (under TP: scheduler_process, as messages)
            for rid in self.expired_rids():
                self.abort(rid, TIMEOUT_MESSAGE)
        if len(self.grammars):  # first: whether to plan ahead depends on the waiting queue
            self._admit_compiled()
        if self.inflight is not None and not can_plan_ahead(
                self.inflight, self.queues, mixed_chunk=self.args.enable_mixed_chunk, speculative=self.spec is not None,
                preemption_pending=self.preemption is not None and self.preemption.pending):
            self._complete_inflight()
        self._apply_aborts()
        launched = self._launch_next()
        if self.inflight is not None:
            self._complete_inflight()  # while ``launched`` runs
        self.inflight = launched
        if launched is not None and not self.worker.overlap:
            self._complete_inflight()
        if launched is None and self.is_idle():
            if not self._was_idle:
                self.on_idle()
            self._was_idle = True
        else:
            self._was_idle = False
        return launched is not None

    def drain(self) -> None:
        """Process the step in flight, if any: afterwards the host state is exact."""
        if self.inflight is not None:
            self._complete_inflight()

    def _apply_aborts(self) -> None:
        """Finish requests marked for abort through the normal release path."""
        for req in [r for r in self.queues.running if r.to_abort]:
            self.queues.remove_running(req)
            self.finish(req, {"type": "abort", "message": req.to_abort})
        chunked = self.queues.chunked
        if chunked is not None and chunked.to_abort:
            self.queues.set_chunked(None)
            self.finish(chunked, {"type": "abort", "message": chunked.to_abort})

    def _launch_next(self) -> LaunchedStep | None:
        if self.host_tier:  # copies queued since the last step go out; loads go out before the launch
            self.host_tier.begin_step()
        queues = self.queues
        plan = self.admission.plan(queues.waiting, queues.running, queues.chunked, self.memory.new_token_ratio)
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
        self.output.log_prefill(len(items), sum(i.extend_len for i in items), sum(i.prefix_len for i in items),
                                self.kv_usage(), len(self.queues.running), len(self.queues.waiting))
        return LaunchedStep(pending, batch.forward_mode, list(items), decoding)

    def _launch_decode(self) -> LaunchedStep | None:
        self.admission.decoded()
        reqs = self._reserve_decode()
        if not reqs:
            return None
        drafts = None if self.spec is None else self.spec.propose(reqs, self.allocator.available_size())
        batch, future = (self.builder.build_verify(reqs, drafts), None) if drafts is not None else \
            self.builder.build_decode(reqs, self.inflight.decode_rows() if self.inflight else None)
        self.stats["num_decode_batches"] += 1
        pending = self.worker.launch(batch, future)
        for req in reqs:
            req.num_inflight += 1
        self.memory.decoded()
        self.output.log_decode(len(reqs), sum(batch.seq_lens_cpu), self.kv_usage(), len(self.queues.waiting))
        return LaunchedStep(pending, batch.forward_mode, [], reqs, drafts)

    # ------------------------------------------------------------------ decode room

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
        its KV becomes cache, and it resumes from whatever of it is still cached."""
        self.queues.retract(req)
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_retracted = True

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

    def _complete_inflight(self) -> None:
        """Wait for the step in flight and process its tokens."""
        step, self.inflight = self.inflight, None
        assert step is not None
        result = step.pending.wait()
        input_logprobs.take([item.req for item in step.extend], result)  # before any first output goes out
        finished: set[Req] = set()
        sampled: list[tuple[int, Req]] = []
        for row, item in enumerate(step.extend):
            item.req.kv_committed_len = len(item.req.fill_ids)
            if item.chunked:
                # More chunks to come: keep its KV as a cached prefix, don't sample.
                self.tree_cache.cache_unfinished_req(item.req)
            else:
                sampled.append((row, item.req))
        self._take_tokens(sampled, result, finished, prefilled=True)
        if step.drafts is not None and self.spec is not None:  # verify: accepted tokens; rejected slots freed
            finished.update(self.spec.take(step.decode, step.drafts, result, len(step.extend), self.output,
                                           self.req_to_token_pool.req_to_token, self.allocator.free, self.finish))
        else:
            for req in step.decode:
                req.kv_committed_len += 1
            self._take_tokens(enumerate(step.decode, start=len(step.extend)), result, finished, prefilled=False)
        swa_memory.after_step(self.tree_cache, [item.req for item in step.extend] + step.decode)  # left windows
        if finished:
            self.queues.drop_finished(finished)
        if self.jump_forward and self.grammars.stats.constrained_requests:  # (no scan until one arrives)
            for req in jump_forward([r for r in self.queues.running if r.grammar is not None],
                                    self.grammars.tokenizer, self.context_len, self.output):
                if req.finish_reason is not None:
                    self.queues.remove_running(req)
                    self.finish(req, req.finish_reason)
                else:  # its row goes back as in a retraction; the next prefill computes the forced text
                    self._retract(req)

    def _take_tokens(self, rows: Iterable[tuple[int, Req]], result: StepResult, finished: set[Req],
                     prefilled: bool) -> None:
        output = self.output
        for row, req in rows:
            req.num_inflight -= 1
            if req.finish_reason is not None:
                # It finished at the step before, which this one had already included: the
                # token is dropped, its KV kept with the rest; release once nothing is in flight.
                if req.num_inflight == 0:
                    self._release(req)
                continue
            output.append_token(req, result, row)
            if req.finish_reason is not None:
                finished.add(req)
                self.finish(req, req.finish_reason)
            elif prefilled:
                self.tree_cache.cache_unfinished_req(req)

    def finish(self, req: Req, reason: dict[str, Any] | None, error_code: str | None = None) -> None:
        """Tell the client, then release the request's memory unless a step still uses it."""
        if req.to_abort is not None:  # here, or when its step in flight completed (overlap)
            self.stats["num_aborted"] += 1
        self.output.finish(req, reason, error_code)
        if self.spec is not None:
            self.spec.finished(req)
        if req.num_inflight == 0:
            self._release(req)

    def _release(self, req: Req) -> None:
        # Caches what has KV, frees the rest and the row, and drops the prefix lock.
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)

    def _release_unscheduled(self, req: Req) -> None:
        """A waiting request holds nothing: no lock, no row (retracted ones released theirs)."""
        self.tree_cache.drop_match(req)

    # ------------------------------------------------------------------ state

    def take_outbox(self) -> list[Any]:
        return self.output.take_outbox()

    def is_idle(self) -> bool:
        return self.queues.is_empty() and self.inflight is None and not len(self.grammars)

    def receive_timeout_ms(self) -> int:
        """How long the loop may block for new messages before the next step: not at all while
        requests run, briefly while only grammars compile (their readiness is polled), else 1 s."""
        if not self.queues.is_empty() or self.inflight is not None:
            return 0
        return 1 if len(self.grammars) else 1000

    def on_idle(self) -> InvariantReport:
        report = self.check_memory()
        if not report.ok:
            logger.error("memory invariant violated when idle: %s", report.message)
        return report

    def check_memory(self) -> InvariantReport:
        self.drain()
        self.last_invariant = reports.memory_invariant(self.queues, self.allocator, self.tree_cache,
                                                       self.req_to_token_pool, self.max_total_tokens, self.host_tier)
        return self.last_invariant

    def kv_usage(self) -> float:
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return 1.0 - free / self.max_total_tokens

    def control(self, kind: str) -> dict[str, Any]:
        self.drain()
        if kind == "flush_cache":
            if not self.is_idle():
                return {"success": False, "message": "requests are running; flush when idle"}
            # Idle: nothing but the tree holds slots, so every slot and row goes back.
            self.tree_cache.reset()
            self.allocator.clear()
            self.req_to_token_pool.clear()
            return {"success": True}
        if kind == "server_info":
            return self.server_info()
        return {"success": False, "message": f"unknown control request {kind!r}"}

    def load_report(self, dp_rank: int) -> LoadReport:
        return reports.load_report(dp_rank, self.queues, self.tree_cache, self.stats)

    def server_info(self) -> dict[str, Any]:
        """Memory, queues, counters and the memory invariant (checked now, with nothing in flight)."""
        return reports.server_info(self, self.check_memory())
