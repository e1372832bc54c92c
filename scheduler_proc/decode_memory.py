"""Room for the next decode step: eviction, and retraction when eviction is not enough.

``new_token_ratio`` is the fraction of max_new_tokens a running request is expected to
still use (admission reserves KV by it): it starts optimistic, jumps up on retraction
and decays back while decoding succeeds. A retracted request goes back to the front of
the queue; its computed KV becomes evictable cache (``cache_finished_req``), so it
resumes from whatever of it is still cached.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler_proc.req import Req

if TYPE_CHECKING:
    from scheduler_proc.scheduler import Scheduler

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class DecodeMemory:
    """Decode-time memory decisions of one scheduler (whose queues it edits)."""

    def __init__(self, scheduler: "Scheduler") -> None:
        self.sched = scheduler
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def decoded(self) -> None:
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def decode_candidates(self) -> list[Req]:
        """Running requests that need another step (not those its step in flight surely ends)."""
        ctx = self.sched.context_len
        return [r for r in self.sched.running if not (r.num_inflight and r.finishes_by_length(ctx))]

    def reserve_decode(self) -> list[Req]:
        """The requests of the next decode step, with KV room for each; [] when none can run.

        Only the host state without a step in flight can be retracted from: when eviction
        is not enough, the step in flight is completed first (it may finish requests).
        """
        sched, builder = self.sched, self.sched.builder
        reqs = self.decode_candidates()
        if builder.ensure_available(builder.decode_tokens_needed(reqs)):
            return reqs
        if sched.inflight is not None:
            sched.drain()
            reqs = self.decode_candidates()
            if builder.ensure_available(builder.decode_tokens_needed(reqs)):
                return reqs
        if sched.chunked_req is not None:
            # A half-prefilled prompt gives way first: its chunks become evictable cache,
            # and it resumes from whatever of them is still cached.
            self.requeue(sched.chunked_req)
            if builder.ensure_available(builder.decode_tokens_needed(sched.running)):
                return list(sched.running)
        return list(sched.running) if self._retract() else []

    def _retract(self) -> bool:
        """Retract the least-progressed requests until one decode step fits; False if none can run."""
        sched, builder = self.sched, self.sched.builder
        # Fewest generated tokens first, longest prompt first among equals.
        order = sorted(sched.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted: list[Req] = []
        while order and not builder.ensure_available(builder.decode_tokens_needed(sched.running)):
            if len(sched.running) == 1:
                req = sched.running.pop()
                sched.finish(req, {"type": "abort", "message": "out of memory"}, error_code="out_of_memory")
                return False
            req = order.pop(0)
            sched.running.remove(req)
            sched.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
            req.is_retracted = True
            sched.waiting.insert(0, req)
            retracted.append(req)
        if retracted:
            sched.stats["num_retractions"] += 1
            sched.stats["num_retracted_reqs"] += len(retracted)
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1 * len(retracted) + 0.1)
            logger.info("retracted %d requests; new_token_ratio=%.2f", len(retracted), self.new_token_ratio)
        return bool(sched.running)

    def requeue(self, req: Req) -> None:
        """Undo a scheduling decision that could not be carried out."""
        sched = self.sched
        # The failed extend allocated nothing: its row (if any) holds what it held before.
        sched.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_chunked = False
        if req not in sched.waiting:
            sched.waiting.insert(0, req)
        if sched.chunked_req is req:
            sched.chunked_req = None
