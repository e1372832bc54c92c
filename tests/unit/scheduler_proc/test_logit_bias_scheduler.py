"""logit_bias end to end: requests through an in-process Scheduler on the tiny real model (CPU, fp32),
with the inline worker and with the overlap worker (whose decode steps are launched before the
previous tokens reach the host), so every path from the batch builder to the sampler is covered.

The tiny model is random: what greedy writes is nonsense, but deterministic, which is all a bias
needs to be seen. ``ignore_eos`` keeps every request running to ``max_new_tokens``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from runtime.config.args import ServerArgs
from runtime.protocol.messages import BatchTokenIDOut, TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import random_prompt
from tests.support.stub_scheduler import assert_idle_invariant

MAX_NEW = 8


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model's forwards are too small to share on a loaded 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=[False, True], ids=["serial", "overlap"])
def sched(request: pytest.FixtureRequest, tiny_llama_path: Path) -> Iterator[Scheduler]:
    overlap = bool(request.param)
    args = ServerArgs(
        model_path=str(tiny_llama_path),
        device="cpu",
        dtype="float32",
        max_total_tokens=2048,
        disable_overlap_schedule=not overlap,
    )
    scheduler = Scheduler(args)
    assert scheduler.worker.overlap == overlap
    yield scheduler
    scheduler.grammars.close()
    scheduler.worker.close()


def generate(sched: Scheduler, requests: dict[str, tuple[list[int], dict[str, Any]]]) -> dict[str, list[int]]:
    """Submit every request at once (one batch), step until idle, return each one's output ids."""
    for rid, (prompt, params) in requests.items():
        full = {"max_new_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True, **params}
        sampling = SamplingParams.from_dict(full)
        sampling.validate(sched.runner.vocab_size)
        sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=sampling))
    out: dict[str, list[int]] = {rid: [] for rid in requests}
    for _ in range(10 * MAX_NEW + 20):
        sched.step()
        for msg in sched.take_outbox():
            assert isinstance(msg, BatchTokenIDOut), msg
            for o in msg.outputs:
                out[o.rid].extend(o.new_output_ids)
        if sched.is_idle():
            assert_idle_invariant(sched)
            return out
    raise AssertionError("scheduler did not go idle")


def test_greedy_with_logit_bias(sched: Scheduler) -> None:
    vocab = sched.runner.vocab_size
    prompts = [random_prompt(n, vocab, seed=700 + n) for n in (5, 12)]
    plain = generate(sched, {"a": (prompts[0], {}), "b": (prompts[1], {})})
    assert all(len(ids) == MAX_NEW for ids in plain.values())
    # A token the unbiased run never wrote (and no EOS), forced with +100.
    eos = set(sched.runner.eos_token_ids)
    forced = next(t for t in range(3, vocab) if t not in plain["a"] and t not in eos)
    banned = plain["a"][0]  # the token greedy picks first, banned with -100
    got = generate(
        sched,
        {
            "forced": (prompts[0], {"logit_bias": {str(forced): 100}}),
            "banned": (prompts[0], {"logit_bias": {str(banned): -100}}),
            "sampled": (prompts[0], {"logit_bias": {str(forced): 100}, "temperature": 1.0, "seed": 3}),
            "b": (prompts[1], {}),  # batched with the biased ones: exactly its unbiased output
        },
    )
    assert got["forced"] == [forced] * MAX_NEW
    assert got["sampled"] == [forced] * MAX_NEW
    assert banned not in got["banned"] and len(got["banned"]) == MAX_NEW
    assert got["b"] == plain["b"]
