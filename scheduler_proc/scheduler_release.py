"""How a request gives its memory back: it finishes, it is retracted, a batch that could not be
carried out requeues it, or it leaves the waiting queue unscheduled.

Why a module of its own: this is the one path by which a request's KV and row go back (a finished
or retracted request's KV becomes cache through ``cache_finished_req``; a waiting one holds at most
a prefix match), and every job of the scheduler ends requests: the results of a step, the launches
(out of memory, retraction, priority preemption, LongRoPE recomputation), aborts. Under overlap a
request finished while a later step still holds it is released when that step completes
(``StepResults``), never twice.
"""

from __future__ import annotations

from typing import Any

from memory.prefix_cache import BasePrefixCache
from scheduler_proc.long_rope import RopeSwitch
from scheduler_proc.output import OutputProcessor
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import Req
from scheduler_proc.spec.verify import SpecDecoder


class RequestRelease:
    """Ends requests and gives their memory back through the prefix cache (see the module docstring)."""

    def __init__(
        self,
        queues: RequestQueues,
        tree_cache: BasePrefixCache,
        output: OutputProcessor,
        spec: SpecDecoder | None,
        rope_switch: RopeSwitch,
    ) -> None:
        self.queues = queues
        self.tree_cache = tree_cache
        self.output = output
        self.spec = spec
        self.rope_switch = rope_switch

    def finish(self, req: Req, reason: dict[str, Any] | None, error_code: str | None = None) -> None:
        """Tell the client, then release the request's memory unless a step still uses it."""
        if req.to_abort is not None:  # here, or when its step in flight completed (overlap)
            self.output.stats["num_aborted"] += 1
        self.output.finish(req, reason, error_code)
        if self.spec is not None:
            self.spec.finished(req)
        if req.num_inflight == 0:
            self.release(req)

    def release(self, req: Req) -> None:
        """Cache what has KV, free the rest and the row, and drop the prefix lock."""
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)

    def release_unscheduled(self, req: Req) -> None:
        """A waiting request holds nothing: no lock, no row (retracted ones released theirs)."""
        self.tree_cache.drop_match(req)

    def retract(self, req: Req) -> None:
        """A running request (nothing of it in flight) gives its memory back and waits at the front:
        its KV becomes cache, and it resumes from whatever of it is still cached. It is settled on
        the model's RoPE switch again (``RopeSwitch.settle``, after its KV was cached under its old
        namespace): one past a LongRoPE switch re-prefills every token with the long factors."""
        self.queues.retract(req)
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_retracted = True
        self.rope_switch.settle(req)

    def requeue(self, req: Req) -> None:
        """Undo a scheduling decision that could not be carried out: ``req`` waits at the front again."""
        # The failed extend allocated nothing: its row (if any) holds what it held before.
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_chunked = False
        self.queues.requeue(req)
