"""--watchdog-timeout end to end: a scheduler step that never finishes (the test-only fault
TINYSERVE_TEST_STEP_DELAY_S makes every forward sleep 30 s) trips the scheduler's watchdog
after 2 s; the scheduler logs every thread's stack and exits non-zero; the launcher stops the
server as for any dead child, so the client in flight is told (``server_shutdown``) long before
the sleep would end, the launcher exits non-zero within timeout + 5 s, and no process is left.
The server is its own: it dies."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from runtime.client import Client, RequestError
from scheduler_proc.watchdog import STEP_DELAY_ENV, WATCHDOG_EXIT_CODE
from tests.support.server_fixtures import base_args, wait_gone
from tests.support.server_process import ServerProcess

pytest_plugins = ["tests.support.server_fixtures"]

WATCHDOG_TIMEOUT_S = 2.0
STEP_DELAY_S = 30.0


def test_a_stuck_step_trips_the_watchdog_tells_the_client_and_exits_non_zero(tiny_llama_path: Path) -> None:
    env = {**os.environ, STEP_DELAY_ENV: str(STEP_DELAY_S)}
    server = ServerProcess(
        [*base_args(tiny_llama_path), "--port", "0", "--watchdog-timeout", str(WATCHDOG_TIMEOUT_S)], env=env
    )
    outcome: dict[str, Any] = {}
    try:
        with Client(server.address or "", timeout=60) as c:
            processes = c.server_info()["processes"]  # a round trip, no forward: the server is idle
            time.sleep(1.5 * WATCHDOG_TIMEOUT_S)  # idle past the timeout: not a stuck step
            assert server.process.poll() is None, server.log_tail()
            children = [pid for name, pid in processes.items() if name != "launch"]

            def generate() -> None:
                try:
                    outcome["reply"] = c.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})
                except RequestError as exc:
                    outcome["error"] = exc
                outcome["at"] = time.monotonic()

            t0 = time.monotonic()  # the request's first step starts (and sleeps) right away
            thread = threading.Thread(target=generate)
            thread.start()
            code = server.process.wait(WATCHDOG_TIMEOUT_S + 5 + 5)  # asserted tighter below
            exited_in = time.monotonic() - t0
            thread.join(10)
    finally:
        server.stop()
    log = server.log_tail(1 << 20)
    assert code != 0, log
    assert exited_in < WATCHDOG_TIMEOUT_S + 5, (exited_in, log)
    assert not thread.is_alive()
    assert "reply" not in outcome, outcome
    error = outcome["error"]
    assert error.code in ("server_shutdown", "server_gone"), error
    assert outcome["at"] - t0 < WATCHDOG_TIMEOUT_S + 5 < STEP_DELAY_S
    # The watchdog's line, the stacks of every thread (the stuck one inside the delayed forward),
    # and the launcher's report of the dead scheduler.
    assert "--watchdog-timeout 2 s" in log, log
    assert "Thread 0x" in log and 'File "' in log and "delayed_forward" in log, log
    assert "scheduler-0 failed" in log and f"exited with code {WATCHDOG_EXIT_CODE}" in log, log
    assert wait_gone(children, 10) == []
