"""Room for the next decode step: which requests decode, and which give way when KV runs short.

``new_token_ratio`` is the fraction of max_new_tokens a running request is expected to
still use (admission reserves KV by it): it starts optimistic, jumps up on retraction
and decays back while decoding succeeds.

This module only decides. The scheduler's ``BatchLauncher`` (``scheduler_launch``) checks
the room through the batch builder (which evicts cache to make it) and carries the decisions
out itself, in this order: complete the step in flight, requeue the half-prefilled prompt,
then retract the requests of ``retraction_order`` one at a time until the step fits. A
retracted or requeued request goes back to the front of the queue; its computed KV becomes
evictable cache (``cache_finished_req``), so it resumes from whatever of it is still cached.
"""

from __future__ import annotations

import logging
from typing import Sequence

from scheduler_proc.req import Req

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class DecodeMemory:
    """Decode-time memory decisions of one scheduler; owns ``new_token_ratio`` and nothing else."""

    def __init__(self, context_len: int) -> None:
        self.context_len = context_len
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def decoded(self) -> None:
        """A decode step ran: expect a little less of every request's remaining budget."""
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def decode_candidates(self, running: Sequence[Req]) -> list[Req]:
        """Running requests that need another step (not those its step in flight surely ends)."""
        ctx = self.context_len
        return [r for r in running if not (r.num_inflight and r.finishes_by_length(ctx))]

    @staticmethod
    def retraction_order(running: Sequence[Req]) -> list[Req]:
        """Who gives way first when a decode step does not fit: the lowest priority (all 0 without
        --enable-priority-scheduling), then the least progressed requests (fewest generated tokens;
        the longest prompt first among equals, ties in running order)."""
        return sorted(running, key=lambda r: (r.priority, len(r.output_ids), -len(r.origin_input_ids)))

    def retracted(self, count: int) -> None:
        """``count`` requests were retracted in one round: expect more of the remaining budgets."""
        self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1 * count + 0.1)
        logger.info("retracted %d requests; new_token_ratio=%.2f", count, self.new_token_ratio)
