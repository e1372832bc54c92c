"""The scheduler's results: complete a step in flight, take its tokens, finish and release requests.

Why a module of its own: this is the one path by which a request's memory goes back (a
finished request's KV becomes cache through ``cache_finished_req``, an unfinished prefill's
through ``cache_unfinished_req``), and under overlap it must get the in-flight counts right
(a request that finished at step N after being placed in step N+1 drops that extra token and
is released once, when its last step in flight completes). ``OutputProcessor`` decides what a
token means (stop checks, streaming, the outbox); this mixin carries it out on the queues and
the prefix cache.
"""

from __future__ import annotations

from typing import Any, Iterable

from scheduler_proc import input_logprobs, swa_memory
from scheduler_proc.jump_forward import jump_forward
from scheduler_proc.model_worker import StepResult
from scheduler_proc.req import Req
from scheduler_proc.scheduler_wiring import SchedulerWiring


class SchedulerResultsMixin(SchedulerWiring):
    """Processes a completed step's tokens and ends requests (see the module docstring)."""

    def _complete_inflight(self) -> None:
        """Wait for the step in flight and process its tokens."""
        step, self.inflight = self.inflight, None
        assert step is not None
        result = step.pending.wait()
        input_logprobs.take([item.req for item in step.extend], result)  # before any first output goes out
        finished: set[Req] = set()
        sampled: list[tuple[int, Req]] = []
        for row, item in enumerate(step.extend):
            item.req.kv_committed_len = len(item.req.fill_ids)
            if item.chunked:
                # More chunks to come: keep its KV as a cached prefix, don't sample.
                self.tree_cache.cache_unfinished_req(item.req)
            else:
                sampled.append((row, item.req))
        self._take_tokens(sampled, result, finished, prefilled=True)
        if step.drafts is not None and self.spec is not None:  # verify: accepted tokens; rejected slots freed
            finished.update(
                self.spec.take(
                    step.decode,
                    step.drafts,
                    result,
                    len(step.extend),
                    self.output,
                    self.req_to_token_pool.req_to_token,
                    self.allocator.free,
                    self.finish,
                )
            )
        else:
            for req in step.decode:
                req.kv_committed_len += 1
            self._take_tokens(enumerate(step.decode, start=len(step.extend)), result, finished, prefilled=False)
        swa_memory.after_step(self.tree_cache, [item.req for item in step.extend] + step.decode)  # left windows
        if finished:
            self.queues.drop_finished(finished)
        if self.jump_forward and self.grammars.stats.constrained_requests:  # (no scan until one arrives)
            for req in jump_forward(
                [r for r in self.queues.running if r.grammar is not None],
                self.grammars.tokenizer,
                self.context_len,
                self.output,
            ):
                if req.finish_reason is not None:
                    self.queues.remove_running(req)
                    self.finish(req, req.finish_reason)
                else:  # its row goes back as in a retraction; the next prefill computes the forced text
                    self._retract(req)

    def _take_tokens(
        self, rows: Iterable[tuple[int, Req]], result: StepResult, finished: set[Req], prefilled: bool
    ) -> None:
        output = self.output
        for row, req in rows:
            req.num_inflight -= 1
            if req.finish_reason is not None:
                # It finished at the step before, which this one had already included: the
                # token is dropped, its KV kept with the rest; release once nothing is in flight.
                if req.num_inflight == 0:
                    self._release(req)
                continue
            output.append_token(req, result, row)
            if req.finish_reason is not None:
                finished.add(req)
                self.finish(req, req.finish_reason)
            elif prefilled:
                self.tree_cache.cache_unfinished_req(req)

    def finish(self, req: Req, reason: dict[str, Any] | None, error_code: str | None = None) -> None:
        """Tell the client, then release the request's memory unless a step still uses it."""
        if req.to_abort is not None:  # here, or when its step in flight completed (overlap)
            self.stats["num_aborted"] += 1
        self.output.finish(req, reason, error_code)
        if self.spec is not None:
            self.spec.finished(req)
        if req.num_inflight == 0:
            self._release(req)

    def _release(self, req: Req) -> None:
        # Caches what has KV, frees the rest and the row, and drops the prefix lock.
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)

    def _release_unscheduled(self, req: Req) -> None:
        """A waiting request holds nothing: no lock, no row (retracted ones released theirs)."""
        self.tree_cache.drop_match(req)

    def take_outbox(self) -> list[Any]:
        """The outputs since the last call (tokens, finishes, control replies), for the process to send."""
        return self.output.take_outbox()
