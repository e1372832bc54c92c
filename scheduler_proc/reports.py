"""What a scheduler tells the outside about itself: server info, DP load reports and the
memory invariant.

Pure read-outs: the scheduler passes in its parts, or itself (it owns all of them), and gets a
message back.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

from memory.invariant import InvariantReport, check_memory_invariant
from memory.prefix_cache import BasePrefixCache
from runtime.checkpoints.pooling import PoolingSpec
from runtime.engine.kv_sizing import KVPoolSize
from runtime.protocol.messages import KVEvent, LoadReport
from runtime.protocol.spec_stats import spec_summary
from scheduler_proc import swa_memory
from scheduler_proc.decode_memory import DecodeMemory
from scheduler_proc.grammar_queue import GrammarQueue
from scheduler_proc.hicache import HostTier
from scheduler_proc.memory_setup import Allocator
from scheduler_proc.model_worker import ForwardRunner, ModelWorker
from scheduler_proc.queues import RequestQueues


class SchedulerParts(Protocol):
    """What ``server_info`` reads of a scheduler (``Scheduler`` fits; this module cannot import it)."""

    queues: RequestQueues
    tree_cache: BasePrefixCache
    allocator: Allocator
    host_tier: HostTier | None
    stats: dict[str, int]
    max_total_tokens: int
    context_len: int
    max_running_requests: int
    page_size: int
    grammars: GrammarQueue
    memory: DecodeMemory
    worker: ModelWorker
    runner: ForwardRunner

    def kv_usage(self) -> float: ...


def kv_usage(allocator: Allocator, tree_cache: BasePrefixCache, max_total_tokens: int) -> float:
    """The share of KV slots that are neither free nor evictable cache (what log lines and
    ``server_info`` call KV usage)."""
    free = allocator.available_size() + tree_cache.evictable_size()
    return 1.0 - free / max_total_tokens


def memory_invariant(
    queues: RequestQueues,
    allocator: Allocator,
    tree_cache: BasePrefixCache,
    req_to_token_pool: Any,
    max_total_tokens: int,
    host_tier: HostTier | None,
) -> InvariantReport:
    """The memory invariant now (the scheduler has completed its step in flight): every KV slot and
    row is free, cached, or held by a running request (and the host tier's, with one)."""
    if host_tier:
        host_tier.drain()
    holders = queues.holders()
    active_rows = {
        r.cache_handle.req_pool_idx: r.kv_committed_len for r in holders if r.cache_handle.req_pool_idx is not None
    }
    report = check_memory_invariant(
        allocator, tree_cache, req_to_token_pool, max_total_tokens, idle=not holders, active_rows=active_rows
    )
    return host_tier.check(report) if host_tier else report


def load_report(dp_rank: int, queues: RequestQueues, tree_cache: BasePrefixCache, stats: dict[str, int]) -> LoadReport:
    """Load and prefix-cache changes for the DP controller's routing (takes the cache's pending events)."""
    events = [KVEvent(e.kind, list(e.token_ids), e.start, e.extra_key, e.tier) for e in tree_cache.take_events()]
    return LoadReport(
        dp_rank, len(queues.running), len(queues.waiting), num_received=stats["num_received"], events=events
    )


def kv_pool_info(runner: Any, max_total_tokens: int, context_len: int, max_running_requests: int) -> dict[str, Any]:
    """``server_info``'s ``kv_pool``: the pool as the runner sized it (``ModelRunner.kv_pool``), with
    the allocator's capacity as its tokens; a runner that does not say (the stub) gives no bytes."""
    sized = getattr(runner, "kv_pool", None)
    return KVPoolSize(
        max_total_tokens,
        context_len,
        max_running_requests,
        getattr(sized, "bytes_per_token", None),
        getattr(sized, "ram_bytes", None),
        getattr(sized, "kv_dtype", None),
        getattr(sized, "kv_bytes_per_token", None),
    ).info()


def weight_info(runner: Any) -> dict[str, Any] | None:
    """``server_info``'s ``weights``: the runner's resident weight bytes, by format
    (``ModelRunner.weight_info``); None from a runner that does not say (the stub)."""
    info = getattr(runner, "weight_info", None)
    return info() if info is not None else None


def server_info(sched: SchedulerParts, invariant: InvariantReport) -> dict[str, Any]:
    """Memory, queues, counters and the memory invariant of ``sched`` (``invariant``: checked by the
    caller, with nothing in flight); ``kv_pool``: the pool's size in the figures of the start-up log
    line (``KVPoolSize.info``); ``weights``: ``weight_info``."""
    queues, tree_cache, allocator, host_tier, stats = (
        sched.queues,
        sched.tree_cache,
        sched.allocator,
        sched.host_tier,
        sched.stats,
    )
    max_total_tokens, context_len, grammar = sched.max_total_tokens, sched.context_len, sched.grammars
    kv_pool = kv_pool_info(sched.runner, max_total_tokens, context_len, sched.max_running_requests)
    weights = weight_info(sched.runner)
    looked_up = stats["prompt_tokens"]
    return {
        "max_total_tokens": max_total_tokens,
        "context_len": context_len,
        "page_size": sched.page_size,
        "kv_pool": kv_pool,
        "weights": weights,
        "available_tokens": allocator.available_size(),
        "evictable_tokens": tree_cache.evictable_size(),
        "protected_tokens": tree_cache.protected_size(),
        "kv_usage": sched.kv_usage(),
        "num_running": len(queues.running),
        "num_queued": len(queues.waiting),
        "num_chunked": int(queues.chunked is not None),
        "num_grammar_queued": len(grammar),
        "new_token_ratio": sched.memory.new_token_ratio,
        "overlap_schedule": sched.worker.overlap,
        "cache_hit_rate": stats["cached_prompt_tokens"] / looked_up if looked_up else 0.0,
        "memory_invariant": dataclasses.asdict(invariant),
        "hierarchical_cache": host_tier is not None,
        **swa_memory.swa_info(allocator, tree_cache),
        **(host_tier.info() if host_tier else {}),
        **dataclasses.asdict(grammar.stats),
        **stats,
        **spec_summary(stats),  # (speculative decoding only)
        **embedding_info(getattr(sched.runner, "pooling", None)),
    }


def embedding_info(pooling: PoolingSpec | None) -> dict[str, Any]:
    """An embedding server's pooling rule (``server_info``'s ``embedding``); nothing for a generation server."""
    if pooling is None:
        return {}
    return {"embedding": {**dataclasses.asdict(pooling), "rule": pooling.describe()}}
