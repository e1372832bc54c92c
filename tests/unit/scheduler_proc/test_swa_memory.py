"""Hybrid sliding-window memory: the paired allocator, the SWA caches and invariant, and the
scheduler serving the tiny windowed checkpoints in-process (real ModelRunner, fp32 CPU).

The scheduler tests compare every request's greedy tokens with transformers (whose sliding-window
mask tests/unit/runtime/engine/attention/test_sliding_window.py checks), so an SWA slot freed while a
window still sees it, or a prefix matched without its SWA half, changes the tokens.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from memory.invariant import check_memory_invariant
from memory.req_state import SimpleCacheRequest
from memory.req_to_token_pool import ReqToTokenPool
from memory.swa_allocator import SWATokenToKVPoolAllocator
from memory.swa_chunk_cache import SWAChunkCache
from memory.swa_kv_pool import swa_pool_sizes
from runtime.config.args import ServerArgs
from runtime.engine.model_runner import ModelRunner
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.checkpoints import SWA_WINDOWS, hf_greedy, load_hf_model, random_prompt
from tests.support.stub_scheduler import collect, run_until_idle

# ---- allocator, chunk cache, invariant -------------------------------------------------


def _allocator(full: int = 32, swa: int = 12) -> SWATokenToKVPoolAllocator:
    return SWATokenToKVPoolAllocator(full, swa, torch.zeros(full + 1, dtype=torch.int64), "cpu", debug=True)


def test_allocator_hands_out_pairs_and_frees_either_half() -> None:
    alloc = _allocator()
    full = alloc.alloc(10)
    assert full is not None and alloc.available_size() == 2  # the SWA pool is the short one
    swa = alloc.full_to_swa[full]
    assert bool((swa > 0).all()) and swa.unique().numel() == 10
    assert alloc.alloc(3) is None and alloc.full_available_size() == 22  # nothing taken on failure
    assert alloc.free_swa(full[:6]) == 6 and alloc.free_swa(full[:6]) == 0  # twice is harmless
    assert alloc.swa_available_size() == 8 and alloc.full_available_size() == 22
    assert bool((alloc.full_to_swa[full[:6]] == 0).all())
    alloc.free(full)  # full slots, with the SWA slots the last four still have
    assert alloc.full_available_size() == 32 and alloc.swa_available_size() == 12
    assert not alloc.full_to_swa.any()
    with pytest.raises(ValueError, match="double free"):
        alloc.free(full[:1])


def test_pool_sizes_share_a_full_attention_budget() -> None:
    full, swa = swa_pool_sizes(1000, 0.25, full_layers=2, swa_layers=2)  # 1000 tokens x 4 layers of memory
    assert swa == full // 4 and abs((2 * full + 2 * swa) - 4000) <= 4
    assert swa_pool_sizes(1000, 0.5, full_layers=0, swa_layers=4) == (2000, 1000)
    with pytest.raises(ValueError, match="ratio"):
        swa_pool_sizes(1000, 0.0, 1, 1)


def _chunk_cache_with_request(window: int, length: int) -> tuple[SWAChunkCache, SimpleCacheRequest, torch.Tensor]:
    alloc = _allocator(64, 64)
    pool = ReqToTokenPool(4, 128, "cpu")
    cache = SWAChunkCache(pool, alloc, window)
    req = SimpleCacheRequest(list(range(length)), fill_ids=list(range(length)))
    assert cache.attach_rows([req])
    slots = alloc.alloc(length)
    assert slots is not None and req.cache_handle.req_pool_idx is not None
    pool.write(req.cache_handle.req_pool_idx, 0, slots.to(torch.int32))
    return cache, req, slots


def test_chunk_cache_frees_what_left_the_window_and_the_rest_at_release() -> None:
    cache, req, slots = _chunk_cache_with_request(window=8, length=20)
    alloc = cache.swa_allocator
    assert cache.free_out_of_window(req, 20) == 13  # positions 0..12: the next query (20) sees 13..19
    assert req.cache_handle.swa_evicted_len == 13 and alloc.swa_available_size() == 64 - 7
    assert bool((alloc.full_to_swa[slots[:13]] == 0).all()) and bool((alloc.full_to_swa[slots[13:]] > 0).all())
    assert cache.free_out_of_window(req, 20) == 0 and cache.free_out_of_window(req, 21) == 1
    report = check_memory_invariant(
        alloc,
        cache,
        cache.req_to_token_pool,
        64,
        idle=False,  # type: ignore[arg-type]
        active_rows={req.cache_handle.req_pool_idx: 20},
    )
    assert report.ok, report.message
    assert report.swa == {
        "available": 58,
        "evictable": 0,
        "protected": 0,
        "request_owned": 6,
        "size": 64,
        "problems": [],
    }
    cache.release_req(req, 20)
    assert alloc.full_available_size() == alloc.swa_available_size() == 64 and req.cache_handle.swa_evicted_len == 0
    assert check_memory_invariant(alloc, cache, cache.req_to_token_pool, 64, idle=True).ok  # type: ignore[arg-type]


def test_invariant_names_leaked_and_dangling_swa_slots() -> None:
    cache, req, slots = _chunk_cache_with_request(window=8, length=10)
    alloc = cache.swa_allocator
    stray = alloc.swa.alloc(2)  # taken from the SWA pool, mapped to no token
    assert stray is not None
    alloc.full.free(slots[:1])  # a full slot freed behind the pair's back: its SWA slot dangles
    report = check_memory_invariant(
        alloc,
        cache,
        cache.req_to_token_pool,
        64,
        idle=False,  # type: ignore[arg-type]
        active_rows={req.cache_handle.req_pool_idx: 10},
    )
    assert not report.ok
    assert "2 leaked SWA slots" in report.message and "free full slots keep an SWA slot" in report.message


# ---- the scheduler on the windowed checkpoints ------------------------------------------

NEW_TOKENS = 40


@pytest.fixture(scope="module")
def references(tiny_checkpoints: Any) -> dict[str, Any]:
    return {name: load_hf_model(tiny_checkpoints.path(name)) for name in SWA_WINDOWS}


_expected: dict[tuple[str, tuple[int, ...], int], list[int]] = {}


def expected(references: dict[str, Any], name: str, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    key = (name, tuple(prompt), n)
    if key not in _expected:
        _expected[key] = hf_greedy(references[name], prompt, n)[0]
    return _expected[key]


def make_scheduler(path: Path, max_total_tokens: int = 2048, ratio: float = 0.5, **flags: Any) -> Scheduler:
    flags.setdefault("disable_overlap_schedule", True)
    args = ServerArgs(max_total_tokens=max_total_tokens, swa_full_tokens_ratio=ratio, **flags)
    runner = ModelRunner(
        path,
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=max_total_tokens,
        swa_full_tokens_ratio=ratio,
        load_progress=False,
        max_running_requests=16,
    )
    return Scheduler(args, model_runner=runner)


def submit(sched: Scheduler, rid: str, prompt: list[int], n: int = NEW_TOKENS) -> None:
    sched.handle_message(
        TokenizedGenerateReq(
            rid=rid, input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0)
        )
    )


def assert_both_pools_clean(sched: Scheduler) -> None:
    report = sched.check_memory()
    assert report.ok, report.message
    assert report.swa is not None
    swa = report.swa
    assert swa["protected"] == swa["request_owned"] == 0
    assert swa["available"] + swa["evictable"] == swa["size"]
    assert report.available + report.evictable == sched.max_total_tokens


def _prompts(vocab: int) -> list[list[int]]:
    return [random_prompt(n, vocab, seed=900 + n) for n in (23, 50, 70)]


def _second_round(first: list[list[int]], outputs: list[list[int]], vocab: int) -> list[list[int]]:
    """Two conversations go on (prompt + answer + a new turn: the whole history is cached, its
    last window live), one reuses a prefix that ends where the first request's window had
    moved on (the match backs off to what the windowed layers still have)."""
    return [
        first[0] + outputs[0] + random_prompt(9, vocab, seed=1),
        first[2] + outputs[2] + random_prompt(20, vocab, seed=2),
        first[1][:45] + random_prompt(12, vocab, seed=3),
    ]


@pytest.mark.parametrize("name", sorted(SWA_WINDOWS))
@pytest.mark.parametrize(
    "radix,chunk,overlap",
    [(True, 8, False), (True, 40, True), (False, 8, True), (False, 40, False)],
    ids=["radix-chunk8", "radix-chunk40-overlap", "chunkcache-chunk8-overlap", "chunkcache-chunk40"],
)
def test_scheduler_greedy_equals_transformers(
    tiny_checkpoints, references, name: str, radix: bool, chunk: int, overlap: bool
) -> None:
    sched = make_scheduler(
        tiny_checkpoints.path(name),
        disable_radix_cache=not radix,
        chunked_prefill_size=chunk,
        disable_overlap_schedule=not overlap,
    )
    assert sched.allocator.swa_size == sched.max_total_tokens // 2
    vocab = sched.runner.vocab_size
    first = _prompts(vocab)
    results: dict[str, dict] = {}
    for i, prompt in enumerate(first):
        submit(sched, f"a{i}", prompt)
    run_until_idle(sched, results)
    for i, prompt in enumerate(first):
        assert results[f"a{i}"]["ids"] == expected(references, name, prompt), f"a{i}"
    second = _second_round(first, [results[f"a{i}"]["ids"] for i in range(3)], vocab)
    for i, prompt in enumerate(second):
        submit(sched, f"b{i}", prompt)
    run_until_idle(sched, results)
    for i, prompt in enumerate(second):
        assert results[f"b{i}"]["ids"] == expected(references, name, prompt), f"b{i}"
    for i in (0, 1):  # the history up to its last token's KV (prompt + answer - 1)
        history = len(first[2 * i]) + NEW_TOKENS - 1
        assert results[f"b{i}"]["cached"] == (history if radix else 0), f"b{i}"
    assert_both_pools_clean(sched)


@pytest.mark.parametrize("radix", [False, True], ids=["chunk-cache", "radix"])
def test_swa_usage_stays_near_the_window_during_a_long_generation(tiny_checkpoints, references, radix: bool) -> None:
    name = "qwen2_swa"
    window = SWA_WINDOWS[name]
    sched = make_scheduler(tiny_checkpoints.path(name), disable_radix_cache=not radix, chunked_prefill_size=16)
    prompts = [random_prompt(40, sched.runner.vocab_size, seed=s) for s in (3, 4)]
    for i, prompt in enumerate(prompts):
        submit(sched, f"r{i}", prompt, n=150)
    alloc = sched.allocator
    results: dict[str, dict] = {}
    peak_swa, peak_full = 0, 0
    while not sched.is_idle():
        sched.step()
        collect(sched, results)
        peak_swa = max(peak_swa, alloc.swa_size - alloc.swa_available_size())
        peak_full = max(peak_full, alloc.size - alloc.full_available_size())
    # Each request keeps its last W tokens (+ a chunk's new ones); with the radix cache the tree
    # also keeps the W - 1 tokens before the end of the prefix a request locks (its guard).
    per_request = window + 16 + (window - 1 if radix else 0)
    assert peak_swa <= 2 * per_request, (peak_swa, peak_full)
    assert peak_full >= 2 * (40 + 140)  # the full pool holds every token
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected(references, name, prompt, 150)
    assert_both_pools_clean(sched)


def test_random_aborts_and_retraction_leak_nothing(tiny_checkpoints, references) -> None:
    """A pool too small for the batch forces retractions; random aborts land mid-prefill and
    mid-decode. Survivors match transformers; both pools are whole afterwards."""
    name = "mistral_swa"
    sched = make_scheduler(
        tiny_checkpoints.path(name),
        max_total_tokens=200,
        ratio=1.0,
        chunked_prefill_size=16,
        disable_overlap_schedule=False,
    )
    rng = random.Random(0)
    prompts = {f"r{i}": random_prompt(rng.randrange(10, 60), sched.runner.vocab_size, seed=i) for i in range(8)}
    for rid, prompt in prompts.items():
        submit(sched, rid, prompt, n=60)
    aborted = set(rng.sample(sorted(prompts), 3))
    results: dict[str, dict] = {}
    step = 0
    while not sched.is_idle():
        sched.step()
        collect(sched, results)
        step += 1
        for rid in [r for r in aborted if step == 3 + 5 * sorted(aborted).index(r)]:
            sched.abort(rid)
        report = sched.check_memory()  # (completes the step in flight: its outputs wait in the outbox)
        assert report.ok, report.message
    collect(sched, results)
    assert sched.stats["num_retractions"] > 0
    for rid, prompt in prompts.items():
        if rid not in aborted:
            assert results[rid]["ids"] == expected(references, name, prompt, 60), rid
    assert_both_pools_clean(sched)
    info = sched.server_info()
    assert info["swa_hybrid_memory"] and info["swa_max_total_tokens"] == sched.allocator.swa_size
    assert info["swa_available_tokens"] + info["swa_evictable_tokens"] == info["swa_max_total_tokens"]


@pytest.mark.parametrize("radix", [False, True], ids=["chunk-cache", "radix"])
def test_capacity_bench_fits_more_requests_than_a_full_attention_cache(radix: bool) -> None:
    """bench/swa_capacity.py on a small shape: the same KV bytes hold at least 1.6x the requests."""
    from bench.swa_capacity import BENCH_SPEC, max_requests

    args = argparse.Namespace(context=512, decode=64, window=32, chunk=64, radix=radix)
    layers = BENCH_SPEC.num_layers
    full_size, swa_size = swa_pool_sizes(4 * 512, 0.125, layers - layers // 2, layers // 2)
    assert max_requests(full_size, swa_size, args) >= 1.6 * 4
    one_pool = swa_pool_sizes(4 * 512, 1.0, layers - layers // 2, layers // 2)  # SWA as big as the full pool
    assert max_requests(*one_pool, args) == 4  # no saving without a smaller SWA pool


def test_paged_pool_keeps_one_pool_and_still_applies_the_window(tiny_checkpoints, references) -> None:
    """Page size 16: no SWA pool (the windowed layers keep every token), same tokens."""
    name = "mistral_swa"
    runner = ModelRunner(
        tiny_checkpoints.path(name),
        device="cpu",
        dtype="float32",
        attention_backend="torch_native",
        max_total_tokens=1024,
        page_size=16,
        load_progress=False,
    )
    sched = Scheduler(
        ServerArgs(max_total_tokens=1024, page_size=16, chunked_prefill_size=32, disable_overlap_schedule=True),
        model_runner=runner,
    )
    assert not hasattr(sched.allocator, "swa")
    prompts = _prompts(runner.vocab_size)[1:]
    for i, prompt in enumerate(prompts):
        submit(sched, str(i), prompt)
    results = run_until_idle(sched)
    for i, prompt in enumerate(prompts):
        assert results[str(i)]["ids"] == expected(references, name, prompt)
    report = sched.check_memory()
    assert report.ok and report.swa is None, report.message
