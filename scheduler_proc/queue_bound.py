"""Bounded admission (``--max-queued-requests N``): a request that would make the wait too long is refused.

The bound is on what waits in *this* scheduler: its waiting queue (requests received but not
running, retracted ones included) plus its grammar queue (constrained requests whose grammar
compiles). A new request that would make that more than N is refused at once, when it is
received (never after a step), with the error code ``overloaded``: the client gets a
``RequestError`` / HTTP 503 with ``Retry-After``, and the request is never queued. Each of
``n`` samples is one scheduler request and takes one place; the tokenizer fails the whole
request when any sample is refused (and aborts the others), so the client sees one error.

With ``--dp-size`` every replica enforces its own N: a request the controller routes to a
full replica is refused even if another has room (the controller's view of the replicas'
queues is a step old; the replica's is exact), so the server as a whole holds at most
N x dp-size waiting requests. ``shortest_queue`` routing makes a refusal mean nearly every
replica is full.

Requests already inside are never refused later: retraction may push the queue past N.

In a served scheduler, rank 0's receiving thread (``scheduler_proc/admission_gate.py``) applies
the bound as requests arrive, while a step runs too, so a refusal never waits for a step; the
``Scheduler`` applies it again on receipt (which is all an in-process scheduler has).

Owner: the gate and the ``Scheduler`` ask ``admit`` before queueing (each its own instance);
this module reads the lengths and keeps the refusal count.
"""

from __future__ import annotations

OVERLOADED = "overloaded"  # the error code (runtime.client.RequestError.code; HTTP 503, Retry-After 1)


class QueueBound:
    """At most ``limit`` waiting requests (None: unbounded); counts refusals for server_info."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.refused = 0

    def admit(self, num_waiting: int) -> str | None:
        """None when one more request may wait behind ``num_waiting``; else the refusal's message."""
        if self.limit is None or num_waiting < self.limit:
            return None
        self.refused += 1
        return (
            f"the server is overloaded: {num_waiting} requests are waiting, the most "
            f"--max-queued-requests allows ({self.limit}); retry later"
        )
