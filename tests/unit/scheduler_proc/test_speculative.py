"""Speculative decoding (n-gram drafts, one verify forward) in-process, over the KV-verifying stub.

The stub's next token hashes the last ``history`` tokens read back through ``req_to_token``: with
``history=1`` and a vocabulary of 16 its outputs cycle, so n-gram drafts are right most of the
time; with the whole history they are almost never right. Either way every output must equal the
output without speculation, token for token, and the memory invariant must hold after every step
(a rejected draft's slot that were not freed, or a row that kept it, breaks it).
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from runtime.config.args import ServerArgs
from runtime.engine.sampling.batch_info import SamplingBatchInfo
from runtime.engine.sampling.sampler import Sampler
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.spec.ngram import NgramProposer
from scheduler_proc.spec.verify import accepted_drafts
from tests.support.stub_runner import StubModelRunner
from tests.support.stub_scheduler import assert_idle_invariant, collect, run_until_idle

SMALL_VOCAB = 16  # (the stub's cycle with history 1: every token seen once more after 16)


def spec_scheduler(
    spec: bool, history: int | None = 1, vocab: int = SMALL_VOCAB, max_total_tokens: int = 4096, **overrides: Any
) -> Scheduler:
    overrides.setdefault("disable_overlap_schedule", True)
    overrides.setdefault("speculative_max_step_tokens", 1 << 20)  # (every request drafts, however many run)
    args = ServerArgs(max_total_tokens=max_total_tokens, speculative_algorithm="ngram" if spec else None, **overrides)
    runner = StubModelRunner(max_total_tokens=max_total_tokens, vocab_size=vocab, history=history)
    return Scheduler(args, model_runner=runner)


def submit(sched: Scheduler, rid: str, prompt: list[int], **params: Any) -> None:
    params.setdefault("temperature", 0.0)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=SamplingParams(**params)))


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


def run_both(calls: list[tuple[list[int], dict[str, Any]]], **kw: Any) -> tuple[dict, dict, Scheduler]:
    """Every call through a scheduler without and one with speculation; the invariant after each step."""
    results = []
    for spec in (False, True):
        sched = spec_scheduler(spec, **kw)
        for i, (prompt, params) in enumerate(calls):
            submit(sched, str(i), prompt, **params)
        out: dict[str, dict] = {}
        for _ in range(10_000):
            sched.step()
            assert sched.check_memory().ok, sched.last_invariant  # (completes a step in flight: then collect)
            collect(sched, out)
            if sched.is_idle():
                break
        assert_idle_invariant(sched)
        results.append(out)
    return results[0], results[1], sched


# ---------------------------------------------------------------- the proposer


def test_proposer_continues_the_longest_most_recent_match() -> None:
    proposer = NgramProposer(num_draft_tokens=4, min_window=1, max_window=8)
    # "5 6" occurred twice; the longer match "4 5 6" (at the start) wins over the later "9 5 6".
    tokens = [4, 5, 6, 7, 8, 9, 5, 6, 1, 2, 4, 5, 6]
    draft, index = proposer.propose(tokens, None, limit=4)
    assert draft == [7, 8, 9, 5]
    # The index is brought up to date incrementally: one more token, the same answer as from scratch.
    more = tokens + [7]
    assert proposer.propose(more, index, 3)[0] == proposer.propose(more, None, 3)[0] == [8, 9, 5]
    # A run into the present repeats the pattern: "1 2 1 2" -> "1 2 1".
    assert proposer.propose([3, 1, 2, 1, 2], None, 3)[0] == [1, 2, 1]
    # No earlier occurrence, a match shorter than the minimum window, no room: no draft.
    assert proposer.propose([1, 2, 3], None, 4)[0] == []
    assert NgramProposer(4, 3, 8).propose([7, 1, 2, 9, 1, 2], None, 4)[0] == []
    assert proposer.propose(tokens, None, 0)[0] == []
    # A draft that missed entirely: the request skips drafting for 2, then 4 steps; a hit resets that.
    index.record(drafted=3, accepted=0)
    assert [proposer.propose(more, index, 3)[0] for _ in range(3)] == [[], [], [8, 9, 5]]
    index.record(drafted=3, accepted=1)
    assert index.misses == 0
    index.record(drafted=3, accepted=0)
    index.record(drafted=3, accepted=0)
    assert index.skip == 4


def test_acceptance_rule() -> None:
    assert accepted_drafts([5, 6, 7], [5, 6]) == 2  # all accepted, the third sample is the bonus
    assert accepted_drafts([5, 9, 7], [5, 6]) == 1
    assert accepted_drafts([4], []) == 0


# ---------------------------------------------------------------- greedy equality, per-token rules


def test_repeating_output_accepts_drafts_and_equals_plain_decoding() -> None:
    calls = [(p, {"max_new_tokens": 40}) for p in prompts(32, 12, SMALL_VOCAB, seed=1)]
    off, on, sched = run_both(calls)
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
    info = sched.server_info()
    assert info["spec_accept_length"] > 1.6 and info["spec_accept_rate"] > 0.3, info
    assert sched.stats["num_decode_batches"] < 30  # 39 decode steps without speculation


def test_random_output_accepts_almost_nothing_and_equals_plain_decoding() -> None:
    calls = [(p, {"max_new_tokens": 24}) for p in prompts(8, 30, 1000, seed=2)]
    off, on, sched = run_both(calls, history=None, vocab=1000)
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
    info = sched.server_info()
    assert info["spec_accept_rate"] < 0.1 and info["spec_accept_length"] < 1.1, info


@pytest.mark.parametrize(("requests", "budget"), [(3, 12), (16, 16), (20, 16)])
def test_the_step_budget_shares_drafts_and_steps_aside_under_load(
    requests: int, budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--speculative-max-step-tokens: a verify step never feeds more tokens than the budget; the
    drafts are shared evenly, and with as many requests as the budget none is drafted (plain decode)."""
    from scheduler_proc.spec.verify import SpecDecoder

    sizes: list[list[int]] = []
    real = SpecDecoder.propose

    def propose(self: SpecDecoder, reqs: Any, free_slots: int, draft_room: Any) -> Any:
        drafts = real(self, reqs, free_slots, draft_room)
        sizes.append([len(d) for d in drafts] if drafts is not None else [0] * len(reqs))
        return drafts

    monkeypatch.setattr(SpecDecoder, "propose", propose)
    calls = [(p, {"max_new_tokens": 30, "ignore_eos": True}) for p in prompts(requests, 12, SMALL_VOCAB, seed=4)]
    off, on, sched = run_both(calls, speculative_max_step_tokens=budget)
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
    assert sizes and all(len(step) + sum(step) <= budget for step in sizes if any(step)), sizes
    full = [step for step in sizes if len(step) == requests]  # the steps every request decoded in
    assert full
    if requests >= budget:  # no room beyond one token a request: plain decoding
        assert not any(any(step) for step in sizes if len(step) >= budget), sizes
    else:
        assert any(max(step) == (budget - requests) // requests for step in full), sizes  # an even share each
        assert sched.stats["spec_accepted_drafts"] > 0


def test_the_device_gives_the_budgets_default() -> None:
    from runtime.engine.cpu.host_memory import CPU_PLATFORM
    from runtime.engine.cuda.memory import CUDA_PLATFORM
    from scheduler_proc.spec.verify import SpecDecoder

    args = ServerArgs(speculative_algorithm="ngram")
    cpu = SpecDecoder.create(args, 2048, {}, torch.device("cpu"))
    assert cpu is not None and cpu.step_tokens == CPU_PLATFORM.spec_step_tokens == 16
    assert CUDA_PLATFORM.spec_step_tokens is None  # (a GPU step has room for many rows: no limit)
    mine = SpecDecoder.create(
        ServerArgs(speculative_algorithm="ngram", speculative_max_step_tokens=40), 2048, {}, torch.device("cpu")
    )
    assert mine is not None and mine.step_tokens == 40
    assert SpecDecoder.create(ServerArgs(), 2048, {}, torch.device("cpu")) is None


def test_launchs_default_is_the_devices_choice_ngram_on_cpu_off_on_gpu() -> None:
    """launch.py's --speculative-algorithm defaults to auto: n-gram drafts on a CPU, nothing on a
    GPU or with pages of more than one slot; none turns it off; a ServerArgs built in Python is off."""
    from runtime.config.spec_args import resolve_speculative_algorithm
    from runtime.engine.cpu.host_memory import CPU_PLATFORM
    from runtime.engine.cuda.memory import CUDA_PLATFORM
    from scheduler_proc.spec.verify import SpecDecoder

    assert ServerArgs.from_cli([]).speculative_algorithm == "auto"
    assert ServerArgs().speculative_algorithm is None
    cpu, gpu = CPU_PLATFORM.default_speculative_algorithm, CUDA_PLATFORM.default_speculative_algorithm
    assert (cpu, gpu) == ("ngram", None)
    auto = ServerArgs(speculative_algorithm="auto")
    assert resolve_speculative_algorithm(auto, cpu) == "ngram"
    assert resolve_speculative_algorithm(auto, gpu) is None
    paged = ServerArgs(speculative_algorithm="auto", page_size=16)
    paged.validate()  # auto with pages is not an error: it is off
    assert resolve_speculative_algorithm(paged, cpu) is None
    with pytest.raises(ValueError, match="--page-size 1"):
        ServerArgs(speculative_algorithm="ngram", page_size=16).validate()
    for off in (None, "none"):
        assert resolve_speculative_algorithm(ServerArgs(speculative_algorithm=off), cpu) is None
    assert SpecDecoder.create(auto, 2048, {}, torch.device("cpu")) is not None
    assert (
        SpecDecoder.create(ServerArgs.from_cli(["--speculative-algorithm", "none"]), 2048, {}, torch.device("cpu"))
        is None
    )
    assert SpecDecoder.create(paged, 2048, {}, torch.device("cpu")) is None


def test_batch_of_one() -> None:
    off, on, sched = run_both([([3, 4, 5, 6], {"max_new_tokens": 30})])
    assert on["0"]["ids"] == off["0"]["ids"] and len(on["0"]["ids"]) == 30
    assert sched.server_info()["spec_accept_length"] > 1.5


def test_stops_limits_and_streams_cut_inside_an_accepted_run() -> None:
    """Stop tokens, max_new_tokens, min_new_tokens, stream chunks: per accepted token, as without drafts."""
    base = prompts(6, 10, SMALL_VOCAB, seed=3)
    calls = [
        (base[0], {"max_new_tokens": 23}),  # length cut inside a run
        (base[1], {"max_new_tokens": 40, "stop_token_ids": [7]}),  # stop token inside a run
        (base[2], {"max_new_tokens": 40, "stop_token_ids": [7], "min_new_tokens": 20}),
        (base[3], {"max_new_tokens": 1}),
        (base[4], {"max_new_tokens": 30, "repetition_penalty": 1.3, "frequency_penalty": 0.5}),
        (base[5], {"max_new_tokens": 30, "temperature": 0.8, "seed": 9}),
    ]
    off, on, _ = run_both(calls)
    for rid in off:
        assert (on[rid]["ids"], on[rid]["reason"]) == (off[rid]["ids"], off[rid]["reason"]), rid
    assert len(on["0"]["ids"]) == 23 and on["1"]["ids"][-1] == 7 and len(on["2"]["ids"]) >= 20
    # Streaming: every accepted token reaches the client, in order, with the stop token last.
    sched = spec_scheduler(True)
    sched.handle_message(
        TokenizedGenerateReq(
            rid="s",
            input_ids=base[1],
            stream=True,
            sampling_params=SamplingParams(max_new_tokens=40, temperature=0.0, stop_token_ids=[7]),
        )
    )
    assert run_until_idle(sched)["s"]["ids"] == off["1"]["ids"]


def test_chunked_prefill_prefix_hits_and_overlap_flag() -> None:
    """Shared prefixes (radix hits) and 8-token chunks; ``--enable-overlap-schedule`` runs speculation's
    steps without planning ahead."""
    shared = prompts(1, 24, SMALL_VOCAB, seed=4)[0]
    calls = [(shared + p, {"max_new_tokens": 20}) for p in prompts(12, 5, SMALL_VOCAB, seed=5)]
    for overlap in (False, True):
        off, on, sched = run_both(calls, chunked_prefill_size=8, disable_overlap_schedule=not overlap)
        assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
        assert sched.stats["cached_prompt_tokens"] > 0 and sched.stats["spec_accepted_drafts"] > 0


def test_retraction_under_a_small_pool() -> None:
    calls = [(p, {"max_new_tokens": 64}) for p in prompts(40, 24, SMALL_VOCAB, seed=6)]
    off, on, sched = run_both(calls, max_total_tokens=512)
    assert {k: v["ids"] for k, v in on.items()} == {k: v["ids"] for k, v in off.items()}
    assert sched.stats["num_retractions"] > 0 and sched.stats["spec_accepted_drafts"] > 0


def test_memory_invariant_after_500_requests_with_random_aborts() -> None:
    rng = random.Random(7)
    sched = spec_scheduler(True, max_total_tokens=1024)
    pending = [
        (str(i), [rng.randrange(1, SMALL_VOCAB) for _ in range(rng.randrange(2, 12))], rng.randrange(1, 40))
        for i in range(500)
    ]
    live: list[str] = []
    done: dict[str, dict] = {}
    while pending or not sched.is_idle():
        for _ in range(rng.randrange(0, 6)):
            if pending:
                rid, prompt, n = pending.pop()
                submit(sched, rid, prompt, max_new_tokens=n)
                live.append(rid)
        if live and rng.random() < 0.3:
            sched.abort(live.pop(rng.randrange(len(live))))
        sched.step()
        collect(sched, done)
        live = [rid for rid in live if not done.get(rid, {}).get("finished")]
    assert len(done) == 500 and all(r["finished"] for r in done.values())
    assert sum(r["reason"]["type"] == "abort" for r in done.values()) > 50
    assert sched.stats["spec_accepted_drafts"] > 0
    assert_idle_invariant(sched)


# ---------------------------------------------------------------- sampling: rejection sampling, proven


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """The chi-square quantile for ``df`` degrees of freedom at normal quantile ``z`` (3.29: p = 0.0005),
    by Wilson-Hilferty (accurate to a few percent for df >= 3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}])
def test_verified_tokens_follow_the_target_distribution(params: dict[str, Any]) -> None:
    """A verify row pair (one draft) sampled the way the scheduler samples it, 20000 times with
    distinct seeds: the first token emitted and, given it was the accepted draft, the second, follow
    the target's processed distribution (temperature, top-k, top-p) by a chi-square test; the draft
    is a likely token, so both the accept and the residual branch are exercised."""
    vocab, n = 8, 20000
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, vocab, generator=gen) * 1.5
    draft = int(logits[0].argmax())
    sp = SamplingParams(max_new_tokens=4, seed=0, **params)
    rows = [SamplingParams(max_new_tokens=4, seed=i, **params) for i in range(n)]
    histories = [[5] * 3 + ([draft] if j else []) for _ in range(n) for j in (0, 1)]
    info = SamplingBatchInfo.from_requests(
        [r for r in rows for _ in (0, 1)], [[1]] * (2 * n), histories, vocab, [], "cpu"
    )
    samples = Sampler()(logits.repeat(n, 1), info).next_token_ids.view(n, 2).tolist()
    first = [s[0] for s in samples]
    second = [s[1] for s, f in zip(samples, first) if accepted_drafts(s, [draft]) == 1]
    for observed, row in ((first, 0), (second, 1)):
        target = _processed_probs(logits[row], sp, vocab)
        counts = torch.bincount(torch.tensor(observed), minlength=vocab).double()
        support = target > 0
        assert counts[~support].sum() == 0  # nothing outside top-k / top-p
        expected = target[support] * len(observed)
        stat = float(((counts[support] - expected) ** 2 / expected).sum())
        assert stat < chi_square_critical(int(support.sum()) - 1), (row, stat, counts, expected)
    assert 0.2 < len(second) / n < 0.95  # the draft was accepted and rejected often


def _processed_probs(logits: torch.Tensor, sp: SamplingParams, vocab: int) -> torch.Tensor:
    """The target distribution written out plainly (HF's order: temperature, top-k, top-p)."""
    probs = torch.softmax(logits.double() / sp.temperature, dim=-1)
    if 0 < sp.top_k < vocab:
        probs[probs < probs.topk(sp.top_k).values[-1]] = 0
    if sp.top_p < 1.0:
        order = probs.argsort(descending=True)
        mass = probs[order].cumsum(0) - probs[order]
        probs[order[mass >= sp.top_p * probs.sum()]] = 0
    return probs / probs.sum()


# ---------------------------------------------------------------- the host tier, DP


def test_host_tier_loads_back_under_speculation() -> None:
    """Histories pushed out of a small pool come back from the host tier and are decoded on with
    drafts; the tokens are those of plain decoding, both tiers' invariant holds."""
    rng = random.Random(8)
    firsts = [[rng.randrange(1, SMALL_VOCAB) for _ in range(120)] for _ in range(3)]
    waves = [[(p, 24) for p in firsts], [(p + [3, 4], 24) for p in firsts]]
    outputs = []
    for spec in (False, True):
        sched = spec_scheduler(spec, max_total_tokens=256, enable_hierarchical_cache=True, hicache_ratio=8.0)
        results: dict[str, dict] = {}
        for w, wave in enumerate(waves):
            for i, (prompt, n) in enumerate(wave):  # one at a time: each pushes the last one out
                submit(sched, f"{w}-{i}", prompt, max_new_tokens=n)
                while not sched.is_idle():
                    sched.step()
                    collect(sched, results)
        assert_idle_invariant(sched)
        outputs.append({k: v["ids"] for k, v in results.items()})
    assert outputs[0] == outputs[1]
    info = sched.server_info()
    assert info["host_hit_tokens"] > 0 and info["spec_accepted_drafts"] > 0


def test_dp_controller_merges_the_counters() -> None:
    from scheduler_proc.dp_controller import merge_control_replies

    replica = {
        "spec_decode_req_steps": 10,
        "spec_decode_tokens": 25,
        "spec_draft_tokens": 30,
        "spec_accepted_drafts": 15,
        "spec_verify_batches": 4,
    }
    other = {**replica, "spec_decode_req_steps": 30, "spec_decode_tokens": 35}
    merged = merge_control_replies("server_info", [replica, other])
    assert merged["spec_accept_length"] == pytest.approx(60 / 40)
    assert merged["spec_accept_rate"] == pytest.approx(30 / 60)
    assert "spec_accept_length" not in merge_control_replies("server_info", [{"num_running": 0}])


def test_decode_log_line_reports_acceptance(caplog: pytest.LogCaptureFixture) -> None:
    sched = spec_scheduler(True, decode_log_interval=5)
    submit(sched, "r", [3, 4, 5, 6], max_new_tokens=40)
    with caplog.at_level("INFO", logger="scheduler_proc.output"):
        run_until_idle(sched)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch")]
    assert lines and all("accept len: " in line and "accept rate: " in line for line in lines)
    # The throughput counts every emitted token: more than one per step here.
    assert sched.stats["spec_decode_tokens"] > sched.stats["num_decode_batches"]


# ---------------------------------------------------------------- n-grams across requests


def test_ngram_table_keeps_the_latest_continuation_of_the_longest_run_within_its_capacity() -> None:
    from scheduler_proc.spec.ngram_table import NgramTable

    table = NgramTable(capacity=100, continuation=3)
    table.add([1, 2, 3, 4, 5, 6, 7])
    assert table.lookup([9, 2, 3, 4], 3) == [5, 6, 7]  # the 3-run (2, 3, 4) continues with 5 6 7
    assert table.lookup([9, 9, 3, 4], 2) == [5, 6]  # a 2-run, cut to the limit
    assert table.lookup([9, 9, 9, 8], 3) == []
    table.add([7, 3, 4, 1, 1])
    assert table.lookup([0, 3, 4], 3) == [1, 1]  # the newer continuation of (3, 4)
    assert table.lookup([2, 3, 4], 3) == [5, 6, 7]  # the longer run wins
    small = NgramTable(capacity=5, continuation=2)
    small.add(list(range(20)))
    assert len(small) == 5 and small.lookup([16, 17], 2) == [18, 19] and small.lookup([1, 2], 2) == []


def test_a_later_request_drafts_from_an_earlier_ones_text() -> None:
    """The stub with history 1 continues a token the same way every time: a new request whose own
    text has not repeated yet finds the continuation in the table of finished requests."""
    first, second = [3, 4, 5], [9, 10, 5]  # (both end in 5: the second continues as the first did)

    def second_request_drafts(capacity: int) -> tuple[list[int], int]:
        sched = spec_scheduler(True, speculative_ngram_capacity=capacity)
        submit(sched, "a", first, max_new_tokens=12)
        run_until_idle(sched)
        drafts_before = sched.stats["spec_draft_tokens"]
        submit(sched, "b", second, max_new_tokens=12)
        out = run_until_idle(sched)
        assert_idle_invariant(sched)
        return out["b"]["ids"], sched.stats["spec_draft_tokens"] - drafts_before

    plain = run_both([(first, {"max_new_tokens": 12}), (second, {"max_new_tokens": 12})])[0]
    with_table, drafted_with = second_request_drafts(4096)
    without, drafted_without = second_request_drafts(0)
    assert with_table == without == plain["1"]["ids"]
    assert drafted_with > drafted_without
