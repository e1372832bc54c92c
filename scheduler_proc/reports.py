"""What a scheduler tells the outside about itself: server info and DP load reports."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from runtime.messages import KVEvent, LoadReport
from scheduler_proc import swa_memory

if TYPE_CHECKING:
    from scheduler_proc.scheduler import Scheduler


def load_report(sched: "Scheduler", dp_rank: int) -> LoadReport:
    """Load and prefix-cache changes for the DP controller's routing."""
    events = [KVEvent(e.kind, list(e.token_ids), e.start, e.extra_key, e.tier) for e in sched.tree_cache.take_events()]
    return LoadReport(dp_rank, len(sched.running), len(sched.waiting), sched.allocator.available_size(),
                      num_received=sched.stats["num_received"], events=events)


def server_info(sched: "Scheduler") -> dict[str, Any]:
    """Memory, queues, counters and the memory invariant (checked now, with nothing in flight)."""
    report = sched.check_memory()
    looked_up = sched.stats["prompt_tokens"]
    return {
        "max_total_tokens": sched.max_total_tokens,
        "context_len": sched.context_len,
        "page_size": sched.page_size,
        "available_tokens": sched.allocator.available_size(),
        "evictable_tokens": sched.tree_cache.evictable_size(),
        "protected_tokens": sched.tree_cache.protected_size(),
        "kv_usage": sched.kv_usage(),
        "num_running": len(sched.running),
        "num_queued": len(sched.waiting),
        "num_chunked": int(sched.chunked_req is not None),
        "new_token_ratio": sched.memory.new_token_ratio,
        "overlap_schedule": sched.worker.overlap,
        "cache_hit_rate": sched.stats["cached_prompt_tokens"] / looked_up if looked_up else 0.0,
        "memory_invariant": dataclasses.asdict(report),
        "hierarchical_cache": sched.host_tier is not None,
        **swa_memory.swa_info(sched.allocator, sched.tree_cache),
        **(sched.host_tier.info() if sched.host_tier else {}),
        **sched.stats,
    }
