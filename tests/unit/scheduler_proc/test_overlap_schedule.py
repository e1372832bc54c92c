"""Overlap scheduling, in-process over the KV-verifying stub: step N+1 is launched before
step N's tokens reach the host, and nothing about the outputs or the memory changes.

The stub writes each input token into its KV slot and predicts the next token from the
sequence it reads back through req_to_token, so a future token resolved from the wrong
row, a slot freed twice or reused early, or a lost prefix all change the tokens.
"""

from __future__ import annotations

import random

import pytest

from runtime.config.args import ServerArgs
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.model_worker import ModelWorker, OverlapModelWorker
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_runner import StubModelRunner
from tests.support.stub_scheduler import (
    VOCAB,
    assert_idle_invariant,
    collect,
    expected_output,
    run_until_idle,
    stub_scheduler,
)


def make(overlap: bool, max_total_tokens: int = 8192, **overrides) -> Scheduler:
    return stub_scheduler(overlap, max_total_tokens, **overrides)


def submit(sched: Scheduler, rid: str, prompt: list[int], params: SamplingParams, stream: bool = False) -> None:
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params, stream=stream))


def test_the_worker_kind_follows_the_flags() -> None:
    assert isinstance(make(overlap=True).worker, OverlapModelWorker)
    serial = make(overlap=False).worker
    assert isinstance(serial, ModelWorker) and not serial.overlap
    # Unset: overlap on cuda only (the stub runs on cpu).
    assert not Scheduler(ServerArgs(max_total_tokens=512), model_runner=StubModelRunner(512)).worker.overlap


def test_decode_steps_are_launched_before_the_previous_tokens_are_read() -> None:
    sched = make(overlap=True)
    prompt = list(range(1, 20))
    submit(sched, "r", prompt, SamplingParams(max_new_tokens=12, temperature=0.0))
    results: dict[str, dict] = {}
    ahead = 0
    while not sched.is_idle():
        sched.step()
        collect(sched, results)
        step = sched.inflight
        if step is not None and step.decode:
            req = step.decode[0]
            # Launched with a future input: its last token is not on the host yet.
            assert req.num_inflight == 1
            ahead += 1
    assert ahead >= 9
    assert results["r"]["ids"] == expected_output(prompt, 12)
    assert_idle_invariant(sched)


def test_a_request_that_stops_while_its_next_step_runs_drops_that_token_and_frees_once() -> None:
    """Stop tokens end requests at steps the scheduler cannot foresee: the next step already
    holds them. Their output stops at the stop token and every slot comes back."""
    prompts = [[random.Random(i).randrange(1, VOCAB) for _ in range(5 + i)] for i in range(12)]
    outputs = {}
    for overlap in (False, True):
        for page_size in (1, 4):
            sched = make(overlap, page_size=page_size)
            for i, prompt in enumerate(prompts):
                stop_at = 1 + i % 7  # the stop token is the request's (stop_at)-th output
                stop = expected_output(prompt, stop_at)[-1]
                params = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[stop])
                submit(sched, f"r{i}", prompt, params, stream=i % 2 == 0)
            results = run_until_idle(sched)
            assert_idle_invariant(sched)
            outputs[overlap, page_size] = {rid: (r["ids"], r["reason"]["type"]) for rid, r in results.items()}
            for i, prompt in enumerate(prompts):
                ids, reason = outputs[overlap, page_size][f"r{i}"]
                assert reason == "stop"
                full = expected_output(prompt, 1 + i % 7)
                assert ids == full[: full.index(full[-1]) + 1]
    assert outputs[True, 1] == outputs[False, 1] and outputs[True, 4] == outputs[False, 4]


def test_random_aborts_leak_nothing_with_overlap() -> None:
    """800 requests, about a fifth aborted at random moments (queued, prefilling, decoding),
    a small pool that forces retraction: every request ends once and no slot leaks."""
    rng = random.Random(1234)
    sched = make(overlap=True, max_total_tokens=1024, chunked_prefill_size=64, page_size=4)
    results: dict[str, dict] = {}
    live: list[str] = []
    sent = 0
    while sent < 800 or not sched.is_idle():
        for _ in range(min(rng.randrange(0, 6), 800 - sent)):
            rid = f"r{sent}"
            prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 150))]
            max_new = rng.randrange(1, 40)
            # A third stop at a token of their own output: at a step the scheduler cannot foresee.
            stop = [expected_output(prompt, rng.randrange(1, max_new + 1))[-1]] if rng.random() < 0.33 else None
            params = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=stop)
            submit(sched, rid, prompt, params, stream=rng.random() < 0.5)
            live.append(rid)
            sent += 1
        if live and rng.random() < 0.2:
            sched.abort(live.pop(rng.randrange(len(live))))
        sched.step()
        collect(sched, results)
    assert_idle_invariant(sched)
    assert len(results) == 800
    assert all(r.get("finished") or "error" in r for r in results.values())
    reasons = [r["reason"]["type"] for r in results.values() if "reason" in r]
    assert {"abort", "length", "stop"} <= set(reasons)
    assert sched.stats["num_aborted"] == reasons.count("abort")  # however the abort was reached
    assert sched.stats["num_retractions"] > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_outputs_equal_the_serial_scheduler_under_retraction_and_chunking(page_size: int) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(10, 120))] for _ in range(24)]
    runs = []
    for overlap in (False, True):
        sched = make(overlap, max_total_tokens=768, chunked_prefill_size=48, page_size=page_size)
        for i, prompt in enumerate(prompts):
            submit(sched, f"r{i}", prompt, SamplingParams(max_new_tokens=30, temperature=0.0))
        runs.append(run_until_idle(sched))
        assert_idle_invariant(sched)
        assert sched.stats["num_retractions"] > 0
    assert {k: v["ids"] for k, v in runs[0].items()} == {k: v["ids"] for k, v in runs[1].items()}
    for i, prompt in enumerate(prompts):
        assert runs[1][f"r{i}"]["ids"] == expected_output(prompt, 30)


def test_a_prefill_is_processed_before_anything_is_launched_after_it() -> None:
    """Processing a prefill inserts its prompts into the prefix cache (rows remapped, duplicate
    slots freed, SWA slots moved): no later step may be in flight while that happens."""
    sched = make(overlap=True, chunked_prefill_size=16)
    events: list[str] = []
    launch, complete = sched.worker.launch, sched.results.complete
    sched.worker.launch = lambda batch, future=None: (  # type: ignore[method-assign]
        events.append("decode" if batch.forward_mode.is_decode() else "prefill"),
        launch(batch, future),
    )[1]
    sched.results.complete = lambda: (events.append("done"), complete())[1]  # type: ignore[method-assign]
    rng = random.Random(8)
    for i in range(6):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 40))]
        submit(sched, f"r{i}", prompt, SamplingParams(max_new_tokens=8, temperature=0.0))
        sched.step()
    results = run_until_idle(sched)
    assert all(r["finished"] for r in results.values()) and len(results) == 6
    for i, event in enumerate(events):
        if event == "prefill":
            assert events[i + 1] == "done", events
    assert events.count("decode") > 0 and "decode" in [
        events[i + 1] for i, e in enumerate(events[:-1]) if e == "decode"
    ]
    assert_idle_invariant(sched)
