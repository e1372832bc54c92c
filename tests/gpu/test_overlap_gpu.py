"""Overlap scheduling on a GPU: the worker's own stream, future inputs resolved on the device
and the event-waited copy of the ids give the serial scheduler's tokens.

The device ops compile Triton kernels, so when an earlier module set TRITON_INTERPRET=1
this file runs again in a fresh process without it.
"""

from __future__ import annotations

import random
from pathlib import Path

from runtime.config.args import ServerArgs
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle
from tests.support.triton_interp import run_compiled_when_interpreting


def test_overlap_on_cuda_gives_the_serial_tokens(tiny_llama_path: Path) -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(16)]
    outputs = []
    for overlap in (False, True):
        args = ServerArgs(
            model_path=str(tiny_llama_path),
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=4096,
            disable_overlap_schedule=not overlap,
        )
        sched = Scheduler(args)
        assert sched.worker.overlap is overlap
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            sched.handle_message(TokenizedGenerateReq(rid=f"r{i}", input_ids=prompt, sampling_params=params))
        outputs.append({rid: r["ids"] for rid, r in run_until_idle(sched).items()})
        assert_idle_invariant(sched)
        sched.worker.close()
    assert outputs[0] == outputs[1]


run_compiled_when_interpreting(globals(), __file__)
