"""References that are slow to compute run beside the tests, in a process of their own.

A real model's reference (transformers' own GGUF loading of a 0.5B or a 262k-vocabulary model, and
its greedy output) takes ~40-60 s of one core, most of it before the first comparison. A test
module that declares ``BACKGROUND_REFERENCE = "function_name"`` has that module-level function,
which takes nothing and returns JSON-able data, run in a niced subprocess started at the end of
collection when the session selected any of the module's tests; the reference then uses the
cycles the other tests leave idle (an e2e test waiting on its server, a server on its client) and
yields to them otherwise. ``background_reference(module)`` waits for the module's result (a
session that started none, e.g. one that runs a single test by node id after collection, computes it
then). The function runs in a fresh interpreter: it must build everything it needs itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support import REPO_ROOT

NICENESS = 10  # below the tests' own processes, which must not wait for it
ATTRIBUTE = "BACKGROUND_REFERENCE"


@dataclass
class _Job:
    process: subprocess.Popen[str]
    folder: str  # the job's result file and its scratch folder ($TINYSERVE_CACHE, $TMPDIR)


_jobs: dict[str, _Job] = {}  # module file -> its running job


def _start(module_file: str, function: str) -> _Job:
    folder = tempfile.mkdtemp(prefix="tinyserve-reference-")
    code = (
        "import json, sys; from tests.support.background_reference import run_reference; "
        "json.dump(run_reference(sys.argv[1], sys.argv[2]), open(sys.argv[3], 'w'))"
    )
    env = {**os.environ, "TINYSERVE_CACHE": folder, "TMPDIR": folder, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(
        [sys.executable, "-c", code, module_file, function, os.path.join(folder, "result.json")],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.nice(NICENESS),
    )
    return _Job(process, folder)


def run_reference(module_file: str, function: str) -> Any:
    """(In the job's process.) The test module's reference function's result, on one torch thread."""
    import torch

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location(Path(module_file).stem, module_file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, function)()


def background_reference(module: ModuleType, timeout_s: float = 1800.0) -> Any:
    """The result of ``module``'s reference function: the background job's, waited for (started now
    where the session started none)."""
    module_file = str(Path(str(module.__file__)).resolve())
    job = _jobs.pop(module_file, None) or _start(module_file, getattr(module, ATTRIBUTE))
    try:
        _, stderr = job.process.communicate(timeout=timeout_s)
        assert job.process.returncode == 0, f"the reference of {module_file} failed:\n{stderr[-4000:]}"
        return json.loads(Path(job.folder, "result.json").read_text())
    finally:
        job.process.kill()
        shutil.rmtree(job.folder, ignore_errors=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        module = getattr(item, "module", None)
        function = getattr(module, ATTRIBUTE, None)
        if module is None or function is None:
            continue
        module_file = str(Path(str(module.__file__)).resolve())
        if module_file not in _jobs:
            _jobs[module_file] = _start(module_file, function)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A job whose tests did not run to it (``-x``, Ctrl-C) is stopped with the session."""
    for job in _jobs.values():
        job.process.kill()
        job.process.communicate()
        shutil.rmtree(job.folder, ignore_errors=True)
    _jobs.clear()
