"""The hierarchical cache's scheduler side: when host KV is loaded back and when copies are issued.

The memory side (:mod:`memory.hiradix_cache`) knows where each prefix lives; this module
decides, per scheduler step:

- at the start of a step (``begin_step``), the copies queued since the last one (write-through
  backups of what the last step cached) are issued as one batch, after the batch before them
  completed (on cuda that one ran alongside the step that just finished);
- while admission plans a prefill (``load_prefix``, from the PrefillAdder), a request whose
  match goes on into the host tier gets device slots for that part, which then counts as its
  cached prefix (not as prefill work);
- once the plan is made (``issue_loads``), those loads are issued before the batch is built
  and launched: on cpu they are done at once; on cuda the scheduler's stream waits on the
  copy's event, so the forward (launched after, overlap or not) reads the loaded KV.

Which cache a scheduler gets is decided in :mod:`scheduler_proc.memory_setup`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memory.hiradix_cache import HiRadixCache
from memory.invariant import InvariantReport, check_host_invariant
from scheduler_proc.req import Req


class HostTier:
    """The scheduler's handle on a HiRadixCache: per-step copies, load-back, invariant and figures."""

    def __init__(self, cache: HiRadixCache) -> None:
        self.cache = cache

    def begin_step(self) -> None:
        self.cache.issue_transfers()

    def issue_loads(self) -> None:
        """Issue what admission loaded (without waiting for the copies in flight)."""
        self.cache.issue_transfers(complete=False)

    def drain(self) -> None:
        """Every copy done: nothing is locked by a copy afterwards (idle checks, flushes)."""
        self.cache.wait_transfers()

    def load_prefix(self, req: Req, room: int) -> int:
        """Bring ``req``'s host part (from its last match) to the device when ``room`` device tokens
        allow (the cache updates the request's handle). Returns the tokens loaded."""
        return self.cache.load_host_prefix(req, room)

    def check(self, device: InvariantReport) -> InvariantReport:
        """The device report with the host tier's problems (if any) added."""
        evictable, protected = self.cache.host_sizes()
        host = check_host_invariant(self.cache.host_allocator, self.cache.cached_host_slots(), evictable, protected)
        if host.ok:
            return device
        message = host.message if device.ok else f"{device.message}; host: {host.message}"
        return dataclasses.replace(device, ok=False, message=message)

    def info(self) -> dict[str, Any]:
        """server_info fields: host usage, host hits (tokens loaded back), backups and evictions per tier."""
        cache, stats = self.cache, self.cache.tier_stats
        evictable, protected = cache.host_sizes()
        bandwidth = stats.load_bytes / stats.load_seconds / 1e9 if stats.load_seconds > 0 else 0.0
        return {
            "hicache_write_policy": cache.write_policy,
            "host_total_tokens": cache.host_allocator.size,
            "host_available_tokens": cache.host_allocator.available_size(),
            "host_evictable_tokens": evictable,
            "host_protected_tokens": protected,
            "host_only_tokens": cache.host_only_size(),
            "host_hit_tokens": stats.loaded_tokens,
            "host_backed_up_tokens": stats.backed_up_tokens,
            "device_evicted_tokens": stats.device_evicted_tokens,
            "device_dropped_tokens": stats.device_dropped_tokens,
            "host_evicted_tokens": stats.host_evicted_tokens,
            "host_load_gb_per_s": bandwidth,
        }
