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

Layout: this module is the step loop, the order in which one step does its jobs. Each job
is a mixin of its own, over the parts ``scheduler_wiring`` builds (the constructor):
``scheduler_input`` (messages, requests, aborts), ``scheduler_launch`` (the next batch),
``scheduler_decode_room`` (decode KV, retraction, preemption, requeue), ``scheduler_results``
(tokens, finish, release, the outbox) and ``scheduler_control`` (control requests, reports,
idle checks). They are the executor; the other modules of ``scheduler_proc`` decide.
"""

from __future__ import annotations

from scheduler_proc.deadlines import TIMEOUT_MESSAGE
from scheduler_proc.model_worker import can_plan_ahead
from scheduler_proc.scheduler_control import SchedulerControlMixin
from scheduler_proc.scheduler_decode_room import SchedulerDecodeRoomMixin
from scheduler_proc.scheduler_input import SchedulerInputMixin
from scheduler_proc.scheduler_launch import SchedulerLaunchMixin
from scheduler_proc.scheduler_results import SchedulerResultsMixin


class Scheduler(
    SchedulerInputMixin, SchedulerLaunchMixin, SchedulerDecodeRoomMixin, SchedulerResultsMixin, SchedulerControlMixin
):
    """One TP rank's scheduler. Usable in-process (tests call ``handle_message``/``step``).

    ``Scheduler(server_args, tp_rank=0, model_runner=None, kv_events=False)``: the constructor
    is ``SchedulerWiring``'s; the methods are the mixins' (see the module docstring).
    """

    def step(self) -> bool:
        """Launch the next batch if there is work, and process the previous one. True if one launched."""
        if len(self.deadlines) and self.args.tp_size == 1:  # (under TP: scheduler_process, as messages)
            for rid in self.expired_rids():
                self.abort(rid, TIMEOUT_MESSAGE)
        if len(self.grammars):  # first: whether to plan ahead depends on the waiting queue
            self._admit_compiled()
        if self.inflight is not None and not can_plan_ahead(
            self.inflight,
            self.queues,
            mixed_chunk=self.args.enable_mixed_chunk,
            speculative=self.spec is not None,
            preemption_pending=self.preemption is not None and self.preemption.pending,
        ):
            self._complete_inflight()
        self._apply_aborts()
        if self.profiler.due:  # (its num_steps seen: the trace is written with nothing in flight)
            self.profile_due()
        if self.weight_update is not None:  # reloads once no request runs (admission waits meanwhile)
            self.advance_weight_update()
        launched = self._launch_next()
        if launched is not None:
            self.profiler.forward_step()
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
