"""The scheduler's watchdog (``--watchdog-timeout``, SGLang's flag): a stuck step ends the process.

A scheduler step that never returns (a hung collective, a wedged device, a deadlock in a
kernel launch) leaves every client waiting forever, and ``/health`` only tells whoever asks.
``StepWatchdog`` is a daemon thread in each scheduler process (every TP rank, every DP
replica). The scheduler loop marks each step's start and end (``begin_step`` /
``end_step``: one clock read and two attribute writes, no locks on the hot path); the thread
looks every ``poll_s`` and, once one step has run longer than the timeout, logs an error
naming the timeout, dumps the stack of every thread of the process (``faulthandler``, to
stderr) and exits with ``WATCHDOG_EXIT_CODE`` through ``os._exit``: a stuck forward cannot
be unwound, so nothing is left to clean up gracefully.

The exit is an ordinary child death for the launcher: it stops the other processes (the
tokenizer first, which answers every request in flight with ``server_shutdown``) and exits
1, so a supervisor above it (systemd, Kubernetes) can restart the server.

Time spent waiting for requests is not a step: the loop marks a step only after its
receive returned, so an idle scheduler never trips the watchdog.

Test-only fault: ``TINYSERVE_TEST_STEP_DELAY_S=SECONDS`` (read once, when the scheduler
process starts) makes every model forward sleep that long first, so that end-to-end tests
can make a step overrun the timeout. Unset (always, outside tests), nothing is wrapped and
it costs nothing.
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing.util
import os
import sys
import threading
import time
from typing import Any, Callable, Mapping, TextIO

logger = logging.getLogger(__name__)

STEP_DELAY_ENV = "TINYSERVE_TEST_STEP_DELAY_S"
WATCHDOG_EXIT_CODE = 3  # distinct from 1 (an exception) so the launcher's "exited with code 3" says which
MAX_POLL_S = 1.0
FINALIZERS_S = 1.0


class StepWatchdog:
    """Watches one scheduler loop's steps; trips when a single step outlives ``timeout_s``.

    ``clock``, ``exit_fn`` and ``stream`` are injectable so that tests can drive ``check``
    with a fake clock and survive a trip; the defaults are the real process's.
    """

    def __init__(
        self,
        timeout_s: float,
        *,
        name: str = "scheduler",
        poll_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        exit_fn: Callable[[int], Any] | None = None,
        stream: TextIO | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.name = name
        # Checking four times per timeout bounds the overrun to a quarter of it (at most 1 s).
        self.poll_s = poll_s if poll_s is not None else min(timeout_s / 4, MAX_POLL_S)
        self._clock = clock
        self._exit = exit_fn if exit_fn is not None else exit_process
        self._stream = stream
        # Written only by the scheduler thread: the running step's start (None between steps)
        # and how many steps completed. Plain attributes: a read of one is atomic under the GIL.
        self.step_started: float | None = None
        self.steps_done = 0
        self.tripped = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ the scheduler thread

    def begin_step(self) -> None:
        """The loop has work to do from now on (it has received its messages)."""
        self.step_started = self._clock()

    def end_step(self) -> None:
        """The step returned; until the next ``begin_step`` the loop may wait as long as it likes."""
        self.step_started = None
        self.steps_done += 1

    # ------------------------------------------------------------------ the watching thread

    def start(self) -> "StepWatchdog":
        self._thread = threading.Thread(target=self._run, name="scheduler-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (tests; a real scheduler is watched until its process exits)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.check():
                return

    def check(self) -> bool:
        """Trip if the running step has been running longer than the timeout; True if it tripped."""
        started = self.step_started
        if started is None:
            return False
        elapsed = self._clock() - started
        # ``started`` is a float object only this step's begin_step made: if the step ended (or
        # another began) before the clock read above, the attribute no longer holds it.
        if elapsed <= self.timeout_s or self.step_started is not started:
            return False
        self.trip(elapsed)
        return True

    def trip(self, elapsed: float) -> None:
        """Log, dump every thread's stack, exit non-zero (returns only with an injected ``exit_fn``)."""
        self.tripped = True
        logger.error(
            "watchdog: a %s step has run %.1f s, longer than --watchdog-timeout %g s "
            "(%d loop iterations completed before it); dumping every thread's stack and exiting "
            "with code %d",
            self.name,
            elapsed,
            self.timeout_s,
            self.steps_done,
            WATCHDOG_EXIT_CODE,
        )
        stream = self._stream if self._stream is not None else sys.stderr
        _flush_logs()
        try:
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except Exception:  # a stream without a file descriptor: the error line above still went out
            logger.exception("watchdog: could not dump the threads' stacks")
        self._exit(WATCHDOG_EXIT_CODE)


def exit_process(code: int) -> None:
    """``os._exit(code)`` after multiprocessing's finalizers (as ``runtime.protocol.child_process.exit_now``: they
    unlink named semaphores that would otherwise be reported as leaked), given at most
    ``FINALIZERS_S`` on a thread of their own: one could wait on a lock the stuck step holds."""
    finalizers = threading.Thread(
        target=multiprocessing.util._run_finalizers,  # type: ignore[attr-defined]
        name="watchdog-finalizers",
        daemon=True,
    )
    finalizers.start()
    finalizers.join(FINALIZERS_S)
    _flush_logs()
    os._exit(code)


def _flush_logs() -> None:
    """Flush the root logger's handlers so the error line precedes the stacks; a handler whose
    stream is gone (closed) must not stop the dump."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except (OSError, ValueError):
            pass


def start_watchdog(timeout_s: float, name: str) -> StepWatchdog:
    """A started watchdog for this scheduler process's loop."""
    logger.debug("watchdog on: a step longer than %g s ends %s", timeout_s, name)
    return StepWatchdog(timeout_s, name=name).start()


def install_test_step_delay(runner: Any, environ: Mapping[str, str] = os.environ) -> float:
    """Test-only fault: with ``TINYSERVE_TEST_STEP_DELAY_S`` set, every ``runner.forward``
    sleeps that many seconds first. Returns the delay (0: unset, nothing installed)."""
    raw = environ.get(STEP_DELAY_ENV, "")
    if not raw:
        return 0.0
    delay = float(raw)
    forward = runner.forward
    logger.warning("%s=%g: every model forward sleeps %g s first (a test-only fault)", STEP_DELAY_ENV, delay, delay)

    def delayed_forward(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay)
        return forward(*args, **kwargs)

    runner.forward = delayed_forward  # an instance attribute: the worker calls runner.forward
    return delay
