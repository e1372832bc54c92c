"""The admission gate (rank 0's receiving thread under --max-queued-requests) over real ipc
sockets: a request that would overfill the queue is refused while the loop is busy elsewhere
(nobody calls ``take``), the others reach the loop in order, control and abort messages always
pass, and a freed place admits again."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Iterator

import pytest

from runtime.protocol.ipc import PullSocket, PushSocket
from runtime.protocol.messages import (
    DetokenizerInput,
    SchedAbortReq,
    SchedErrorOut,
    SchedulerInput,
    TokenizedGenerateReq,
)
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.admission_gate import AdmissionGate


@pytest.fixture
def sockets() -> Iterator[tuple[PushSocket[Any], AdmissionGate, PullSocket[Any]]]:
    with tempfile.TemporaryDirectory(prefix="gate-") as d:
        scheduler_in = f"ipc://{Path(d) / 'scheduler'}"
        detokenizer = f"ipc://{Path(d) / 'detokenizer'}"
        errors: PullSocket[Any] = PullSocket(detokenizer, DetokenizerInput, bind=True)
        gate = AdmissionGate(PullSocket(scheduler_in, SchedulerInput, bind=True), detokenizer, limit=2)
        sender: PushSocket[Any] = PushSocket(scheduler_in, SchedulerInput, bind=False)
        yield sender, gate, errors
        sender.close()


def generate(rid: str) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid=rid, input_ids=[1, 2], sampling_params=SamplingParams(max_new_tokens=2))


def take_all(gate: AdmissionGate, count: int) -> list[Any]:
    got: list[Any] = []
    while len(got) < count:
        more = gate.take(5000)
        assert more, f"only {len(got)} of {count} messages reached the loop"
        got += more
    return got


def test_over_the_bound_is_refused_without_the_loop(
    sockets: tuple[PushSocket[Any], AdmissionGate, PullSocket[Any]],
) -> None:
    sender, gate, errors = sockets
    for rid in ("a", "b", "c"):
        sender.send(generate(rid))
    refusal = errors.recv(5000)  # the loop has taken nothing: the gate answered by itself
    assert isinstance(refusal, SchedErrorOut) and (refusal.rid, refusal.code) == ("c", "overloaded")
    sender.send(SchedAbortReq("a"))  # not a request: always passes, in order
    got = take_all(gate, 3)
    assert [type(m).__name__ for m in got] == ["TokenizedGenerateReq"] * 2 + ["SchedAbortReq"]
    assert [m.rid for m in got] == ["a", "b", "a"]
    assert gate.report(2) == 1  # both wait in the scheduler now; one refusal since the last report
    sender.send(generate("d"))
    assert errors.recv(5000).rid == "d"  # still full
    assert gate.report(1) == 1  # one of them started running: a place is free
    sender.send(generate("e"))
    assert [m.rid for m in take_all(gate, 1)] == ["e"]
    assert errors.recv(200) is None
