"""launch.py gives the serving processes the device's environment defaults before it spawns
them (``ServingPlatform.process_env``): on CPU, OpenMP threads that sleep instead of spinning;
a value the user set is kept."""

from __future__ import annotations

import os

import pytest

import launch
from runtime.args import ServerArgs
from runtime.cpu.host_memory import CPU_PLATFORM


def test_cpu_serving_processes_get_the_passive_openmp_wait_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dict(CPU_PLATFORM.process_env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert launch.apply_platform_env(ServerArgs(device="cpu")) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # the user's own choice wins
    assert launch.apply_platform_env(ServerArgs(device="cpu")) == {}
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
