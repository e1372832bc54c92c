"""In-process scheduler over the KV-verifying stub model: building one, driving it, checking it.

Shared by the scheduler lifecycle tests and the overlap-scheduling tests.
"""

from __future__ import annotations

from typing import Any

from runtime.config.args import ServerArgs
from runtime.protocol.messages import BatchTokenIDOut, SchedErrorOut
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_runner import StubModelRunner, reference_next_token

VOCAB = 1000
EOS = 0


def stub_scheduler(overlap: bool, max_total_tokens: int = 8192, page_size: int = 1, **overrides) -> Scheduler:
    overrides.setdefault("disable_overlap_schedule", not overlap)
    args = ServerArgs(page_size=page_size, max_total_tokens=max_total_tokens, **overrides)
    runner = StubModelRunner(
        max_total_tokens=max_total_tokens, vocab_size=VOCAB, page_size=page_size, eos_token_ids=(EOS,)
    )
    return Scheduler(args, model_runner=runner)


def expected_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    """What the stub generates after ``prompt`` (EOS is never produced)."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        out.append(reference_next_token(seq, VOCAB, {EOS}))
        seq.append(out[-1])
    return out


def collect(sched: Scheduler, results: dict[str, dict]) -> None:
    """Add the outbox's outputs to ``results`` (rid -> ids, finished, reason, cached, an embedding's
    vector, or error)."""
    for msg in sched.take_outbox():
        if isinstance(msg, SchedErrorOut):
            results[msg.rid] = {"error": msg.code}
            continue
        assert isinstance(msg, BatchTokenIDOut)
        for out in msg.outputs:
            entry = results.setdefault(out.rid, {"ids": [], "finished": False})
            entry["ids"].extend(out.new_output_ids)
            entry["finished"] = out.finished
            entry["reason"] = out.finish_reason
            entry["cached"] = out.cached_tokens
            if out.embedding is not None:
                entry["embedding"] = out.embedding


def run_until_idle(
    sched: Scheduler, results: dict[str, dict] | None = None, max_steps: int = 100_000
) -> dict[str, dict]:
    """Step until nothing is left; collect each request's output ids and final info."""
    results = {} if results is None else results
    for _ in range(max_steps):
        sched.step()
        collect(sched, results)
        if sched.is_idle():
            return results
    raise AssertionError("scheduler did not go idle")


def assert_idle_invariant(sched: Scheduler) -> None:
    report = sched.check_memory()
    assert report.ok, report.message
    assert report.protected == 0
    assert report.available + report.evictable == sched.max_total_tokens


def generate_greedy(runner: Any, prompts: list[list[int]], max_new_tokens: int, **args: Any) -> list[list[int]]:
    """Greedy outputs of ``prompts`` through a serial in-process Scheduler over ``runner``
    (a real ModelRunner too); the memory invariant must hold at the end."""
    from runtime.protocol.messages import TokenizedGenerateReq
    from runtime.protocol.sampling_params import SamplingParams

    server_args = ServerArgs(max_total_tokens=runner.max_total_tokens, disable_overlap_schedule=True, **args)
    sched = Scheduler(server_args, model_runner=runner)
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    for i, prompt in enumerate(prompts):
        sched.handle_message(TokenizedGenerateReq(rid=str(i), input_ids=prompt, sampling_params=params))
    results = run_until_idle(sched)
    assert sched.check_memory().ok
    return [results[str(i)]["ids"] for i in range(len(prompts))]
