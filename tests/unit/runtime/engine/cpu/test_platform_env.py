"""launch.py gives the serving processes the device's environment defaults before it spawns
them (``ServingPlatform.process_env``): on CPU, OpenMP threads that spin briefly, then sleep;
a value the user set of either variable keeps both defaults out; with ``--device cpu`` the launcher
finds them without importing torch."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import launch
from runtime.config.args import ServerArgs
from runtime.engine.cpu.host_memory import CPU_PLATFORM
from runtime.engine.cpu.process_env import CPU_OPENMP_ENV
from tests.support import REPO_ROOT as REPO


def test_cpu_serving_processes_get_a_short_openmp_spin_then_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    wait = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5000"}
    assert dict(CPU_PLATFORM.process_env) == wait
    for key in wait:
        monkeypatch.delenv(key, raising=False)
    assert launch.apply_platform_env(ServerArgs(device="cpu")) == wait
    assert {key: os.environ[key] for key in wait} == wait
    for key in wait:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice wins, whole: no spin count of ours
    assert launch.apply_platform_env(ServerArgs(device="cpu")) == {}
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE" and "GOMP_SPINCOUNT" not in os.environ
    monkeypatch.delenv("OMP_WAIT_POLICY")
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    assert launch.apply_platform_env(ServerArgs(device="cpu")) == {}
    assert "OMP_WAIT_POLICY" not in os.environ


def test_the_launcher_sets_the_cpu_defaults_without_importing_torch() -> None:
    """What the platform says and what the launcher applies are one tuple; in a fresh interpreter,
    parsing the flags and applying the defaults for --device cpu leaves torch unimported (its
    import held a core for seconds before any child could start)."""
    assert CPU_PLATFORM.process_env is CPU_OPENMP_ENV
    probe = (
        "import sys, launch; from runtime.config.args import ServerArgs; "
        "args = ServerArgs.from_cli(['--device', 'cpu']); applied = launch.apply_platform_env(args); "
        "print(sorted(applied), 'torch' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k not in dict(CPU_OPENMP_ENV)}
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["['GOMP_SPINCOUNT',", "'OMP_WAIT_POLICY']", "False"], out.stdout + out.stderr
