"""The hierarchical cache inside the scheduler, over the KV-verifying stub model.

Multi-turn conversations whose history does not fit the KV pool: with the host tier, later
turns find their history on the host, it is loaded back before their extend, and it counts as
cached. The stub writes each token id into its KV slot and predicts from what it reads back
through req_to_token, so KV loaded into the wrong slot, or read before its copy, changes the
tokens; outputs must equal the reference in every configuration (overlap on and off, pages).
"""

from __future__ import annotations

import random

import pytest

from memory.hiradix_cache import HiRadixCache
from runtime.protocol.messages import TokenizedGenerateReq
from runtime.protocol.sampling_params import SamplingParams
from scheduler_proc.scheduler import Scheduler
from tests.support.stub_scheduler import VOCAB, assert_idle_invariant, collect, expected_output, stub_scheduler

SESSIONS, TURNS, SYSTEM, USER, NEW = 8, 3, 120, 16, 8


def conversations(seed: int = 0) -> list[list[list[int]]]:
    """Per session, the user messages of each turn (the first one starts with its system prompt)."""
    rng = random.Random(seed)
    return [
        [[rng.randrange(1, VOCAB) for _ in range((SYSTEM if t == 0 else 0) + USER)] for t in range(TURNS)]
        for _ in range(SESSIONS)
    ]


def run_conversations(sched: Scheduler, convs: list[list[list[int]]]) -> dict[str, dict]:
    """All sessions at once; a session's next turn is sent when its previous one finished."""
    results: dict[str, dict] = {}
    history: dict[int, list[int]] = {}
    turn = {s: 0 for s in range(len(convs))}

    def send(s: int) -> None:
        history[s] = history.get(s, []) + convs[s][turn[s]]
        sched.handle_message(
            TokenizedGenerateReq(
                rid=f"s{s}t{turn[s]}",
                input_ids=list(history[s]),
                sampling_params=SamplingParams(max_new_tokens=NEW, temperature=0.0),
            )
        )

    for s in range(len(convs)):
        send(s)
    for _ in range(100_000):
        sched.step()
        collect(sched, results)
        for s in range(len(convs)):
            rid = f"s{s}t{turn[s]}"
            if turn[s] < TURNS and results.get(rid, {}).get("finished"):
                assert results[rid]["ids"] == expected_output(history[s], NEW), rid
                history[s] = history[s] + results[rid]["ids"]
                turn[s] += 1
                if turn[s] < TURNS:
                    send(s)
        if sched.is_idle() and all(t == TURNS for t in turn.values()):
            return results
    raise AssertionError("scheduler did not finish the conversations")


def later_turns_cached(results: dict[str, dict]) -> int:
    return sum(r["cached"] for rid, r in results.items() if not rid.endswith("t0"))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size,policy", [(1, "write_through"), (4, "write_back")])
def test_history_comes_back_from_the_host_with_exact_kv(overlap: bool, page_size: int, policy: str) -> None:
    convs = conversations()
    tier = stub_scheduler(
        overlap,
        max_total_tokens=512,
        page_size=page_size,
        enable_hierarchical_cache=True,
        hicache_ratio=8.0,
        hicache_write_policy=policy,
    )
    assert isinstance(tier.tree_cache, HiRadixCache)
    with_tier = run_conversations(tier, convs)
    assert_idle_invariant(tier)  # both tiers: no leaked slot, nothing locked
    info = tier.server_info()
    assert info["memory_invariant"]["ok"] and info["protected_tokens"] == 0
    assert info["host_hit_tokens"] > 0 and info["device_evicted_tokens"] > 0
    # Host copies of what is also on the device are protected (they go when the node does).
    assert (
        info["host_available_tokens"] + info["host_evictable_tokens"] + info["host_protected_tokens"]
        == info["host_total_tokens"]
    )

    plain = stub_scheduler(overlap, max_total_tokens=512, page_size=page_size)
    without = run_conversations(plain, convs)
    assert_idle_invariant(plain)
    assert {k: v["ids"] for k, v in with_tier.items()} == {k: v["ids"] for k, v in without.items()}
    # The same run without the tier recomputes most of the history the tier loaded back.
    assert later_turns_cached(with_tier) >= later_turns_cached(without) + info["host_hit_tokens"] // 2
    assert later_turns_cached(with_tier) > 0.8 * sum(len(c[0]) + NEW for c in convs) * (TURNS - 1) / 2


def test_host_hits_count_as_cached_not_as_prefill() -> None:
    sched = stub_scheduler(False, max_total_tokens=256, enable_hierarchical_cache=True)
    rng = random.Random(1)
    first = [rng.randrange(1, VOCAB) for _ in range(150)]
    other = [rng.randrange(1, VOCAB) for _ in range(150)]
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    results: dict[str, dict] = {}
    for rid, prompt in (("a", first), ("b", other), ("c", first + [5, 6])):
        sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params))
        while not sched.is_idle():
            sched.step()
            collect(sched, results)
    # "b" pushed "a"'s prompt out of the 256-token pool; "c" found it on the host.
    assert results["c"]["cached"] == 150 and results["c"]["ids"] == expected_output(first + [5, 6], 4)
    assert sched.server_info()["host_hit_tokens"] == 150
    assert sched.stats["cached_prompt_tokens"] == 150
    assert_idle_invariant(sched)
    assert sched.control("flush_cache")["success"]
    info = sched.server_info()
    assert info["host_available_tokens"] == info["host_total_tokens"] and info["available_tokens"] == 256


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size,policy", [(1, "write_through"), (4, "write_back")])
def test_retraction_and_chunking_with_the_tier(overlap: bool, page_size: int, policy: str) -> None:
    """A pool too small for the running requests: retraction, chunked prefills and host loads at
    once. Write-through copies lock what was just cached; eviction must still find room."""
    rng = random.Random(7)
    shared = [[rng.randrange(1, VOCAB) for _ in range(60)] for _ in range(3)]
    prompts = [rng.choice(shared) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(5, 60))] for _ in range(30)]
    sched = stub_scheduler(
        overlap,
        max_total_tokens=512,
        page_size=page_size,
        chunked_prefill_size=48,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
    )
    for i, prompt in enumerate(prompts):
        sched.handle_message(
            TokenizedGenerateReq(
                rid=f"r{i}", input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=30, temperature=0.0)
            )
        )
    results: dict[str, dict] = {}
    while not sched.is_idle():
        sched.step()
        collect(sched, results)
    assert sched.stats["num_retractions"] > 0
    for i, prompt in enumerate(prompts):
        assert results[f"r{i}"]["ids"] == expected_output(prompt, 30)
    assert_idle_invariant(sched)
    assert sched.server_info()["host_hit_tokens"] > 0


def test_lpm_counts_host_hits_as_matched() -> None:
    from scheduler_proc.req import Req

    sched = stub_scheduler(False, max_total_tokens=256, enable_hierarchical_cache=True, schedule_policy="lpm")
    rng = random.Random(2)
    first, other = ([rng.randrange(1, VOCAB) for _ in range(150)] for _ in range(2))
    params = SamplingParams(max_new_tokens=2, temperature=0.0)
    for rid, prompt in (("a", first), ("b", other)):  # "b" pushes "a"'s prompt to the host
        sched.handle_message(TokenizedGenerateReq(rid=rid, input_ids=prompt, sampling_params=params))
        while not sched.is_idle():
            sched.step()
    fresh = Req(rid="fresh", origin_input_ids=other[:20] + [1, 2], sampling_params=params)
    again = Req(rid="again", origin_input_ids=first + [3], sampling_params=params)
    ordered = sched.admission.policy.order([fresh, again])
    assert again.cache_handle.host_hit_len == 150 and len(again.cache_handle.prefix_indices) == 0
    assert len(fresh.cache_handle.prefix_indices) == 20
    assert ordered == [again, fresh]
