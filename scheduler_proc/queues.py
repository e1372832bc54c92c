"""The scheduler's request queues, and the only operations that move a request between them.

A live request is in exactly one place:

- ``waiting``: queued, holding no row and no lock (a retracted or requeued request goes
  back to the *front*, so it resumes before newer arrivals);
- ``running``: prefilled, decoding from the next step on (it owns its row and the slots
  past its locked prefix);
- ``chunked``: the one request whose prompt is half prefilled (it keeps its row and the
  lock on what it computed so far between chunks).

Owner: the ``Scheduler`` alone. Other modules (admission, decode memory, reports) read the
queues through the read-only views and return decisions; the scheduler carries them out
through these methods, together with its own memory-release path.
"""

from __future__ import annotations

from typing import Sequence

from scheduler_proc.req import Req


class RequestQueues:
    """waiting / running / chunked; see the module docstring for what each holds and who writes them."""

    def __init__(self) -> None:
        self._waiting: list[Req] = []
        self._running: list[Req] = []
        self._chunked: Req | None = None

    # ------------------------------------------------------------------ views

    @property
    def waiting(self) -> Sequence[Req]:
        """Queued requests, in the order they are offered to admission (read-only view)."""
        return self._waiting

    @property
    def running(self) -> Sequence[Req]:
        """Requests that decode, in the order they joined (read-only view)."""
        return self._running

    @property
    def chunked(self) -> Req | None:
        """The request whose prompt is half prefilled, if any."""
        return self._chunked

    def holders(self) -> list[Req]:
        """Every request that holds a row and a prefix lock: the running ones and the chunked one."""
        return self._running + ([self._chunked] if self._chunked is not None else [])

    def is_empty(self) -> bool:
        return not self._running and not self._waiting and self._chunked is None

    # -------------------------------------------------------------- movements

    def add(self, req: Req) -> None:
        """A new request joins the back of the queue."""
        self._waiting.append(req)

    def remove_waiting(self, req: Req) -> None:
        """A queued request leaves without running (aborted, or rejected as too big)."""
        self._waiting.remove(req)

    def take(self, req: Req) -> None:
        """A planned prefill takes ``req`` out of the queue (a continuing chunk is not in it)."""
        if req in self._waiting:
            self._waiting.remove(req)

    def start_running(self, req: Req) -> None:
        """``req``'s prompt is fully prefilled (or its first token in flight): it decodes from now on."""
        self._running.append(req)

    def remove_running(self, req: Req) -> None:
        """A running request stops (aborted, or out of memory)."""
        self._running.remove(req)

    def drop_finished(self, finished: set[Req]) -> None:
        """Finished requests leave the running set (one pass, order of the others kept)."""
        self._running = [r for r in self._running if r not in finished]

    def retract(self, req: Req) -> None:
        """A running request gives its memory back and waits at the front of the queue."""
        self._running.remove(req)
        self._waiting.insert(0, req)

    def requeue(self, req: Req) -> None:
        """Undo the scheduling of ``req`` (a prefill that could not allocate, a chunk giving way):
        it waits at the front of the queue, and is no longer the chunked request."""
        if req not in self._waiting:
            self._waiting.insert(0, req)
        if self._chunked is req:
            self._chunked = None

    def set_chunked(self, req: Req | None) -> None:
        """The request whose prompt continues next round (None: no prompt is half prefilled)."""
        self._chunked = req
