"""The front door's table of requests in flight: the one owner of the per-request routing state.

Every accepted generate request is a ``ReqGroup`` here from its acceptance until its last
output, an error or an abort; a request whose prompt is still being tokenized on the worker
thread is here too, by rid only ("building"), so that its rid counts as in flight and an
abort that arrives meanwhile is remembered ("abandoned"). ``RequestTable`` is the only code
that adds or removes entries: the intake (tokenizer_manager.py) and the output routing
(output_routing.py) ask it through these methods. It owns no sockets and sends nothing:
what an entry's removal means (abort in the scheduler, a last reply) is its callers' job.
"""

from __future__ import annotations

from typing import Callable

from tokenizer_proc.routing_state import ReqGroup, SampleState


class RequestTable:
    """The requests in flight, by client and by internal rid, and the per-client counts that
    the ``--max-requests-per-client`` limit reads (issue 17's fairness)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[bytes, str], ReqGroup] = {}  # (client identity, client rid) -> group
        self._samples: dict[str, tuple[ReqGroup, SampleState]] = {}  # internal rid -> unfinished sample
        self._rids_by_client: dict[bytes, set[str]] = {}  # client identity -> client rids of its groups
        self._samples_by_client: dict[bytes, int] = {}  # client identity -> samples of its groups
        self._building: dict[bytes, set[str]] = {}  # client identity -> rids being tokenized
        self._abandoned: set[tuple[bytes, str]] = set()  # aborted while being tokenized
        # Told whenever a group leaves the table (a drain waits for it to empty).
        self.on_remove: Callable[[], None] | None = None

    # ------------------------------------------------------------------ accepted requests

    def add(self, group: ReqGroup) -> None:
        """Register an accepted request: its samples' outputs are routed to it from now on."""
        self._groups[(group.identity, group.client_rid)] = group
        self._samples_by_client[group.identity] = self._samples_by_client.get(group.identity, 0) + group.n
        self._rids_by_client.setdefault(group.identity, set()).add(group.client_rid)
        for sample in group.samples:
            self._samples[sample.internal_rid] = (group, sample)

    def remove(self, group: ReqGroup) -> None:
        """Forget ``group`` and all its samples. Idempotent: a group removed already is a no-op,
        also once its client has reused the rid for a newer group (which stays)."""
        for sample in group.samples:  # internal rids are unique to their group
            self._samples.pop(sample.internal_rid, None)
        key = (group.identity, group.client_rid)
        if self._groups.get(key) is not group:
            return
        del self._groups[key]
        left = self._samples_by_client.get(group.identity, 0) - group.n
        if left > 0:
            self._samples_by_client[group.identity] = left
        else:
            self._samples_by_client.pop(group.identity, None)
        rids = self._rids_by_client[group.identity]
        rids.discard(group.client_rid)
        if not rids:
            del self._rids_by_client[group.identity]
        if self.on_remove is not None:
            self.on_remove()

    def sample(self, internal_rid: str) -> tuple[ReqGroup, SampleState] | None:
        """The group and sample an output of the scheduler belongs to; None once the sample has
        finished or its group was removed (nobody is waiting for it)."""
        return self._samples.get(internal_rid)

    def sample_finished(self, internal_rid: str) -> None:
        """The sample's last output was routed: later messages for it are no one's."""
        self._samples.pop(internal_rid, None)

    def group(self, identity: bytes, client_rid: str) -> ReqGroup | None:
        return self._groups.get((identity, client_rid))

    def contains(self, identity: bytes, client_rid: str) -> bool:
        return (identity, client_rid) in self._groups

    def groups_of(self, identity: bytes) -> list[ReqGroup]:
        """The client's groups in flight (a list: the caller may remove them as it goes)."""
        return [self._groups[(identity, rid)] for rid in self._rids_by_client.get(identity, ())]

    def all_groups(self) -> list[ReqGroup]:
        return list(self._groups.values())

    def clients(self) -> list[bytes]:
        """Identities of the clients with requests in flight (what the probe loop checks)."""
        return list(self._rids_by_client)

    def samples_in_flight(self, identity: bytes) -> int:
        """Scheduler requests of the client's accepted groups (``--max-requests-per-client``)."""
        return self._samples_by_client.get(identity, 0)

    # ------------------------------------------------------------------ requests being tokenized

    def begin_build(self, identity: bytes, client_rid: str) -> None:
        """The request's prompt goes to the worker thread: its rid is in flight meanwhile."""
        self._building.setdefault(identity, set()).add(client_rid)

    def end_build(self, identity: bytes, client_rid: str) -> bool:
        """Tokenizing ended (done, failed or cancelled); True when the client aborted the
        request meanwhile (it is then accepted and aborted at once)."""
        rids = self._building.get(identity)
        if rids is not None:
            rids.discard(client_rid)
            if not rids:
                del self._building[identity]
        abandoned = (identity, client_rid) in self._abandoned
        self._abandoned.discard((identity, client_rid))
        return abandoned

    def is_building(self, identity: bytes, client_rid: str) -> bool:
        return client_rid in self._building.get(identity, ())

    def num_building(self, identity: bytes) -> int:
        return len(self._building.get(identity, ()))

    def abandon(self, identity: bytes, client_rid: str) -> bool:
        """An abort of a request still being tokenized: it is aborted once accepted. False
        when the request is not being tokenized (nothing was marked)."""
        if not self.is_building(identity, client_rid):
            return False
        self._abandoned.add((identity, client_rid))
        return True

    # ------------------------------------------------------------------ figures

    @property
    def num_groups(self) -> int:
        return len(self._groups)

    @property
    def num_unfinished_samples(self) -> int:
        return len(self._samples)

    @property
    def num_clients(self) -> int:
        return len(self._rids_by_client)

    def is_empty(self) -> bool:
        """Nothing in flight, nothing being tokenized, no abort pending."""
        return not (
            self._groups
            or self._samples
            or self._rids_by_client
            or self._samples_by_client
            or self._building
            or self._abandoned
        )
