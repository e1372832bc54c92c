"""The start-up report of what the CPU path chose (runtime/engine/cpu/kernel_report.py): read from what
was set up, so it names each linear weight's real path and the decode stack that runs, at every build
level this CPU has, and says when the kernels are off."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.kernel_report import kernel_report, linear_path, linear_plans
from runtime.engine.model_runner import ModelRunner


def runner_of(path: Path, dtype: str) -> ModelRunner:
    return ModelRunner(path, device="cpu", dtype=dtype, max_total_tokens=1024, load_progress=False)


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_report_names_every_linear_and_the_decode_stack(tiny_llama_path: Path, dtype: str) -> None:
    runner = runner_of(tiny_llama_path, dtype)
    report = runner.kernels
    level = kernel_library.level()
    assert report["ops"] == "cpu" and report["isa"] == level and report["host_levels"][0] in report["summary"]
    plans = linear_plans(runner.model)
    assert sum(report["linears"].values()) == len(plans)
    assert report["linears"] == dict(sorted(Counter(linear_path(w, plan) for w, plan in plans).items()))
    if dtype == "float32" and level != "baseline":
        assert set(report["linears"]) == {"fp32_panels"}  # every tiny weight is a multiple of 16 rows
    if dtype == "bfloat16" and "avx512bf16" in kernel_library.host_levels():
        assert set(report["linears"]) <= {"amx_bf16", "dp_bf16", "onednn"}
    stack = runner.layer_stack.description() if runner.layer_stack is not None else None  # type: ignore[attr-defined]
    assert report["decode_stack"] == (stack.kernels if stack is not None else None)
    assert ("one C call" in report["summary"]) == (stack is not None)
    assert runner.weight_info()["kernels"] is report


def test_kernels_turned_off_are_reported(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel_library, "level", lambda: None)
    runner = runner_of(tiny_llama_path, "float32")
    report = kernel_report(runner.model, runner.layer_stack)
    assert report["isa"] is None and "TINYSERVE_CPU_KERNELS=0" in report["isa_reason"]
    assert report["decode_stack"] is None and torch.get_default_dtype() == torch.float32
