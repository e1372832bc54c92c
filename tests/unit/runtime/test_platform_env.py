"""launch.py gives the serving processes the device's environment defaults before it spawns
them (``ServingPlatform.process_env``): on CPU, OpenMP threads that spin briefly, then sleep;
a value the user set of either variable keeps both defaults out."""

from __future__ import annotations

import os

import pytest

import launch
from runtime.args import ServerArgs
from runtime.cpu.host_memory import CPU_PLATFORM


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
