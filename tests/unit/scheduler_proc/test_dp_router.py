"""The DP controller's routing decision (scheduler_proc.dp_controller.Router) without processes.

The end-to-end tests (test_parallel_e2e.py) show that a replica that cached a prefix
gets its repeats; these pin down the rules behind that: round-robin order, the
shortest queue by load reports plus what was dispatched since, the cache-aware
preference and its fallback when loads diverge, how KV events (stored / removed /
cleared) change a replica's block set, and how control replies are merged.
"""

from __future__ import annotations

from typing import Any

import pytest

from runtime.protocol.messages import KVEvent, LoadReport
from scheduler_proc.dp_controller import (
    BALANCE_ABS,
    BLOCK,
    Router,
    block_hashes,
    merge_control_replies,
)

PREFIX = list(range(100, 100 + 3 * BLOCK))  # three whole blocks


def report(
    dp_rank: int, running: int = 0, queued: int = 0, events: list[KVEvent] | None = None, received: int = 0
) -> LoadReport:
    return LoadReport(dp_rank, running, queued, num_received=received, events=events or [])


def stored(tokens: list[int], start: int = 0, extra_key: str | None = None) -> KVEvent:
    return KVEvent("stored", tokens, start, extra_key)


def removed(tokens: list[int], start: int) -> KVEvent:
    return KVEvent("removed", tokens, start)


# ---------------------------------------------------------------------- methods


def test_unknown_method_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown load balance method"):
        Router(2, "random")


def test_round_robin_cycles_through_replicas_whatever_the_load() -> None:
    router = Router(3, "round_robin")
    router.on_report(report(0, running=50))
    assert [router.choose([1, 2, 3]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert router.dispatch_counts == [3, 2, 2]


def test_shortest_queue_follows_reports_and_counts_dispatches_since() -> None:
    router = Router(3, "shortest_queue")
    router.on_report(report(0, running=2, queued=1))
    router.on_report(report(1, running=1))
    router.on_report(report(2, running=4))
    # Loads 3, 1, 4: replica 1 takes requests until it is as loaded as replica 0.
    assert [router.choose([7]) for _ in range(2)] == [1, 1]
    # Now 3, 3, 4: the tie goes to the replica with fewer dispatches so far.
    assert router.choose([7]) == 0
    # A fresh report replaces the estimate: replica 2 drained its queue.
    router.on_report(report(2))
    assert router.replicas[2].load == 0
    assert router.choose([7]) == 2
    assert router.dispatch_counts == [1, 2, 1]


def test_cache_aware_prefers_the_replica_holding_the_longest_prefix() -> None:
    router = Router(2, "cache_aware")
    router.on_report(report(1, events=[stored(PREFIX + [1, 2, 3])]))
    repeat = PREFIX + [9, 9, 9, 9]
    # Replica 1 holds the prefix, even though replica 0 has taken fewer requests.
    assert [router.choose(repeat) for _ in range(3)] == [1, 1, 1]
    # A longer match wins over a shorter one.
    router.on_report(report(0, events=[stored(PREFIX[: 2 * BLOCK])]))
    router.on_report(report(1, events=[removed(PREFIX + [1, 2, 3], start=BLOCK)]))
    assert router.replicas[1].matched_blocks(block_hashes(repeat)) == 1
    assert router.choose(repeat) == 0


def test_cache_aware_sends_unmatched_prompts_to_the_least_loaded_replica() -> None:
    router = Router(2, "cache_aware")
    router.on_report(report(0, events=[stored(PREFIX)]))
    # Shorter than a block: no match possible, balance by load and dispatch count.
    assert [router.choose([5, 6, 7]) for _ in range(4)] == [0, 1, 0, 1]
    router.on_report(report(0, running=3))
    router.on_report(report(1, running=1))
    # A different first block matches nothing, whatever follows it.
    assert router.choose([1] * BLOCK + PREFIX[BLOCK:]) == 1


def test_cache_aware_falls_back_when_loads_diverge() -> None:
    router = Router(2, "cache_aware")
    router.on_report(report(0, events=[stored(PREFIX)]))
    # Preferred replica busier, but within the bounds: the cache still wins.
    router.on_report(report(0, running=BALANCE_ABS))
    router.on_report(report(1))
    assert router.choose(PREFIX) == 0
    # Both bounds exceeded (absolute gap > BALANCE_ABS and > 1.5x): the lighter one.
    router.on_report(report(0, running=BALANCE_ABS + 2))
    router.on_report(report(1, running=1))
    assert router.choose(PREFIX) == 1
    # A large absolute gap alone is not enough when the ratio is small.
    router.on_report(report(0, running=40))
    router.on_report(report(1, running=30))
    assert router.choose(PREFIX) == 0


# ---------------------------------------------------------------------- KV events


def test_stored_events_add_only_whole_blocks_after_the_cached_prefix() -> None:
    router = Router(1, "cache_aware")
    state = router.replicas[0]
    tokens = PREFIX[: 2 * BLOCK + 5]  # two whole blocks and a partial one
    router.on_report(report(0, events=[stored(tokens[:20])]))
    assert state.cached_blocks == set(block_hashes(tokens)[:1])
    router.on_report(report(0, events=[stored(tokens, start=20)]))
    assert state.cached_blocks == set(block_hashes(tokens))
    assert len(state.cached_blocks) == 2


def test_removed_events_drop_every_block_that_lost_a_token() -> None:
    router = Router(1, "cache_aware")
    state = router.replicas[0]
    router.on_report(report(0, events=[stored(PREFIX)]))
    # Evicting tokens [BLOCK + 4:] leaves block 1 incomplete: only block 0 still matches.
    router.on_report(report(0, events=[removed(PREFIX, start=BLOCK + 4)]))
    assert state.matched_blocks(block_hashes(PREFIX)) == 1
    router.on_report(report(0, events=[removed(PREFIX[: BLOCK + 4], start=0)]))
    assert state.cached_blocks == set()


def test_branches_are_tracked_separately_and_cleared_together() -> None:
    router = Router(1, "cache_aware")
    state = router.replicas[0]
    branch_a = PREFIX[:BLOCK] + [1] * BLOCK
    branch_b = PREFIX[:BLOCK] + [2] * BLOCK
    router.on_report(report(0, events=[stored(branch_a), stored(branch_b, start=BLOCK)]))
    assert len(state.cached_blocks) == 3  # the shared first block, one block per branch
    router.on_report(report(0, events=[removed(branch_a, start=BLOCK)]))
    assert state.matched_blocks(block_hashes(branch_a)) == 1
    assert state.matched_blocks(block_hashes(branch_b)) == 2
    router.on_report(report(0, events=[KVEvent("cleared", [], 0)]))
    assert state.cached_blocks == set()


def test_blocks_in_the_host_tier_still_match() -> None:
    """Hierarchical cache: a prefix the KV pool evicts to the host is still a hit there; it stops
    being one when the host evicts it too."""
    router = Router(1, "cache_aware")
    state = router.replicas[0]
    to_host = [KVEvent("stored", PREFIX, 0, None, "host"), KVEvent("removed", PREFIX, 0, None, "device")]
    router.on_report(report(0, events=[stored(PREFIX), *to_host]))
    assert state.cached_blocks == set() and state.matched_blocks(block_hashes(PREFIX)) == 3
    router.on_report(report(0, events=[KVEvent("removed", PREFIX, BLOCK, None, "host")]))
    assert state.matched_blocks(block_hashes(PREFIX)) == 1
    router.on_report(report(0, events=[KVEvent("cleared", [], 0)]))
    assert state.host_blocks == set()


def test_extra_keys_namespace_the_blocks() -> None:
    router = Router(2, "cache_aware")
    router.on_report(report(1, events=[stored(PREFIX, extra_key="lora-a")]))
    # The router hashes prompts without an extra key: a namespaced entry is no match.
    assert router.replicas[1].matched_blocks(block_hashes(PREFIX)) == 0
    assert router.replicas[1].matched_blocks(block_hashes(PREFIX, "lora-a")) == 3


def test_a_report_replaces_the_load_and_keeps_the_blocks() -> None:
    router = Router(2, "cache_aware")
    router.on_report(report(0, running=2, queued=3, events=[stored(PREFIX)]))
    assert router.replicas[0].load == 5
    router.choose(PREFIX)
    assert router.replicas[0].load == 6 and router.dispatch_counts == [1, 0]
    router.on_report(report(0, running=1, received=1))  # the replica has seen the dispatched request
    assert router.replicas[0].load == 1
    assert router.replicas[0].matched_blocks(block_hashes(PREFIX)) == 3


# ---------------------------------------------------------------------- control replies


def replica_info(**overrides: Any) -> dict[str, Any]:
    info: dict[str, Any] = {
        "num_running": 1,
        "num_queued": 2,
        "max_total_tokens": 100,
        "available_tokens": 60,
        "evictable_tokens": 30,
        "protected_tokens": 10,
        "num_retractions": 0,
        "num_finished": 4,
        "prompt_tokens": 40,
        "cached_prompt_tokens": 10,
        "context_len": 512,
        "memory_invariant": {"ok": True},
        "kv_pool": {
            "tokens": 100,
            "bytes": 1000,
            "share_of_ram": 0.25,
            "full_length_requests": 2,
            "context_len": 50,
            "max_running_requests": 8,
        },
    }
    info.update(overrides)
    return info


def test_server_info_replies_are_summed_and_kept_per_replica() -> None:
    a = replica_info()
    b = replica_info(num_running=0, num_finished=6, cached_prompt_tokens=30)
    merged = merge_control_replies("server_info", [a, b])
    assert merged["dp_size"] == 2 and merged["replicas"] == [a, b]
    assert merged["num_running"] == 1 and merged["num_queued"] == 4
    assert merged["max_total_tokens"] == 200 and merged["num_finished"] == 10
    assert merged["context_len"] == 512
    # Each replica has its own pool in the same host RAM: the pools add up, shares of RAM too.
    assert merged["kv_pool"] == {
        "tokens": 200,
        "bytes": 2000,
        "share_of_ram": 0.5,
        "full_length_requests": 4,
        "context_len": 50,
        "max_running_requests": 16,
        "kv_dtype": None,  # (the replicas' KVPoolSize said no format)
        "kv_bytes_per_token": None,
    }
    assert merged["cache_hit_rate"] == pytest.approx(40 / 80)
    assert merged["memory_invariant"]["ok"] is True
    broken = merge_control_replies("server_info", [a, replica_info(memory_invariant={"ok": False})])
    assert broken["memory_invariant"]["ok"] is False
    assert broken["memory_invariant"]["replicas"] == [{"ok": True}, {"ok": False}]


def test_a_sum_is_left_out_when_a_replica_lacks_the_field() -> None:
    merged = merge_control_replies("server_info", [replica_info(), {"memory_invariant": {"ok": True}}])
    assert "num_running" not in merged and "context_len" not in merged and "kv_pool" not in merged
    assert merged["cache_hit_rate"] == 0.0


def test_flush_cache_succeeds_only_when_every_replica_flushed() -> None:
    ok = merge_control_replies("flush_cache", [{"success": True}, {"success": True}])
    assert ok == {"success": True, "replicas": [{"success": True}, {"success": True}]}
    busy = {"success": False, "message": "requests are running; flush when idle"}
    assert merge_control_replies("flush_cache", [{"success": True}, busy])["success"] is False


def test_shortest_queue_counts_requests_in_flight_past_a_stale_report() -> None:
    """A report written before a dispatched request arrived must not hide that request."""
    router = Router(2, "shortest_queue")
    assert router.choose([1]) == 0 and router.choose([2]) == 1 and router.choose([3]) == 0
    # Replica 0 reports having received only its first request, replica 1 its one.
    router.on_report(LoadReport(dp_rank=0, num_running=1, num_queued=0, num_received=1))
    router.on_report(LoadReport(dp_rank=1, num_running=1, num_queued=0, num_received=1))
    assert router.replicas[0].load == 2 and router.replicas[1].load == 1
    assert router.choose([4]) == 1
