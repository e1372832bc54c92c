"""Running Triton kernel tests under the interpreter (TRITON_INTERPRET=1) on CPU.

Triton reads TRITON_INTERPRET when it is first imported. A test module sets it before
importing triton; if something earlier in the session already imported triton in
compiled mode (transformers does), the module's tests are replaced by one test that
re-runs the module in a fresh process with the variable set.

Those modules set the variable in ``os.environ`` when pytest imports them, that is during
collection, before any test runs: from then on every process a test starts inherits it
unless its environment is made with ``compiled_triton_env``. A server that picks cuda
would otherwise run its Triton kernels in the interpreter (minutes per request).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT


def compiled_triton_env(**extra: str) -> dict[str, str]:
    """This process's environment without TRITON_INTERPRET (plus ``extra``): for a child
    process that may run Triton on a GPU, where the kernels must compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra)
    return env


def replace_tests_with_fresh_process_run(module_globals: dict[str, Any], module_file: str) -> None:
    """Swap every ``test_*`` of the module for one test that runs the file in a new interpreter."""
    for name in [n for n in module_globals if n.startswith("test_")]:
        del module_globals[name]

    def test_in_fresh_interpreter_process() -> None:
        """Triton was imported before TRITON_INTERPRET=1 could apply: run this file in its own process."""
        env = dict(os.environ, TRITON_INTERPRET="1")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(module_file))],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

    module_globals["test_in_fresh_interpreter_process"] = test_in_fresh_interpreter_process


def run_compiled_when_interpreting(module_globals: dict[str, Any], module_file: str) -> None:
    """For GPU test modules: when TRITON_INTERPRET=1 is set in this process (an earlier
    module set it), swap the module's tests for one that re-runs the file where Triton compiles."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    for name in [n for n in module_globals if n.startswith("test_")]:
        del module_globals[name]

    def test_in_fresh_compiled_process() -> None:
        """TRITON_INTERPRET=1 was set by an earlier module: run this file where Triton compiles."""
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(module_file))],
            cwd=REPO_ROOT,
            env=compiled_triton_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]

    module_globals["test_in_fresh_compiled_process"] = test_in_fresh_compiled_process
