"""Rank 0's receiving thread under ``--max-queued-requests``: refusals that do not wait for a step.

The scheduler's loop reads its socket between steps, and one step (a long prefill on a CPU)
can take seconds: requests arriving meanwhile would wait in the socket, a queue nobody bounds,
and a refusal would come only after the step. With a bound set, this thread receives instead.
A generate request that would put more than N requests waiting (the scheduler's waiting and
grammar queues as the loop last reported them, plus the requests handed over since) is refused
at once, over this thread's own socket to the detokenizer (``SchedErrorOut`` ``overloaded``,
what the scheduler's own check in ``add_request`` sends); every other message goes to the
loop's inbox, in arrival order.

Threads: this thread alone uses the PULL socket (handed over at start) and its error socket;
the loop alone takes from the inbox. Each counter has one writer (``handed`` and the bound's
``refused``: this thread; ``taken`` and ``waiting``: the loop), so no lock is needed. The loop
reports the queue before it counts what it took, so the estimate errs on the full side.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from runtime.protocol.ipc import PullSocket, PushSocket
from runtime.protocol.messages import DetokenizerInput, SchedErrorOut, TokenizedGenerateReq
from scheduler_proc.queue_bound import OVERLOADED, QueueBound

logger = logging.getLogger(__name__)


class AdmissionGate:
    """Receives for the loop and refuses what would overfill the queue (see the module docstring)."""

    def __init__(self, recv: PullSocket[Any], error_endpoint: str, limit: int) -> None:
        self.bound = QueueBound(limit)
        self.inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.waiting = 0  # the scheduler's waiting + grammar queues, as the loop last reported them
        self.handed = 0  # generate requests put in the inbox (this thread)
        self.taken = 0  # ... of which the loop has counted into ``waiting`` (the loop)
        self._taken_unreported = 0
        self._refusals_seen = 0
        self._thread = threading.Thread(
            target=self._run, args=(recv, error_endpoint), name="admission-gate", daemon=True
        )
        self._thread.start()

    def _run(self, recv: PullSocket[Any], error_endpoint: str) -> None:
        errors: PushSocket[Any] = PushSocket(error_endpoint, DetokenizerInput, bind=False)
        while True:
            recv.poll(None)
            while (msg := recv.recv_nowait()) is not None:
                if isinstance(msg, TokenizedGenerateReq):
                    refusal = self.bound.admit(self.waiting + self.handed - self.taken)
                    if refusal is not None:
                        errors.send(SchedErrorOut(msg.rid, OVERLOADED, refusal))
                        continue
                    self.handed += 1
                self.inbox.put(msg)

    def take(self, block_ms: int) -> list[Any]:
        """The messages received since the last call, waiting up to ``block_ms`` for the first."""
        msgs: list[Any] = []
        try:
            msgs.append(self.inbox.get(timeout=block_ms / 1000) if block_ms > 0 else self.inbox.get_nowait())
        except queue.Empty:
            return msgs
        while True:
            try:
                msgs.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        self._taken_unreported += sum(isinstance(m, TokenizedGenerateReq) for m in msgs)
        return msgs

    def report(self, num_waiting: int) -> int:
        """The loop's queue after handling what it took (or after a step); returns the refusals
        made since the last report (for the scheduler's counters)."""
        self.waiting = num_waiting
        self.taken += self._taken_unreported  # after ``waiting`` counts them: never an undercount
        self._taken_unreported = 0
        refused = self.bound.refused - self._refusals_seen
        self._refusals_seen += refused
        return refused
