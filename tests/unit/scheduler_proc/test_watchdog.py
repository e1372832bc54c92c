"""The scheduler's watchdog (scheduler_proc/watchdog.py): an idle loop and steps that finish in
time never trip it; one step past the timeout logs, dumps every thread's stack and calls the
exit function (injected here, so the test process survives); the test-only step delay."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from scheduler_proc.watchdog import STEP_DELAY_ENV, WATCHDOG_EXIT_CODE, StepWatchdog, install_test_step_delay


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Exits:
    """Records exit codes instead of exiting."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def fake_watchdog(tmp_path: Path, timeout: float = 10.0) -> tuple[StepWatchdog, FakeClock, Exits, Any]:
    clock, exits = FakeClock(), Exits()
    stream = open(tmp_path / "stacks.txt", "w+")
    return StepWatchdog(timeout, clock=clock, exit_fn=exits, stream=stream), clock, exits, stream


def test_idle_never_trips(tmp_path: Path) -> None:
    dog, clock, exits, _ = fake_watchdog(tmp_path)
    for _ in range(5):
        clock.now += 1000  # waiting for requests for ages is not a step
        assert not dog.check()
    dog.begin_step()
    dog.end_step()
    clock.now += 1000
    assert not dog.check()
    assert exits.codes == [] and not dog.tripped


def test_steps_that_finish_in_time_do_not_trip(tmp_path: Path) -> None:
    dog, clock, exits, _ = fake_watchdog(tmp_path, timeout=10)
    for _ in range(100):  # many steps, together far longer than the timeout
        dog.begin_step()
        clock.now += 9.9
        assert not dog.check()
        dog.end_step()
    assert exits.codes == [] and dog.steps_done == 100


def test_a_long_step_logs_dumps_every_thread_and_exits_non_zero(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    dog, clock, exits, stream = fake_watchdog(tmp_path, timeout=10)
    dog.begin_step()
    clock.now += 10.5
    with caplog.at_level(logging.ERROR, logger="scheduler_proc.watchdog"):
        assert dog.check()
    assert exits.codes == [WATCHDOG_EXIT_CODE] and WATCHDOG_EXIT_CODE != 0
    assert "--watchdog-timeout 10 s" in caplog.text and "10.5 s" in caplog.text
    stream.seek(0)
    stacks = stream.read()
    assert "Current thread" in stacks and 'File "' in stacks
    assert "test_a_long_step_logs_dumps_every_thread_and_exits_non_zero" in stacks


def test_a_step_that_ended_while_checking_does_not_trip(tmp_path: Path) -> None:
    """The clock is read after the step's start: a step that ended in between is not stuck."""
    dog, clock, exits, _ = fake_watchdog(tmp_path, timeout=10)
    dog.begin_step()

    def clock_that_sees_the_step_end() -> float:
        # The scheduler thread, between the watcher's two reads: the step ends, the next begins.
        dog.end_step()
        dog.step_started = clock.now + 49.5
        return clock.now + 50

    dog._clock = clock_that_sees_the_step_end
    assert not dog.check()
    assert exits.codes == []


def test_the_thread_trips_on_a_stuck_step_and_not_while_idle_or_busy(tmp_path: Path) -> None:
    """The real thread and clock, a 0.3 s timeout: idle and short steps pass; a 'stuck' step
    trips within the timeout plus a poll."""
    exits = Exits()
    dog = StepWatchdog(0.3, poll_s=0.02, exit_fn=exits, stream=open(tmp_path / "stacks.txt", "w")).start()
    try:
        time.sleep(0.6)  # idle
        for _ in range(10):  # busy, each step short
            dog.begin_step()
            time.sleep(0.05)
            dog.end_step()
        assert exits.codes == []
        t0 = time.monotonic()
        dog.begin_step()  # and never ends
        assert exits.called.wait(5)
        assert 0.3 <= time.monotonic() - t0 < 2.0
        assert exits.codes == [WATCHDOG_EXIT_CODE]
    finally:
        dog.stop()
    assert "Thread" in (tmp_path / "stacks.txt").read_text()


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StepWatchdog(0)


def test_step_delay_is_installed_only_when_set() -> None:
    calls: list[int] = []
    runner = SimpleNamespace(forward=lambda batch: calls.append(batch) or batch)
    original = runner.forward
    assert install_test_step_delay(runner, {}) == 0.0
    assert runner.forward is original  # unset: nothing wrapped
    assert install_test_step_delay(runner, {STEP_DELAY_ENV: "0.2"}) == 0.2
    t0 = time.monotonic()
    assert runner.forward(7) == 7
    assert time.monotonic() - t0 >= 0.2 and calls == [7]
