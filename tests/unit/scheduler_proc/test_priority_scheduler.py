"""Priority scheduling and priority preemption, in-process over the KV-verifying stub model.

Memory (or request slots) for one request at a time makes the order of admission visible as
the order of finishing. The stub's tokens depend on every KV slot read back, so a preempted
request that resumes with a wrong or lost prefix produces different tokens than its
unpressured reference.
"""

from __future__ import annotations

import random

import pytest

from runtime.config.args import ServerArgs
from runtime.protocol.messages import BatchTokenIDOut, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.policy import SchedulePolicy
from scheduler_proc.prefill_adder import PrefillPlan
from scheduler_proc.priority import PriorityPreemption
from scheduler_proc.req import Req
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_runner import StubModelRunner
from tests.support.stub_scheduler import EOS, VOCAB, assert_idle_invariant, expected_output

LOW, HIGH = 0, 10
PROMPT_LEN, MAX_NEW = 40, 40


@pytest.fixture(params=[False, True], ids=["serial", "overlap"])
def overlap(request: pytest.FixtureRequest) -> bool:
    return request.param


def make_scheduler(overlap: bool, limit: str, **flags: bool) -> Scheduler:
    """``limit`` "slots": one request slot (--max-running-requests 1); "memory": a KV pool that
    holds one request's prompt and output but not two."""
    slots, tokens = (1, 4096) if limit == "slots" else (64, 128)
    args = ServerArgs(
        max_total_tokens=tokens, max_running_requests=slots, disable_overlap_schedule=not overlap, **flags
    )
    runner = StubModelRunner(
        max_total_tokens=tokens, vocab_size=VOCAB, max_running_requests=slots, eos_token_ids=(EOS,)
    )
    return Scheduler(args, model_runner=runner)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(PROMPT_LEN)] for _ in range(n)]


def submit(sched: Scheduler, rid: str, prompt: list[int], priority: int) -> None:
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=0.0)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params, priority=priority))


def run(sched: Scheduler, finish_order: list[str], outputs: dict[str, list[int]], steps: int = 100_000) -> None:
    """Step until idle, recording each request's output and the order requests finish in."""
    for _ in range(steps):
        sched.step()
        for msg in sched.take_outbox():
            assert isinstance(msg, BatchTokenIDOut), msg
            for out in msg.outputs:
                outputs.setdefault(out.rid, []).extend(out.new_output_ids)
                if out.finished:
                    assert out.finish_reason is not None and out.finish_reason["type"] == "length", out
                    finish_order.append(out.rid)
        if sched.is_idle():
            return
    raise AssertionError("scheduler did not go idle")


def high_behind_low(sched: Scheduler, n_low: int = 20) -> tuple[list[str], dict[str, list[int]], dict[str, list[int]]]:
    """Queue ``n_low`` low-priority requests, let the first start, then submit one high-priority
    request; run to the end. Returns the finish order, the outputs and the prompts."""
    ps = prompts(n_low + 1, seed=7)
    by_rid = {f"low{i}": p for i, p in enumerate(ps[:n_low])} | {"high": ps[n_low]}
    for i in range(n_low):
        submit(sched, f"low{i}", ps[i], LOW)
    order: list[str] = []
    outputs: dict[str, list[int]] = {}
    sched.step()  # low0 is admitted (prefilled) before the high one arrives
    sched.step()
    assert [r.rid for r in sched.queues.running] == ["low0"]
    submit(sched, "high", by_rid["high"], HIGH)
    run(sched, order, outputs)
    for rid, prompt in by_rid.items():
        assert outputs[rid] == expected_output(prompt, MAX_NEW), rid  # exact, preempted or not
    assert_idle_invariant(sched)
    return order, outputs, by_rid


@pytest.mark.parametrize("limit", ["slots", "memory"])
def test_high_priority_overtakes_the_queue(overlap: bool, limit: str) -> None:
    sched = make_scheduler(overlap, limit, enable_priority_scheduling=True)
    order, _, _ = high_behind_low(sched)
    # Without preemption the running low one finishes first; the high one next, before every queued one.
    assert order[:2] == ["low0", "high"], order
    assert sorted(order[2:]) == sorted(f"low{i}" for i in range(1, 20))
    assert sched.stats["num_priority_preemptions"] == 0


@pytest.mark.parametrize("limit", ["slots", "memory"])
def test_preemption_displaces_the_running_low_request(overlap: bool, limit: str) -> None:
    sched = make_scheduler(overlap, limit, enable_priority_scheduling=True, priority_preemption=True)
    order, _, _ = high_behind_low(sched)
    # high_behind_low checked that low0's output, though retracted mid-decode, is exact.
    assert order[0] == "high", order
    assert sorted(order[1:]) == sorted(f"low{i}" for i in range(20))
    assert sched.stats["num_priority_preemptions"] == 1
    assert sched.server_info()["num_priority_preemptions"] == 1


def test_priority_is_ignored_without_the_flag(overlap: bool) -> None:
    sched = make_scheduler(overlap, "slots")
    order, _, _ = high_behind_low(sched)
    assert order == [f"low{i}" for i in range(20)] + ["high"]


def test_equal_priorities_keep_fcfs_order(overlap: bool) -> None:
    sched = make_scheduler(overlap, "memory", enable_priority_scheduling=True, priority_preemption=True)
    ps = prompts(6, seed=8)
    for i, p in enumerate(ps):
        submit(sched, f"r{i}", p, priority=5 if i in (2, 4) else 1)
    order: list[str] = []
    outputs: dict[str, list[int]] = {}
    run(sched, order, outputs)
    assert order == ["r2", "r4", "r0", "r1", "r3", "r5"]
    assert sched.stats["num_priority_preemptions"] == 0  # nothing was running below the fives
    for i, p in enumerate(ps):
        assert outputs[f"r{i}"] == expected_output(p, MAX_NEW)
    assert_idle_invariant(sched)


def test_no_preemption_among_equal_priorities(overlap: bool) -> None:
    sched = make_scheduler(overlap, "slots", enable_priority_scheduling=True, priority_preemption=True)
    ps = prompts(3, seed=9)
    submit(sched, "a", ps[0], HIGH)
    sched.step()
    submit(sched, "b", ps[1], HIGH)
    submit(sched, "c", ps[2], LOW)
    order: list[str] = []
    run(sched, order, {})
    assert order == ["a", "b", "c"]
    assert sched.stats["num_priority_preemptions"] == 0


# ---------------------------------------------------------------- the pieces


def req(rid: str, priority: int, kv: int = 10) -> Req:
    r = Req(rid=rid, origin_input_ids=[1] * kv, sampling_params=SamplingParams(max_new_tokens=10), priority=priority)
    r.kv_committed_len = kv
    return r


def test_policy_sorts_by_priority_stably_and_only_when_enabled() -> None:
    waiting = [req("a", 0), req("b", 3), req("c", 0), req("d", 3), req("e", -1)]
    on = SchedulePolicy("fcfs", None, radix_enabled=False, priority=True)  # type: ignore[arg-type]
    off = SchedulePolicy("fcfs", None, radix_enabled=False)  # type: ignore[arg-type]
    assert [r.rid for r in on.order(waiting)] == ["b", "d", "a", "c", "e"]
    assert [r.rid for r in off.order(waiting)] == ["a", "b", "c", "d", "e"]
    lof = SchedulePolicy("lof", None, radix_enabled=False, priority=True)  # type: ignore[arg-type]
    waiting[2].sampling_params = SamplingParams(max_new_tokens=50)
    assert [r.rid for r in lof.order(waiting)] == ["b", "d", "c", "a", "e"]  # ties: the policy's key


def test_victims_lowest_first_then_latest_started_strictly_lower_only() -> None:
    preemption = PriorityPreemption()
    running = [req("old0", 0), req("mid", 2), req("new0", 0), req("same", 5)]
    arrival = req("x", 5)
    slot = PrefillPlan(blocked=arrival)  # a slot shortfall: one victim
    assert [r.rid for r in preemption.victims(slot, running, 0.0)] == ["new0"]
    tokens = PrefillPlan(blocked=arrival, blocked_shortfall=25)  # 10 tokens of KV each (ratio 0)
    assert [r.rid for r in preemption.victims(tokens, running, 0.0)] == ["new0", "old0", "mid"]
    too_much = PrefillPlan(blocked=arrival, blocked_shortfall=31)  # "same" is not lower: nobody
    assert preemption.victims(too_much, running, 0.0) == []
    assert preemption.victims(PrefillPlan(blocked=req("y", 0)), running, 0.0) == []


def test_a_chunked_high_priority_prompt_preempts_for_its_next_chunk(overlap: bool) -> None:
    """A long high-priority prompt is prefilled in chunks next to a decoding low one; when a later
    chunk finds no room, the low one gives way instead of the prompt waiting for it to finish."""
    args = ServerArgs(
        max_total_tokens=128,
        chunked_prefill_size=16,
        disable_overlap_schedule=not overlap,
        enable_priority_scheduling=True,
        priority_preemption=True,
    )
    sched = Scheduler(args, model_runner=StubModelRunner(max_total_tokens=128, vocab_size=VOCAB, eos_token_ids=(EOS,)))
    low, high = prompts(2, seed=11)
    high = (high * 2)[:60]
    submit(sched, "low", low, LOW)
    sched.step()
    sched.step()
    submit(sched, "high", high, HIGH)
    order: list[str] = []
    outputs: dict[str, list[int]] = {}
    run(sched, order, outputs)
    assert order == ["high", "low"]
    assert sched.stats["num_priority_preemptions"] == 1
    assert outputs["low"] == expected_output(low, MAX_NEW) and outputs["high"] == expected_output(high, MAX_NEW)
    assert_idle_invariant(sched)
