"""The scheduler's request lifecycle, in-process, over the KV-verifying stub model.

The stub's next token is a hash of the sequence it reads back through
req_to_token, so any wrong slot mapping, lost prefix or early free changes the
tokens; the reference sequence is computed on plain lists.
"""

from __future__ import annotations

import random

import pytest

from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import (
    EOS,
    VOCAB,
    assert_idle_invariant,
    expected_output,
    run_until_idle,
    stub_scheduler,
)

OVERLAP = {"overlap": True}


@pytest.fixture(autouse=True, params=[False, True], ids=["serial", "overlap"])
def overlap_schedule(request: pytest.FixtureRequest) -> bool:
    """Every test runs with the inline worker and with the overlap worker (a thread)."""
    OVERLAP["overlap"] = request.param
    return request.param


def make_scheduler(max_total_tokens: int = 8192, page_size: int = 1, **overrides) -> Scheduler:
    return stub_scheduler(OVERLAP["overlap"], max_total_tokens, page_size, **overrides)


def submit(sched: Scheduler, rid: str, prompt: list[int], max_new_tokens: int, stream: bool = False) -> None:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params, stream=stream))


def random_prompts(n: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1, VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(1, 60))] for _ in range(n)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("disable_radix_cache", [False, True])
@pytest.mark.parametrize("chunked_prefill_size", [-1, 16])
def test_outputs_match_reference(page_size: int, disable_radix_cache: bool, chunked_prefill_size: int) -> None:
    sched = make_scheduler(
        page_size=page_size, disable_radix_cache=disable_radix_cache, chunked_prefill_size=chunked_prefill_size
    )
    prompts = random_prompts(12, seed=1, shared_prefix=24)
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, max_new_tokens=10 + i)
    results = run_until_idle(sched)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 10 + i), f"request r{i}"
        assert results[f"r{i}"]["reason"]["type"] == "length"
    assert_idle_invariant(sched)


def test_prefix_cache_hit_on_repeat() -> None:
    sched = make_scheduler()
    prompt = random_prompts(1, seed=2, shared_prefix=40)[0]
    submit(sched, "a", prompt, 5)
    first = run_until_idle(sched)["a"]
    submit(sched, "b", prompt, 5)
    second = run_until_idle(sched)["b"]
    assert first["cached"] == 0
    assert second["cached"] == len(prompt) - 1  # everything but the token that must be recomputed
    assert first["ids"] == second["ids"] == expected_output(prompt, 5)
    assert_idle_invariant(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_small_pool(page_size: int) -> None:
    # 40 requests of 64 + 64 tokens cannot all fit in 512 slots: decode must retract.
    sched = make_scheduler(max_total_tokens=512, page_size=page_size)
    rng = random.Random(3)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(64)] for _ in range(40)]
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, 64)
    results = run_until_idle(sched)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 64), f"request r{i}"
    assert sched.stats["num_retractions"] > 0
    assert_idle_invariant(sched)


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_every_policy_completes_correctly(policy: str) -> None:
    sched = make_scheduler(schedule_policy=policy, max_total_tokens=1024)
    prompts = random_prompts(16, seed=4, shared_prefix=30) + random_prompts(8, seed=5)
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, 8)
    results = run_until_idle(sched)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 8)
    assert_idle_invariant(sched)


def test_abort_in_queue_mid_prefill_and_mid_decode() -> None:
    sched = make_scheduler(chunked_prefill_size=8, max_prefill_tokens=64)
    rng = random.Random(6)
    long_prompt = [rng.randrange(1, VOCAB) for _ in range(50)]
    submit(sched, "decoding", [5, 6, 7], 1000)
    submit(sched, "chunked", long_prompt, 10)
    sched.step()  # prefill "decoding" and the first chunk of "chunked"
    assert sched.queues.chunked is not None and sched.queues.chunked.rid == "chunked"
    submit(sched, "queued", [9, 9, 9], 10)
    sched.abort("queued")
    sched.abort("chunked")
    for _ in range(3):
        sched.step()
    sched.abort("decoding")
    results = run_until_idle(sched)
    for rid in ("queued", "chunked", "decoding"):
        assert results[rid]["finished"] and results[rid]["reason"]["type"] == "abort", rid
    assert len(results["decoding"]["ids"]) < 1000
    assert_idle_invariant(sched)


def test_request_that_can_never_fit_gets_an_error() -> None:
    # Prompts longer than the pool are the tokenizer's to refuse (tests/e2e/test_server_errors.py);
    # a request that outgrows the pool while decoding alone finishes with an error, not a hang.
    sched = make_scheduler(max_total_tokens=64)
    submit(sched, "ok", [1, 2, 3], 4)
    results = run_until_idle(sched)
    assert results["ok"]["ids"] == expected_output([1, 2, 3], 4)
    submit(sched, "grows", [1, 2, 3], 200)
    results = run_until_idle(sched)
    assert results["grows"] == {"error": "out_of_memory"}
    assert_idle_invariant(sched)


def test_streaming_sends_every_interval() -> None:
    sched = make_scheduler(stream_interval=3)
    submit(sched, "s", [4, 5, 6], 10, stream=True)
    sizes: list[int] = []
    while not sched.is_idle() or not sizes:
        sched.step()
        for msg in sched.take_outbox():
            sizes.extend(len(o.new_output_ids) for o in msg.outputs)
    # First token at once, then every 3 tokens, the rest at finish.
    assert sizes == [1, 3, 3, 3]


def test_in_batch_prefix_dedup_computes_a_shared_prefix_once() -> None:
    # 8 requests arrive together sharing a 64-token prefix: one prefills it, the rest hit the cache.
    sched = make_scheduler()
    prompts = random_prompts(8, seed=7, shared_prefix=64)
    for i, p in enumerate(prompts):
        submit(sched, f"r{i}", p, 4)
    results = run_until_idle(sched)
    cached = sorted(results[f"r{i}"]["cached"] for i in range(8))
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached
    for i, p in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(p, 4)
    assert_idle_invariant(sched)


@pytest.mark.parametrize("mixed", [False, True])
def test_decode_progresses_under_a_stream_of_long_prompts(mixed: bool) -> None:
    """A running request keeps decoding while new long prompts arrive every step."""
    sched = make_scheduler(chunked_prefill_size=32, enable_mixed_chunk=mixed)
    submit(sched, "runner", [7, 8, 9], 40)
    rng = random.Random(8)
    progress: list[int] = []
    for step in range(30):
        submit(sched, f"long{step}", [rng.randrange(1, VOCAB) for _ in range(100)], 2)
        sched.step()
        sched.take_outbox()
        runner = next((r for r in sched.queues.running if r.rid == "runner"), None)
        progress.append(len(runner.output_ids) if runner else 40)
    # Without mixing, at most MAX_CONSECUTIVE_PREFILLS prefills run between two decodes;
    # with mixing, every prefill step also decodes the running request.
    window = 1 if mixed else 3
    for a, b in zip(progress, progress[window:]):
        assert b > a or b == 40, progress
    run_until_idle(sched)
    assert_idle_invariant(sched)


@pytest.mark.parametrize("page_size", [1, 4])
def test_mixed_chunk_outputs_match_reference(page_size: int) -> None:
    sched = make_scheduler(page_size=page_size, chunked_prefill_size=16, enable_mixed_chunk=True)
    prompts = random_prompts(10, seed=9, shared_prefix=20)
    collected: dict[str, dict] = {}
    for i, p in enumerate(prompts):
        # Staggered arrivals so prefills overlap with running decodes.
        submit(sched, f"r{i}", p, 12)
        sched.step()
        for msg in sched.take_outbox():
            for out in msg.outputs:
                collected.setdefault(out.rid, {"ids": []})["ids"].extend(out.new_output_ids)
    for rid, entry in run_until_idle(sched).items():
        collected.setdefault(rid, {"ids": []})["ids"].extend(entry["ids"])
    assert sched.stats["num_mixed_batches"] > 0
    for i, p in enumerate(prompts):
        assert collected[f"r{i}"]["ids"] == expected_output(p, 12), f"r{i}"
    assert_idle_invariant(sched)


def test_cached_prefixes_do_not_count_as_room_for_their_own_extension() -> None:
    """Two requests whose prefixes are cached, each fitting alone, must not livelock together."""
    sched = make_scheduler(max_total_tokens=200)
    pa, pb = list(range(1, 51)), list(range(101, 151))
    submit(sched, "seed-a", pa, 1)
    submit(sched, "seed-b", pb, 1)
    run_until_idle(sched)
    a, b = pa + list(range(300, 340)), pb + list(range(400, 485))
    submit(sched, "a", a, 10)
    submit(sched, "b", b, 1)
    results = run_until_idle(sched, max_steps=2000)
    assert results["a"]["ids"] == expected_output(a, 10)
    assert results["b"]["ids"] == expected_output(b, 1)
    assert_idle_invariant(sched)


def test_a_chunked_prompt_gives_way_to_a_decoding_request_that_fits() -> None:
    """Decode short of KV requeues the half-prefilled prompt rather than failing a request that fits."""
    sched = make_scheduler(max_total_tokens=256, chunked_prefill_size=32)
    short, long = [1, 2, 3], [5 + i % 900 for i in range(199)]
    submit(sched, "a", short, 220)  # 223 tokens: fits the pool alone
    sched.step()
    submit(sched, "b", long, 10)
    results = run_until_idle(sched)
    assert results["a"]["ids"] == expected_output(short, 220)
    assert results["b"]["ids"] == expected_output(long, 10)
    assert_idle_invariant(sched)


def test_logs_each_prefill_batch_and_every_nth_decode_step(caplog: pytest.LogCaptureFixture) -> None:
    sched = make_scheduler(decode_log_interval=3)
    for i in range(2):
        submit(sched, f"r{i}", [5 + i, 6, 7], 10)
    with caplog.at_level("INFO", logger="scheduler_proc.output"):
        run_until_idle(sched)
    prefills = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch.")]
    decodes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert prefills and "#new-seq: " in prefills[0] and "#new-token: " in prefills[0]
    assert len(decodes) == sched.stats["num_decode_batches"] // 3 > 0
    assert all("#running-req: " in d and "gen throughput (token/s): " in d for d in decodes)


def test_stop_strings_travel_with_a_requests_first_output_only() -> None:
    from scheduler_proc.output import OutputProcessor
    from scheduler_proc.req import Req, StopChecker

    output = OutputProcessor(StopChecker({EOS}, 100), stream_interval=1, decode_log_interval=0)
    req = Req(rid="s", origin_input_ids=[1, 2], sampling_params=SamplingParams(stop=["ab", "cd"]), stream=True)
    for token in (5, 6, 7):
        req.output_ids.append(token)
        output.emit(req)
    sent = [out for msg in output.take_outbox() for out in msg.outputs]
    assert [out.stop_strs for out in sent] == [["ab", "cd"], None, None]
