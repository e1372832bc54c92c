"""Sliding-window models on a GPU: the compiled Triton kernels (windowed extend, windowed decode
plans under CUDA graphs, the SWA pool's slots) against torch_native, in a fresh process where
Triton compiles."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support import REPO_ROOT
from tests.support.checkpoints import SWA_WINDOWS
from tests.support.triton_interp import compiled_triton_env

_GPU_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[2])
from tests.support.checkpoints import random_prompt
from runtime.config.args import ServerArgs
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import run_until_idle

prompts = [random_prompt(70, 384, seed=1), random_prompt(23, 384, seed=2), random_prompt(40, 384, seed=3)]
out = {}
for backend in ("torch_native", "triton"):  # triton: compiled kernels, decode through CUDA graphs
    runner = ModelRunner(sys.argv[1], device="cuda", dtype="float32", attention_backend=backend,
                         max_total_tokens=1024, swa_full_tokens_ratio=0.5, load_progress=False)
    sched = Scheduler(ServerArgs(max_total_tokens=1024, chunked_prefill_size=16), model_runner=runner)
    for i, p in enumerate(prompts):
        sched.handle_message(TokenizedGenerateReq(rid=str(i), input_ids=p,
                                                  sampling_params=SamplingParams(max_new_tokens=40, temperature=0.0)))
    res = run_until_idle(sched)
    assert sched.check_memory().ok
    out[backend] = [res[str(i)]["ids"] for i in range(len(prompts))]
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", sorted(SWA_WINDOWS))
def test_compiled_triton_windows_on_a_gpu(tiny_checkpoints, name: str) -> None:
    """On cuda, the compiled Triton kernels (windowed extend, windowed decode plans under CUDA
    graphs, the SWA pool's slots) give torch_native's tokens."""
    result = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT, str(tiny_checkpoints.path(name)), str(REPO_ROOT)],
        cwd=REPO_ROOT,
        env=compiled_triton_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["triton"] == out["torch_native"]
