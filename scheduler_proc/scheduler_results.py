"""The scheduler's results: the step in flight, and completing it (its tokens, its finished requests).

Why a module of its own: under overlap a step is launched before the previous one's results are
read, so the step in flight is state of its own (``StepResults.inflight``) that the step loop, the
launches (which must complete it before a retraction) and the control side (which reads the exact
host state) all consult. Completing it must get the in-flight counts right: a request that finished
at step N after being placed in step N+1 drops that extra token and is released once, when its last
step in flight completes. ``OutputProcessor`` decides what a token means (stop checks, streaming,
the outbox); ``RequestRelease`` gives memory back; this class carries a step's tokens out on the
queues and the prefix cache.
"""

from __future__ import annotations

from typing import Iterable

from memory.prefix_cache import BasePrefixCache
from memory.req_to_token_pool import ReqToTokenPool
from runtime.checkpoints.pooling import PoolingSpec
from scheduler_proc import embedding, input_logprobs, swa_memory
from scheduler_proc.grammar_queue import GrammarQueue
from scheduler_proc.jump_forward import jump_forward
from scheduler_proc.memory_setup import Allocator
from scheduler_proc.model_worker import LaunchedStep, StepResult
from scheduler_proc.output import OutputProcessor
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import Req
from scheduler_proc.scheduler_release import RequestRelease
from scheduler_proc.spec.verify import SpecDecoder


class StepResults:
    """Holds the step in flight and processes its tokens when it completes (see the module docstring)."""

    def __init__(
        self,
        queues: RequestQueues,
        tree_cache: BasePrefixCache,
        allocator: Allocator,
        req_to_token_pool: ReqToTokenPool,
        output: OutputProcessor,
        spec: SpecDecoder | None,
        grammars: GrammarQueue,
        jump_forward: bool,
        context_len: int,
        release: RequestRelease,
        pooling: PoolingSpec | None = None,
    ) -> None:
        """``pooling``: an embedding server's rule (scheduler_proc.embedding); None: a generation server."""
        self.pooling = pooling
        self.queues = queues
        self.tree_cache = tree_cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.output = output
        self.spec = spec
        self.grammars = grammars
        self.jump_forward = jump_forward  # (after a step: append the text a grammar forces)
        self.context_len = context_len
        self.release = release
        # The step launched and not yet processed (the step loop sets it; None: the host state is exact).
        self.inflight: LaunchedStep | None = None

    def drain(self) -> None:
        """Process the step in flight, if any: afterwards the host state is exact."""
        if self.inflight is not None:
            self.complete()

    def complete(self) -> None:
        """Wait for the step in flight and process its tokens."""
        step, self.inflight = self.inflight, None
        assert step is not None
        result = step.pending.wait()
        input_logprobs.take([item.req for item in step.extend], result)  # before any first output goes out
        if self.pooling is not None:  # an embedding server: the prefills' pooled parts
            embedding.take_parts(step.extend, result, self.pooling)
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
                    self.release.finish,
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
                    self.release.finish(req, req.finish_reason)
                else:  # its row goes back as in a retraction; the next prefill computes the forced text
                    self.release.retract(req)

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
                    self.release.release(req)
                continue
            output.append_token(req, result, row)
            if req.finish_reason is not None:
                finished.add(req)
                self.release.finish(req, req.finish_reason)
            elif prefilled:
                self.tree_cache.cache_unfinished_req(req)
