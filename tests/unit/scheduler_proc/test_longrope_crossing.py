"""Phi-3 LongRoPE through the real scheduler: greedy output equals transformers' ``generate``
token for token wherever a request meets ``original_max_position_embeddings`` (ORIG).

``generate`` keeps every cached key on one side of ORIG: a prompt past it is one forward with the
long factors, and the step at which a sequence outgrows it re-runs the whole sequence with them.
The scheduler keeps the same rule (``scheduler_proc.long_rope``): chunks of a long prompt all read
the long rows, a request decoding across ORIG is recomputed, and long and short KV never share a
prefix-cache namespace. Each case here would differ from ``generate`` without one of those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from runtime.config.args import ServerArgs
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.long_rope import LONG_NAMESPACE, LongRopeSwitch, OneRope, create_rope_switch
from scheduler_proc.req import Req
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import PHI3_ORIGINAL_MAX, TinyCheckpoints, hf_greedy, load_hf_model, random_prompt
from tests.support.stub_scheduler import assert_idle_invariant, run_until_idle

ORIG = PHI3_ORIGINAL_MAX
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def phi3_longrope(tiny_checkpoints: TinyCheckpoints) -> tuple[Path, Any]:
    path = tiny_checkpoints.path("phi3_longrope")
    return path, load_hf_model(path)


def _runner(path: Path, page_size: int = 1) -> ModelRunner:
    return ModelRunner(
        path,
        page_size=page_size,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=4096,
        load_progress=False,
    )


def _scheduler(runner: ModelRunner, **args: Any) -> Scheduler:
    args.setdefault("disable_overlap_schedule", True)
    return Scheduler(ServerArgs(max_total_tokens=runner.max_total_tokens, **args), model_runner=runner)


def _submit(sched: Scheduler, rid: str, prompt: list[int], new_tokens: int = NEW_TOKENS) -> None:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params))


def _serve(sched: Scheduler, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of ``prompts`` submitted together; the memory invariant holds afterwards."""
    for i, prompt in enumerate(prompts):
        _submit(sched, str(i), prompt)
    results = run_until_idle(sched)
    assert_idle_invariant(sched)
    return [results[str(i)]["ids"] for i in range(len(prompts))]


def _expected(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [hf_greedy(hf, p, NEW_TOKENS)[0] for p in prompts]


@pytest.mark.parametrize("mode", ["serial", "overlap", "pages"])
def test_decoding_across_orig_is_recomputed_as_generate(phi3_longrope: tuple[Path, Any], mode: str) -> None:
    """A prompt of ORIG - 5 decodes 16 tokens: at the step that takes it past ORIG it is retracted and
    re-prefilled over prompt + outputs with the long factors, as ``generate`` re-runs it (a prompt of
    ORIG at its first decode step); overlap on and off, pages of one token and of four."""
    path, hf = phi3_longrope
    page_size = 4 if mode == "pages" else 1
    runner = _runner(path, page_size=page_size)
    prompts = [random_prompt(ORIG - 5, runner.vocab_size, seed=11), random_prompt(ORIG, runner.vocab_size, seed=12)]
    sched = _scheduler(runner, disable_overlap_schedule=mode != "overlap", page_size=page_size)
    assert _serve(sched, prompts) == _expected(hf, prompts)
    assert sched.stats["num_rope_recomputations"] == 2
    assert sched.stats["num_retractions"] == 0  # (a recomputation is not a memory shortage)


def test_chunks_of_a_long_prompt_below_orig_read_the_long_rows(phi3_longrope: tuple[Path, Any]) -> None:
    """ORIG + 30 tokens in chunks of 32: the first chunks end below ORIG and still rotate long,
    as the prompt's one forward in ``generate`` does."""
    path, hf = phi3_longrope
    runner = _runner(path)
    prompt = random_prompt(ORIG + 30, runner.vocab_size, seed=21)
    sched = _scheduler(runner, chunked_prefill_size=32)
    assert _serve(sched, [prompt]) == _expected(hf, [prompt])
    assert sched.stats["num_prefill_batches"] == 4
    assert sched.stats["num_rope_recomputations"] == 0


@pytest.mark.parametrize("host_tier", [False, True])
def test_short_and_long_requests_never_share_cached_kv(phi3_longrope: tuple[Path, Any], host_tier: bool) -> None:
    """Radix cache on: a long prompt extending a cached short one recomputes the shared prefix (the
    cached KV is short-rotated); a later long request reuses the long one's KV, and a short
    request after them reuses only the short KV, none of a long request's. With the host tier too
    (its nodes carry the same namespaces)."""
    path, hf = phi3_longrope
    runner = _runner(path)
    sched = _scheduler(runner, enable_hierarchical_cache=host_tier)
    short = random_prompt(60, runner.vocab_size, seed=31)
    long = short + random_prompt(ORIG - 20, runner.vocab_size, seed=32)
    longer = long + random_prompt(10, runner.vocab_size, seed=33)
    short_again = short + random_prompt(5, runner.vocab_size, seed=34)
    results: dict[str, dict] = {}
    for rid, prompt in (("short", short), ("long", long), ("longer", longer), ("short_again", short_again)):
        _submit(sched, rid, prompt)
        run_until_idle(sched, results)
        assert results[rid]["ids"] == hf_greedy(hf, prompt, NEW_TOKENS)[0], rid
        assert_idle_invariant(sched)
    # a short prompt inside a long one served first (its KV only long-rotated)
    inside = random_prompt(ORIG + 20, runner.vocab_size, seed=35)
    for rid, prompt in (("inside_long", inside), ("inside_short", inside[:50])):
        _submit(sched, rid, prompt)
        run_until_idle(sched, results)
        assert results[rid]["ids"] == hf_greedy(hf, prompt, NEW_TOKENS)[0], rid
        assert_idle_invariant(sched)
    cached = {rid: results[rid]["cached"] for rid in results}
    assert cached["long"] == 0  # the short request's cached prefix is short-rotated
    assert cached["longer"] >= len(long)  # the long request's KV (and outputs) is long-rotated
    assert len(short) <= cached["short_again"] < len(short) + 5
    assert cached["inside_short"] == 0


@pytest.mark.parametrize("mode", ["serial", "overlap", "mixed"])
def test_a_batch_within_across_and_past_orig(phi3_longrope: tuple[Path, Any], mode: str) -> None:
    """Requests within ORIG, crossing it while decoding (at different steps) and prompts past it,
    in one running batch sharing a prefix, with chunked prefill; overlap on and off, and decode rows
    riding in prefill batches (mixed chunks)."""
    path, hf = phi3_longrope
    runner = _runner(path)
    head = random_prompt(40, runner.vocab_size, seed=41)
    prompts = [
        head + random_prompt(n - len(head), runner.vocab_size, seed=42 + n) if n > len(head) else head[:n]
        for n in (ORIG - 3, 20, ORIG - 9, ORIG + 12, ORIG + 1, 70)
    ]
    sched = _scheduler(
        runner, disable_overlap_schedule=mode != "overlap", enable_mixed_chunk=mode == "mixed", chunked_prefill_size=64
    )
    assert _serve(sched, prompts) == _expected(hf, prompts)
    assert sched.stats["num_rope_recomputations"] == 2
    if mode == "mixed":
        assert sched.stats["num_mixed_batches"] > 0


def test_speculative_decoding_across_orig(phi3_longrope: tuple[Path, Any]) -> None:
    """n-gram drafts of a short request stop at ORIG; the step past it recomputes; a long request
    drafts freely. Prompts repeat a passage, so drafts are proposed (and some accepted)."""
    path, hf = phi3_longrope
    runner = _runner(path)
    passage = random_prompt(12, runner.vocab_size, seed=51)
    prompts = [(passage * 8)[: ORIG - 6], (passage * 10)[: ORIG + 7], random_prompt(ORIG - 2, runner.vocab_size, 52)]
    sched = _scheduler(runner, speculative_algorithm="ngram", speculative_max_step_tokens=1 << 20)
    assert _serve(sched, prompts) == _expected(hf, prompts)
    assert sched.stats["num_rope_recomputations"] == 2
    assert sched.stats["spec_verify_batches"] > 0 and sched.stats["spec_accepted_drafts"] > 0


# ---- the rules, without a model -----------------------------------------------------------


def _req(n: int, outputs: int = 0, inflight: int = 0) -> Req:
    req = Req(rid="r", origin_input_ids=[5] * n, sampling_params=SamplingParams(max_new_tokens=8))
    req.output_ids, req.num_inflight = [7] * outputs, inflight
    return req


def test_switch_rules() -> None:
    switch = LongRopeSwitch(10)
    assert isinstance(create_rope_switch(None), OneRope) and isinstance(create_rope_switch(10), LongRopeSwitch)
    within, crossing, inflight = _req(10), _req(9, outputs=2), _req(9, outputs=1, inflight=1)
    assert switch.must_recompute([within, crossing, inflight]) == [crossing, inflight]
    assert switch.draft_room(within) == 0 and switch.draft_room(_req(6)) == 4
    switch.settle(within)
    assert not within.long_rope and within.extra_key is None
    switch.settle(crossing)
    assert crossing.long_rope and crossing.extra_key == LONG_NAMESPACE
    assert switch.draft_room(crossing) is None and switch.must_recompute([crossing]) == []
    assert switch.extend_flags([within, crossing]) == [False, True]
    switch.settle(crossing)  # (once)
    assert crossing.extra_key == LONG_NAMESPACE


def _extend_flags(runner: ModelRunner) -> list[list[bool] | None]:
    """Record each extend (or mixed) batch's ``long_rope`` flags that ``runner`` runs from now on."""
    seen: list[list[bool] | None] = []
    forward = runner.forward

    def spy(batch: Any) -> Any:
        if batch.forward_mode.is_extend():
            seen.append(None if batch.long_rope is None else batch.long_rope.tolist())
        return forward(batch)

    runner.forward = spy  # type: ignore[method-assign]
    return seen


def test_models_without_a_switch_build_no_flags(tiny_checkpoints: TinyCheckpoints) -> None:
    """Plain Phi-3 (as every model without LongRoPE): no switch, no per-request flags in batches."""
    runner = _runner(tiny_checkpoints.path("phi3"))
    assert runner.rope_switch_len is None
    sched = _scheduler(runner)
    assert isinstance(sched.rope_switch, OneRope) and sched.builder.rope_switch is sched.rope_switch
    seen = _extend_flags(runner)
    _serve(sched, [random_prompt(ORIG + 5, runner.vocab_size, seed=61)])
    assert seen == [None]


def test_long_rope_flags_reach_the_extend_batches(phi3_longrope: tuple[Path, Any]) -> None:
    """Every chunk of a long prompt carries its request's flag; a short prompt's is False."""
    path, _ = phi3_longrope
    runner = _runner(path)
    assert runner.rope_switch_len == ORIG
    sched = _scheduler(runner, chunked_prefill_size=40)
    seen = _extend_flags(runner)
    _serve(sched, [random_prompt(ORIG + 2, runner.vocab_size, seed=71), random_prompt(5, runner.vocab_size, seed=72)])
    assert seen == [[True], [True], [True, False]]  # chunks of 40, 40, then 18 with the short prompt
