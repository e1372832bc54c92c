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
plus the slots past its locked prefix. The scheduler owns its ``queues``: only its
executors move a request between them; admission and ``DecodeMemory`` decide, the
executors carry the decisions out (and release memory through ``tree_cache``).

Layout: ``scheduler_wiring`` builds the parts, the deciders and the executors, one job each
(``scheduler_input``: requests and aborts in; ``scheduler_launch``: the next batch and the room it
needs; ``scheduler_results``: the step in flight and its tokens; ``scheduler_release``: memory
going back). This module is the step loop, the order in which one step calls them, and the
control side: control requests, server info, load reports, idle and memory checks, weight updates.
Those read (or, for ``flush_cache`` and a weight update, reset) the whole scheduler at a quiet
point, so they belong to the whole: each first completes the step in flight, so what it reads is
the exact host state; the read-outs themselves are ``reports``' (pure functions of the parts). The
profiler's start and stop (``profiler``) are answered at once; a weight update (``weight_update``)
is answered once it is done: the step loop carries it out when no request runs.
"""

from __future__ import annotations

import logging
from typing import Any

from memory.invariant import InvariantReport
from runtime.config.args import ServerArgs
from runtime.protocol.messages import (
    LoadReport,
    SchedAbortReq,
    SchedControlOut,
    SchedControlReq,
    SchedulerInput,
    TokenizedGenerateReq,
)
from scheduler_proc import reports
from scheduler_proc.deadlines import TIMEOUT_MESSAGE
from scheduler_proc.model_worker import ForwardRunner, LaunchedStep, can_plan_ahead
from scheduler_proc.profiler import ProfileError
from scheduler_proc.scheduler_input import CLIENT_ABORT
from scheduler_proc.scheduler_wiring import SchedulerWiring
from scheduler_proc.weight_update import ABORTED_FOR_UPDATE, PendingWeightUpdate, quiet, reply

logger = logging.getLogger(__name__)


class Scheduler(SchedulerWiring):
    """One TP rank's scheduler. Usable in-process (tests call ``handle_message``/``step``).

    The parts are ``SchedulerWiring``'s; this class adds the step loop and the control side
    (see the module docstring).
    """

    def __init__(
        self,
        server_args: ServerArgs,
        tp_rank: int = 0,
        model_runner: ForwardRunner | None = None,
        kv_events: bool = False,
        dp_rank: int = 0,
    ) -> None:
        super().__init__(server_args, tp_rank, model_runner, kv_events, dp_rank)
        # /update_weights_from_disk waiting for the running requests to finish (weight_update.py).
        self.weight_update: PendingWeightUpdate | None = None
        self.last_invariant: InvariantReport | None = None
        self._was_idle = True

    # ------------------------------------------------------------------ the step loop

    def step(self) -> bool:
        """Launch the next batch if there is work, and process the previous one. True if one launched."""
        results = self.results
        if len(self.deadlines) and self.args.tp_size == 1:  # (under TP: scheduler_process, as messages)
            for rid in self.expired_rids():
                self.abort(rid, TIMEOUT_MESSAGE)
        if len(self.grammars):  # first: whether to plan ahead depends on the waiting queue
            self.intake.admit_compiled()
        if results.inflight is not None and not can_plan_ahead(
            results.inflight,
            self.queues,
            mixed_chunk=self.args.enable_mixed_chunk,
            speculative=self.spec is not None,
            preemption_pending=self.preemption is not None and self.preemption.pending,
        ):
            results.complete()
        self._apply_aborts()
        if self.profiler.due:  # (its num_steps seen: the trace is written with nothing in flight)
            self.profile_due()
        if self.weight_update is not None:  # reloads once no request runs (admission waits meanwhile)
            self.advance_weight_update()
        if self.lora_control is not None and self.lora_control.pending():  # unloads whose requests are done
            self.drain()  # (nothing in flight reads an adapter being dropped)
            self.lora_control.advance()
        # A weight update waits for the running requests: no new one starts meanwhile (weight_update.py).
        launched = self.launcher.launch_next(admission_paused=self.weight_update is not None)
        if launched is not None:
            self.profiler.forward_step()
        if results.inflight is not None:
            results.complete()  # while ``launched`` runs
        results.inflight = launched
        if launched is not None and not self.worker.overlap:
            results.complete()
        if launched is None and self.is_idle():
            if not self._was_idle:
                self.on_idle()
            self._was_idle = True
        else:
            self._was_idle = False
        return launched is not None

    @property
    def inflight(self) -> LaunchedStep | None:
        """The step launched and not yet processed (``StepResults`` holds it)."""
        return self.results.inflight

    def drain(self) -> None:
        """Process the step in flight, if any: afterwards the host state is exact."""
        self.results.drain()

    def _apply_aborts(self) -> None:
        """Finish requests marked for abort through the normal release path."""
        for req in [r for r in self.queues.running if r.to_abort]:
            self.queues.remove_running(req)
            self.release.finish(req, {"type": "abort", "message": req.to_abort})
        chunked = self.queues.chunked
        if chunked is not None and chunked.to_abort:
            self.queues.set_chunked(None)
            self.release.finish(chunked, {"type": "abort", "message": chunked.to_abort})

    # ------------------------------------------------------------------ inputs and outputs

    def handle_message(self, msg: SchedulerInput) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.stats["num_received"] += 1
            req = self.intake.add_request(msg)
            if req is not None and msg.deadline is not None and self.tp_rank == 0:
                self.deadlines.add(req, msg.deadline)
        elif isinstance(msg, SchedAbortReq):
            self.abort(msg.rid, msg.reason or CLIENT_ABORT)
        elif isinstance(msg, SchedControlReq):
            self.control_request(msg)  # (some are answered later: a weight update)

    def abort(self, rid: str, message: str = CLIENT_ABORT) -> None:
        """Abort one request (or all when rid is ''): queued ones at once, others at the next step."""
        self.intake.abort(rid, message)

    def num_waiting(self) -> int:
        """Requests received and not running: what --max-queued-requests bounds."""
        return self.intake.num_waiting()

    def expired_rids(self) -> list[str]:
        """The live requests whose deadline has passed (rank 0 decides; scheduler_proc.deadlines)."""
        return [req.rid for req in self.deadlines.expired()]

    def take_outbox(self) -> list[Any]:
        """The outputs since the last call (tokens, finishes, control replies), for the process to send."""
        return self.output.take_outbox()

    # ------------------------------------------------------------------ control, reports, idle checks

    def is_idle(self) -> bool:
        return (
            self.queues.is_empty() and self.inflight is None and not len(self.grammars) and self.weight_update is None
        )

    def receive_timeout_ms(self) -> int:
        """How long the loop may block for new messages before the next step: not at all while
        requests run or a weight update waits, briefly while only grammars compile (their readiness
        is polled), else 1 s."""
        if not self.queues.is_empty() or self.inflight is not None or self.weight_update is not None:
            return 0
        return 1 if len(self.grammars) else 1000

    def on_idle(self) -> InvariantReport:
        report = self.check_memory()
        if not report.ok:
            logger.error("memory invariant violated when idle: %s", report.message)
        return report

    def check_memory(self) -> InvariantReport:
        self.drain()
        self.last_invariant = reports.memory_invariant(
            self.queues, self.allocator, self.tree_cache, self.req_to_token_pool, self.max_total_tokens, self.host_tier
        )
        return self.last_invariant

    def kv_usage(self) -> float:
        return reports.kv_usage(self.allocator, self.tree_cache, self.max_total_tokens)

    def control_request(self, msg: SchedControlReq) -> None:
        """Answer a control request: now, or for a weight update once it is done."""
        if msg.kind == "update_weights":
            self._begin_weight_update(msg)
            return
        if msg.kind in ("load_lora", "unload_lora"):
            self._lora_adapter_request(msg)
            return
        if msg.kind in ("start_profile", "stop_profile"):
            self.drain()  # (a stop's trace holds the steps so far; under TP the ranks agree: a collective)
            try:
                if msg.kind == "stop_profile":
                    payload = self.profiler.stop()
                elif msg.profile is None:
                    payload = {"success": False, "error": "invalid_request", "message": "start_profile without options"}
                else:
                    payload = self.profiler.start(msg.profile)
            except ProfileError as exc:
                payload = {"success": False, "error": exc.code, "message": exc.message}
        else:
            payload = self.control(msg.kind)
        self.output.outbox.append(SchedControlOut(msg.rid, msg.kind, payload))

    def control(self, kind: str) -> dict[str, Any]:
        self.drain()
        if kind == "flush_cache":
            if not self.is_idle():
                return {"success": False, "message": "requests are running; flush when idle"}
            self._flush_prefix_cache()
            return {"success": True}
        if kind == "server_info":
            return self.server_info()
        return {"success": False, "message": f"unknown control request {kind!r}"}

    def _flush_prefix_cache(self) -> None:
        """With no request holding KV (none running; a waiting one holds at most a match): every
        slot and row goes back, and no cached prefix is left."""
        for req in self.queues.waiting:
            self.tree_cache.drop_match(req)
        self.tree_cache.reset()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    def _lora_adapter_request(self, msg: SchedControlReq) -> None:
        """Load an adapter now, or begin its unload (answered once its requests have finished)."""
        control = self.lora_control
        if control is None or msg.lora is None:
            why = (
                "this server serves no LoRA adapters (start it with --enable-lora)" if control is None else "no adapter"
            )
            payload = {"success": False, "message": why, "loaded_adapters": []}
            self.output.outbox.append(SchedControlOut(msg.rid, msg.kind, payload))
            return
        self.drain()  # (the step in flight may still write an adapter into its slot)
        if msg.kind == "load_lora":
            control.load(msg.rid, msg.lora)
        else:
            control.begin_unload(msg.rid, msg.lora)

    def _begin_weight_update(self, msg: SchedControlReq) -> None:
        """Hold admission until the running requests have finished (or abort them all first)."""
        if msg.weights is None or self.weight_update is not None:
            why = "a weight update is already in progress" if msg.weights is not None else "no weights given"
            payload = reply(False, why, 0, self.served_weights)
            self.output.outbox.append(SchedControlOut(msg.rid, msg.kind, payload))
            return
        self.weight_update = PendingWeightUpdate(msg.rid, msg.weights)
        running = len(self.queues.holders())
        logger.info(
            "weight update from %s: %s",
            msg.weights.model_path,
            "aborting every request first"
            if msg.weights.abort_all_requests
            else f"admission paused until {running} running request(s) finish",
        )
        if msg.weights.abort_all_requests:
            self.abort("", ABORTED_FOR_UPDATE)

    def advance_weight_update(self) -> None:
        """Reload once no request runs (the step loop asks each step, every TP rank at the same one);
        a successful reload flushes the prefix cache, whose KV the old weights computed."""
        pending = self.weight_update
        if pending is None or not quiet(self.queues, self.inflight):
            return
        self.weight_update = None
        update = pending.update
        paused = self.num_waiting()
        reload = getattr(self.runner, "update_weights_from_disk", None)
        try:
            if reload is None:
                raise ValueError("this model runner cannot reload weights")
            reload(update.model_path, update.load_format)
        except ValueError as exc:  # (WeightReloadError): the served weights are in place (a failure to
            # put them back is not caught: the process ends, as a model of two checkpoints must not serve)
            payload = reply(False, f"weights not updated: {exc}", paused, self.served_weights)
        else:
            self._flush_prefix_cache()
            self.served_weights.model_path = update.model_path
            if update.weight_version is not None:
                self.served_weights.weight_version = update.weight_version
            message = f"Succeeded to update model weights from {update.model_path}."
            payload = reply(True, message, paused, self.served_weights)
        self.output.outbox.append(SchedControlOut(pending.rid, "update_weights", payload))

    def profile_due(self) -> None:
        """A profile with ``num_steps`` has seen them all: stop it, with nothing in flight."""
        if self.profiler.due:
            self.drain()
            self.profiler.stop_due()

    def load_report(self, dp_rank: int) -> LoadReport:
        return reports.load_report(dp_rank, self.queues, self.tree_cache, self.stats)

    def server_info(self) -> dict[str, Any]:
        """Memory, queues, counters and the memory invariant (checked now, with nothing in flight),
        the checkpoint served and its version, and whether a profile or a weight update is under way."""
        info = reports.server_info(self, self.check_memory())
        info["served_weights"] = self.served_weights.info()
        info["profiling"] = self.profiler.active
        info["weight_update_pending"] = self.weight_update is not None
        if self.lora is not None:
            manager = getattr(self.runner, "lora", None)  # (the model runner's: its rank and targets)
            info["lora"] = {**(manager.info() if manager is not None else {}), "adapters": self.lora.info()}
        return info
