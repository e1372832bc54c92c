"""Request deadlines: which live requests have passed theirs, found cheaply once per step.

A request may carry a deadline (``TokenizedGenerateReq.deadline``: an absolute
``time.monotonic()``, computed by the tokenizer at the request's arrival from its
``deadline_s`` or ``--request-timeout``; CLOCK_MONOTONIC is system-wide, and every scheduler
that receives requests runs on the tokenizer's node). Still waiting (queue, grammar queue) or
running at that time, it is aborted through the scheduler's normal abort path (its KV freed
there), finishing with ``{"type": "abort", "message": "timeout"}``.

Cost: a min-heap keyed by deadline. A step with no deadline anywhere costs one length check;
otherwise it looks at the heap's top only, and pops what expired. Requests that finish before
their deadline are not removed (that would need a hook in every finish path): they are
skipped when popped, and the heap is compacted whenever it has doubled since the last
compaction, so it holds at most about twice the live requests with deadlines (amortised O(1)).

Owner: the ``Scheduler``. This module only decides who expired; the scheduler aborts them.
Under tensor parallelism only rank 0 decides (ranks' clocks are read at different moments):
its expiries reach every rank as ``SchedAbortReq(rid, reason="timeout")`` with the inputs
(``scheduler_proc.scheduler_process``), so every rank aborts at the same step.
"""

from __future__ import annotations

import heapq
import itertools
import time
from typing import Callable

from scheduler_proc.req import Req

TIMEOUT_MESSAGE = "timeout"  # the finish reason's message of an expired request
_MIN_COMPACT = 64  # never compact a heap smaller than this


class Deadlines:
    """The deadlines of live requests; see the module docstring."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # tests pass a fake clock
        self._heap: list[tuple[float, int, Req]] = []
        self._seq = itertools.count()  # tie-break: Req is not ordered
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        """Entries held (finished requests not yet dropped included): 0 means nothing to check."""
        return len(self._heap)

    def add(self, req: Req, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), req))
        if len(self._heap) >= self._compact_at:
            self._compact()

    def expired(self, now: float | None = None) -> list[Req]:
        """Pop the unfinished requests whose deadline is at or before ``now`` (default: the clock)."""
        heap = self._heap
        if not heap:
            return []
        now = self._clock() if now is None else now
        out: list[Req] = []
        while heap and heap[0][0] <= now:
            req = heapq.heappop(heap)[2]
            if req.finish_reason is None and req.to_abort is None:
                out.append(req)
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline held (it may belong to a request that already finished)."""
        return self._heap[0][0] if self._heap else None

    def _compact(self) -> None:
        """Drop finished requests; the next compaction waits until the heap has doubled again."""
        self._heap = [e for e in self._heap if e[2].finish_reason is None]
        heapq.heapify(self._heap)
        self._compact_at = max(_MIN_COMPACT, 2 * len(self._heap))
