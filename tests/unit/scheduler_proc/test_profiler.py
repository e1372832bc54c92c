"""The scheduler's profiler (SGLang's /start_profile and /stop_profile) in-process, over the stub model:
a start and a stop write a Chrome trace that parses as JSON and holds the forwards' ops; a profile
with num_steps stops by itself after that many forward steps; a stop without a start and a second
start are refused with their codes, leaving the state as it was; the activities a device lacks; a
start that failed on another TP rank starts on none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from runtime.protocol.messages import ProfileOptions, SchedControlOut, SchedControlReq, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.profiler import ALREADY_STARTED, INVALID, NOT_STARTED, ProfileError, StepProfiler
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import run_until_idle, stub_scheduler


def options(tmp_path: Path, **fields: Any) -> ProfileOptions:
    return ProfileOptions(output_dir=str(tmp_path), profile_id="p", with_stack=False, record_shapes=False, **fields)


def control(sched: Scheduler, kind: str, profile: ProfileOptions | None = None) -> dict[str, Any]:
    sched.handle_message(SchedControlReq(rid=kind, kind=kind, profile=profile))
    out = [m for m in sched.take_outbox() if isinstance(m, SchedControlOut)]
    assert len(out) == 1 and out[0].rid == kind
    return out[0].payload


def generate(sched: Scheduler, rid: str, max_new_tokens: int) -> None:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=[3, 4, 5, 6], sampling_params=params))
    run_until_idle(sched)


def trace_ops(path: Path) -> set[str]:
    trace = json.loads(path.read_text())
    return {e.get("name", "") for e in trace["traceEvents"]}


def test_start_and_stop_write_a_chrome_trace_of_the_forwards(tmp_path: Path) -> None:
    sched = stub_scheduler(overlap=False)
    started = control(sched, "start_profile", options(tmp_path))
    assert started["success"] and started["activities"] == ["CPU"]
    assert control(sched, "start_profile", options(tmp_path)) == {  # a second start: refused, the first runs on
        "success": False,
        "error": ALREADY_STARTED,
        "message": "profiling is already running (profile p); call /stop_profile first",
    }
    generate(sched, "r", 5)
    stopped = control(sched, "stop_profile")
    assert stopped["success"] and stopped["num_steps"] == 5  # a prefill and four decodes
    (trace,) = stopped["trace_files"]
    assert Path(trace) == tmp_path / "p-TP-0.trace.json"
    assert any(name.startswith("aten::") for name in trace_ops(Path(trace)))
    refused = control(sched, "stop_profile")
    assert not refused["success"] and refused["error"] == NOT_STARTED


def test_num_steps_stops_the_profile_by_itself(tmp_path: Path) -> None:
    sched = stub_scheduler(overlap=True)
    control(sched, "start_profile", options(tmp_path, num_steps=3))
    trace = tmp_path / "p-TP-0.trace.json"
    generate(sched, "r", 10)  # (stopped at the start of the step after its third forward, overlap or not)
    assert trace.is_file() and not sched.profiler.active
    trace_ops(trace)  # parses
    refused = control(sched, "stop_profile")
    assert refused["error"] == NOT_STARTED and "stopped by itself after 3 forward steps" in refused["message"]


def test_the_activities_a_device_has() -> None:
    cpu = StepProfiler(torch.device("cpu"), tp_rank=0, tp_size=1)
    assert cpu._activities(None) == (["CPU"], "")
    kept, note = cpu._activities(["CPU", "GPU"])
    assert kept == ["CPU"] and "GPU skipped" in note
    for asked, message in ((["GPU"], "no GPU activity"), (["MEM"], "'MEM' is not supported")):
        with pytest.raises(ProfileError, match=message) as err:
            cpu._activities(asked)
        assert err.value.code == INVALID
    cuda = StepProfiler(torch.device("cuda", 0), tp_rank=1, tp_size=2, dp_rank=1, dp_size=2)
    assert cuda._activities(None) == (["CPU", "GPU"], "")
    names = [Path(f).name for f in cuda.trace_files(ProfileOptions(output_dir="/x", profile_id="id"))]
    assert names == ["id-TP-0-DP-1.trace.json", "id-TP-1-DP-1.trace.json"]


def test_an_output_dir_that_cannot_be_made_is_refused(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    sched = stub_scheduler(overlap=False)
    refused = control(sched, "start_profile", options(blocker / "sub"))
    assert refused["error"] == INVALID and "output_dir" in refused["message"]
    assert not sched.profiler.active


def test_tp_ranks_agree_on_a_start(tmp_path: Path) -> None:
    """A start another TP rank could not make (its node cannot write there) starts on no rank."""
    rank0 = StepProfiler(torch.device("cpu"), tp_rank=0, tp_size=2, agree=lambda failed: int(failed) + 1)
    with pytest.raises(ProfileError, match="1 other TP rank"):
        rank0.start(options(tmp_path))
    assert not rank0.active
