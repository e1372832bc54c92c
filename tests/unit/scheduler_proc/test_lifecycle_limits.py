"""Bounded admission (--max-queued-requests) and request deadlines, in-process over the stub model.

Deadlines run on a fake clock (``Deadlines(clock=...)``), so "at the deadline" is a step, not a sleep.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.config.args import ServerArgs
from runtime.protocol.messages import SchedAbortReq, SchedErrorOut, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.deadlines import Deadlines
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_runner import StubModelRunner
from tests.support.stub_scheduler import EOS, VOCAB, assert_idle_invariant, collect, expected_output, run_until_idle


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=[False, True], ids=["serial", "overlap"])
def overlap(request: pytest.FixtureRequest) -> bool:
    return request.param


def make(overlap: bool, clock: FakeClock | None = None, max_running_requests: int = 256, **overrides: Any) -> Scheduler:
    """The stub scheduler; the running limit is the model runner's (as the real one derives it)."""
    args = ServerArgs(max_total_tokens=8192, disable_overlap_schedule=not overlap, **overrides)
    runner = StubModelRunner(
        max_total_tokens=8192, vocab_size=VOCAB, eos_token_ids=(EOS,), max_running_requests=max_running_requests
    )
    sched = Scheduler(args, model_runner=runner)
    if clock is not None:
        sched.deadlines = Deadlines(clock=clock)
    return sched


def submit(
    sched: Scheduler,
    rid: str,
    prompt: list[int],
    max_new_tokens: int,
    deadline: float | None = None,
    stream: bool = False,
) -> None:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    sched.handle_message(
        TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params, stream=stream, deadline=deadline)
    )


PROMPT = [5, 6, 7, 8, 9]


# ---------------------------------------------------------------------------- bounded admission


def test_over_the_bound_is_refused_at_once_then_the_queue_drains(overlap: bool) -> None:
    sched = make(overlap, max_queued_requests=2, max_running_requests=1)
    submit(sched, "a", PROMPT, 8)
    submit(sched, "b", PROMPT + [1], 8)
    submit(sched, "c", PROMPT + [2], 8)  # a third waiting request: over the bound
    # Refused when received, before any step ran.
    refused = [m for m in sched.take_outbox() if isinstance(m, SchedErrorOut)]
    assert [(m.rid, m.code) for m in refused] == [("c", "overloaded")]
    assert "--max-queued-requests" in refused[0].message
    assert len(sched.queues.waiting) == 2
    results = run_until_idle(sched)
    assert "c" not in results
    assert results["a"]["ids"] == expected_output(PROMPT, 8)
    assert results["b"]["ids"] == expected_output(PROMPT + [1], 8)
    # Drained: later requests are accepted again.
    submit(sched, "d", PROMPT + [3], 4)
    results = run_until_idle(sched)
    assert results["d"]["ids"] == expected_output(PROMPT + [3], 4)
    info = sched.server_info()
    assert info["num_refused_overloaded"] == 1
    assert info["memory_invariant"]["ok"]
    assert_idle_invariant(sched)


def test_running_requests_do_not_count_against_the_bound(overlap: bool) -> None:
    sched = make(overlap, max_queued_requests=1, max_running_requests=1)
    submit(sched, "a", PROMPT, 20)
    sched.step()  # "a" runs
    collect(sched, {})
    submit(sched, "b", PROMPT + [1], 4)  # waits: 1 in the queue, the bound
    submit(sched, "c", PROMPT + [2], 4)  # refused
    results: dict[str, dict] = {}
    collect(sched, results)
    assert results == {"c": {"error": "overloaded"}}
    run_until_idle(sched, results)
    assert results["a"]["reason"]["type"] == results["b"]["reason"]["type"] == "length"
    assert_idle_invariant(sched)


def test_unbounded_by_default(overlap: bool) -> None:
    sched = make(overlap, max_running_requests=1)
    for i in range(20):
        submit(sched, f"r{i}", PROMPT + [i + 1], 2)
    results = run_until_idle(sched)
    assert all(results[f"r{i}"]["reason"]["type"] == "length" for i in range(20))
    assert sched.stats["num_refused_overloaded"] == 0


# ---------------------------------------------------------------------------- deadlines


def test_deadline_aborts_a_waiting_request(overlap: bool) -> None:
    clock = FakeClock()
    sched = make(overlap, clock, max_running_requests=1)
    submit(sched, "long", PROMPT, 40)
    submit(sched, "late", PROMPT + [1], 8, deadline=clock.now + 5)
    results: dict[str, dict] = {}
    for _ in range(4):
        sched.step()
        collect(sched, results)
    assert sched.queues.waiting and sched.queues.waiting[0].rid == "late"
    assert "late" not in results
    clock.now += 5  # at the deadline
    sched.step()
    collect(sched, results)
    assert results["late"] == {
        "ids": [],
        "finished": True,
        "reason": {"type": "abort", "message": "timeout"},
        "cached": 0,
    }
    run_until_idle(sched, results)
    assert results["long"]["ids"] == expected_output(PROMPT, 40)  # the others are not disturbed
    assert sched.stats["num_timed_out"] == 1
    assert_idle_invariant(sched)


def test_deadline_aborts_a_running_request_at_the_next_step(overlap: bool) -> None:
    clock = FakeClock()
    sched = make(overlap, clock)
    submit(sched, "r", PROMPT, 200, deadline=clock.now + 1, stream=True)
    submit(sched, "other", PROMPT + [1], 30)
    results: dict[str, dict] = {}
    for _ in range(6):
        sched.step()
        collect(sched, results)
    assert not results["r"]["finished"] and results["r"]["ids"]
    clock.now += 1.0
    sched.step()  # one step: the step in flight completes, then the abort goes through the release path
    collect(sched, results)
    r = results["r"]
    assert r["finished"] and r["reason"] == {"type": "abort", "message": "timeout"}
    assert 0 < len(r["ids"]) < 200
    assert r["ids"] == expected_output(PROMPT, len(r["ids"]))
    run_until_idle(sched, results)
    assert results["other"]["ids"] == expected_output(PROMPT + [1], 30)
    assert sched.stats["num_timed_out"] == 1
    assert_idle_invariant(sched)


def test_deadline_aborts_a_chunked_prefill(overlap: bool) -> None:
    clock = FakeClock()
    sched = make(overlap, clock, chunked_prefill_size=8)
    prompt = list(range(1, 60))
    submit(sched, "c", prompt, 4, deadline=clock.now + 1)
    sched.step()
    assert sched.queues.chunked is not None
    clock.now += 2
    results = run_until_idle(sched)
    assert results["c"]["reason"] == {"type": "abort", "message": "timeout"}
    assert_idle_invariant(sched)


def test_no_deadline_no_abort(overlap: bool) -> None:
    clock = FakeClock()
    sched = make(overlap, clock)
    submit(sched, "free", PROMPT, 30)
    submit(sched, "far", PROMPT + [1], 30, deadline=clock.now + 3600)
    results: dict[str, dict] = {}
    for _ in range(5):
        sched.step()
        clock.now += 100  # time passes, no deadline is reached
    run_until_idle(sched, results)
    assert results["free"]["ids"] == expected_output(PROMPT, 30)
    assert results["far"]["ids"] == expected_output(PROMPT + [1], 30)
    assert results["far"]["reason"]["type"] == "length"
    assert sched.stats["num_timed_out"] == 0
    assert len(sched.deadlines) == 1  # the finished request's entry: skipped when popped, or compacted
    clock.now += 3600
    assert sched.deadlines.expired() == []
    assert_idle_invariant(sched)


def test_timeout_abort_message_from_rank_zero(overlap: bool) -> None:
    """Under TP the other ranks get rank 0's expiries as SchedAbortReq(rid, "timeout")."""
    sched = make(overlap)
    submit(sched, "w", PROMPT, 8)
    sched.handle_message(SchedAbortReq("w", "timeout"))
    results = run_until_idle(sched)
    assert results["w"]["reason"] == {"type": "abort", "message": "timeout"}
    assert sched.stats["num_timed_out"] == 1
    submit(sched, "x", PROMPT, 8)
    sched.handle_message(SchedAbortReq("x"))
    assert run_until_idle(sched)["x"]["reason"] == {"type": "abort", "message": "aborted by the client"}


# ---------------------------------------------------------------------------- the heap


class _R:
    def __init__(self) -> None:
        self.finish_reason: dict | None = None
        self.to_abort: str | None = None


def test_deadlines_pop_in_order_and_compact() -> None:
    d = Deadlines(clock=lambda: 0.0)
    assert d.expired() == []
    reqs = [_R() for _ in range(128)]
    for i, r in enumerate(reqs[:64]):
        d.add(r, float(i))  # type: ignore[arg-type]
    for r in reqs[:60]:
        r.finish_reason = {"type": "length"}  # finished before their deadline: entries left behind
    for i, r in enumerate(reqs[64:], start=64):
        d.add(r, float(i))  # type: ignore[arg-type]
    assert len(d) == 68  # compacted when the heap doubled: the 60 finished ones dropped
    reqs[62].to_abort = "aborted by the client"  # already on its way out: not reported again
    assert d.expired(now=70.0) == [reqs[60], reqs[61], reqs[63], *reqs[64:71]]
    assert d.next_deadline() == 71.0
    assert d.expired() == []  # the clock says 0.0


def test_under_tp_rank_zero_sends_its_expiries_with_the_inputs() -> None:
    """scheduler_process: rank 0's expired deadlines join the broadcast inputs as timeout aborts
    (the scheduler itself expires them only when it is a lone rank)."""
    from scheduler_proc.scheduler_process import SchedulerIO

    clock = FakeClock()
    sched = make(False, clock, tp_size=2)
    submit(sched, "t", PROMPT, 8, deadline=clock.now + 1)
    io = object.__new__(SchedulerIO)  # no sockets, no TP group: just the merge of inputs
    io.recv, io.gate, io.tp_group, io.tp_rank = None, None, None, 0
    assert io.receive(0, sched) == []
    sched.step()
    clock.now += 1
    sched.step()  # tp_size 2: the scheduler leaves expiry to rank 0's loop
    assert sched.stats["num_timed_out"] == 0
    msgs = io.receive(0, sched)
    assert msgs == [SchedAbortReq("t", "timeout")]
    for msg in msgs:
        sched.handle_message(msg)
    results = run_until_idle(sched)
    assert results["t"]["reason"] == {"type": "abort", "message": "timeout"}
    assert_idle_invariant(sched)


def test_a_cpu_rank_takes_one_thread_per_core_it_may_run_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server pinned to some cores (taskset, a cpuset) runs as many threads as it has cores, not as
    the machine has: two threads on one core spin-wait for each other."""
    import os

    import torch

    from scheduler_proc.scheduler_process import place_rank

    saved = torch.get_num_threads()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    try:
        place_rank(ServerArgs(model_path="m", device="cpu"), tp_rank=0, dp_rank=0)
        assert torch.get_num_threads() == 1
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
        place_rank(ServerArgs(model_path="m", device="cpu", tp_size=2), tp_rank=1, dp_rank=0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)
