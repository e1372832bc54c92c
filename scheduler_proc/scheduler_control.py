"""The scheduler's control side: control requests, server info, load reports, idle and memory checks.

Why a module of its own: these read (or, for ``flush_cache``, reset) the whole scheduler at
a quiet point rather than move requests, and they grow with every operator-facing feature.
Each first completes the step in flight, so what it reads is the exact host state; the
read-outs themselves are ``reports``' (pure functions of the parts).
"""

from __future__ import annotations

import logging
from typing import Any

from memory.invariant import InvariantReport
from runtime.protocol.messages import LoadReport
from scheduler_proc import reports
from scheduler_proc.scheduler_wiring import SchedulerWiring

logger = logging.getLogger(__name__)


class SchedulerControlMixin(SchedulerWiring):
    """Answers control requests and reports on the scheduler's state."""

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
        self.last_invariant = reports.memory_invariant(
            self.queues, self.allocator, self.tree_cache, self.req_to_token_pool, self.max_total_tokens, self.host_tier
        )
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
