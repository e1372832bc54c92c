"""The scheduler's control side: control requests, server info, load reports, idle and memory checks.

Why a module of its own: these read (or, for ``flush_cache``, reset) the whole scheduler at
a quiet point rather than move requests, and they grow with every operator-facing feature.
Each first completes the step in flight, so what it reads is the exact host state; the
read-outs themselves are ``reports``' (pure functions of the parts). The profiler's start and stop
(``profiler``) are answered at once; a weight update (``weight_update``) is answered once it is
done: the step loop carries it out when no request runs (``advance_weight_update``).
"""

from __future__ import annotations

import logging
from typing import Any

from memory.invariant import InvariantReport
from runtime.protocol.messages import LoadReport, SchedControlOut, SchedControlReq
from scheduler_proc import reports
from scheduler_proc.profiler import ProfileError
from scheduler_proc.scheduler_wiring import SchedulerWiring
from scheduler_proc.weight_update import ABORTED_FOR_UPDATE, PendingWeightUpdate, quiet, reply

logger = logging.getLogger(__name__)


class SchedulerControlMixin(SchedulerWiring):
    """Answers control requests and reports on the scheduler's state."""

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
        free = self.allocator.available_size() + self.tree_cache.evictable_size()
        return 1.0 - free / self.max_total_tokens

    def control_request(self, msg: SchedControlReq) -> None:
        """Answer a control request: now, or for a weight update once it is done."""
        if msg.kind == "update_weights":
            self._begin_weight_update(msg)
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

    # ------------------------------------------------------------------ weight updates

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
        return info
