"""The type check starts when the session's tests are known and runs beside them.

mypy over the product packages takes ~40 s of one core, most of it reading torch's annotations;
run as a test it would add all of that to the suite's wall time. When the session selected
``tests/unit/repository/test_types.py::test_mypy_finds_no_errors``, this plugin starts the checker
at the end of collection, niced, so it takes the cycles the tests leave idle (an e2e test waiting
on its server, a server waiting on its client) and yields to them otherwise; the test then waits
for its result (``typecheck_result``). A session that did not select the test starts nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest

from tests.support import REPO_ROOT

TYPE_TEST = "tests/unit/repository/test_types.py::test_mypy_finds_no_errors"
NICENESS = 10  # below the tests' own processes, which must not wait for it


@dataclass
class _Check:
    process: subprocess.Popen[str]
    cache_dir: str


_running: _Check | None = None


def _start() -> _Check:
    # Its own cache: nothing stale from another checkout's run, no lock shared with a concurrent one.
    cache_dir = tempfile.mkdtemp(prefix="tinyserve-mypy-")
    command = [sys.executable, "-m", "mypy", "--config-file", "pyproject.toml", "--cache-dir", cache_dir]
    process = subprocess.Popen(
        command,
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.nice(NICENESS),
    )
    return _Check(process, cache_dir)


def typecheck_result(timeout_s: float) -> subprocess.CompletedProcess[str]:
    """mypy's exit code and output: the background run's (started now if none is running)."""
    global _running
    check = _running if _running is not None else _start()
    _running = None
    try:
        stdout, stderr = check.process.communicate(timeout=timeout_s)
    finally:
        check.process.kill()
        shutil.rmtree(check.cache_dir, ignore_errors=True)
    return subprocess.CompletedProcess(check.process.args, check.process.returncode, stdout, stderr)


def pytest_collection_finish(session: pytest.Session) -> None:
    global _running
    if session.config.option.collectonly:
        return
    if _running is None and any(item.nodeid == TYPE_TEST for item in session.items):
        _running = _start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A run stopped before the test (``-x``, Ctrl-C) leaves no checker behind."""
    global _running
    if _running is not None:
        _running.process.kill()
        _running.process.communicate()
        shutil.rmtree(_running.cache_dir, ignore_errors=True)
        _running = None
