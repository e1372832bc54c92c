"""Speculative decoding's scheduling: which requests draft, how many tokens, and what a verify
step's samples make of them.

A verify step (``BatchBuilder.build_verify``) feeds each decoding request its last token plus its
drafts; the sampler samples every position as that request's next step would, given the drafts
before it. Acceptance is then one rule for greedy and sampled requests alike: emit the samples
while each equals the draft it follows, plus the first one that does not (or the bonus sample
after the last draft). For a deterministic draft ``d`` this *is* speculative sampling's rule:
the target's sample equals ``d`` with probability ``p(d)`` (accept), and given that it does not,
it is distributed as ``p`` with ``d`` removed and renormalised (the residual). So the output is
exactly the model's distribution, and a seeded request, whose position j is drawn with the seed
of step ``len(output) + j``, emits the very tokens it emits without speculation.

Memory: the step takes one KV slot per token it feeds (``build_verify``); afterwards the request
keeps the slots of the tokens it emitted (the input token and the accepted drafts: their KV is
what the forward wrote), and the rejected drafts' slots go back to the allocator at once, before
anything can cache the request's row. ``kv_committed_len`` then counts exactly the kept slots,
so the prefix cache only ever sees accepted tokens.

Which requests draft: those that would still emit more than one token (``max_new_tokens``,
the context) and are past ``min_new_tokens``' suppression. A constrained request's draft is cut to
what its grammar takes (``RequestGrammar.valid_prefix``), and each of its verify rows is masked by
the grammar's state after the drafts before it (``BatchBuilder._sampling``), so every sample obeys
the grammar as a decoded one does. Drafts never cause a retraction or an eviction beyond what the
decode step itself needs: with too few free slots, or past the step's token budget
(``--speculative-max-step-tokens``), they are cut.

Overlap scheduling: the proposer reads every token of a request, so a step is planned only
after the previous one was processed (``model_worker.can_plan_ahead`` says no while speculation
is on); speculation's steps always take the non-overlapped path.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from runtime.config.args import ServerArgs
from runtime.config.spec_args import resolve_speculative_algorithm, speculative_reason
from runtime.protocol.spec_stats import SPEC_STATS
from scheduler_proc.model_worker import StepResult
from scheduler_proc.output import OutputProcessor
from scheduler_proc.req import Req
from scheduler_proc.spec.ngram import NgramProposer
from scheduler_proc.spec.ngram_table import NgramTable

logger = logging.getLogger(__name__)


class SpecDecoder:
    """Proposes drafts for a decode step's requests and takes the verify step's tokens."""

    def __init__(
        self, args: ServerArgs, context_len: int, stats: dict[str, int], step_tokens: int | None = None
    ) -> None:
        self.proposer = NgramProposer(
            args.speculative_num_draft_tokens,
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
        )
        # n-grams of finished requests, for a request whose own text has no match (None: off)
        self.table = (
            NgramTable(
                args.speculative_ngram_capacity,
                args.speculative_num_draft_tokens,
                args.speculative_ngram_min_match_window_size,
                args.speculative_ngram_max_match_window_size,
            )
            if args.speculative_ngram_capacity > 0
            else None
        )
        self.context_len = context_len
        # the most tokens a verify step feeds the model (None: no limit beyond the free KV slots)
        self.step_tokens = (
            args.speculative_max_step_tokens if args.speculative_max_step_tokens is not None else step_tokens
        )
        self.stats = stats
        for key in SPEC_STATS:
            stats.setdefault(key, 0)

    @staticmethod
    def create(args: ServerArgs, context_len: int, stats: dict[str, int], device: torch.device) -> "SpecDecoder | None":
        """None without speculation; ``device``'s platform decides ``auto`` and gives
        --speculative-max-step-tokens' default."""
        if args.speculative_algorithm in (None, "none"):
            return None
        from runtime.engine.ops import get_ops

        platform = get_ops(device, torch.float32).platform(device)
        algorithm = resolve_speculative_algorithm(args, platform.default_speculative_algorithm)
        logger.info(
            "speculative decoding: %s (%s)",
            algorithm or "off",
            speculative_reason(args, platform.default_speculative_algorithm),
        )
        return SpecDecoder(args, context_len, stats, platform.spec_step_tokens) if algorithm is not None else None

    def draft_limit(self, req: Req, room: int | None) -> int:
        """Most drafts ``req`` may take this step: one fewer than the tokens it may still emit, and
        at most ``room`` (the model's positions' bound; None: none)."""
        params = req.sampling_params
        if req.num_inflight or len(req.output_ids) < params.min_new_tokens:
            return 0
        limit = min(req.remaining_new_tokens(), self.context_len - req.scheduled_len) - 1
        return limit if room is None else min(limit, room)

    def propose(
        self, reqs: Sequence[Req], free_slots: int, draft_room: Callable[[Req], int | None]
    ) -> list[list[int]] | None:
        """Each request's drafts, within ``free_slots`` and the step's token budget beyond its one
        token per request, shared evenly (a request that drafts less leaves the rest to those after
        it); None when no request has any (the step is then a plain decode). ``draft_room``: the
        most drafts the model's positions allow a request (``RopeSwitch.draft_room``; None: no bound)."""
        room = free_slots if self.step_tokens is None else min(free_slots, self.step_tokens)
        budget = room - len(reqs)
        drafts: list[list[int]] = []
        for i, req in enumerate(reqs):
            limit = min(self.draft_limit(req, draft_room(req)), budget // (len(reqs) - i)) if budget > 0 else 0
            draft: list[int] = []
            if limit > 0:
                tokens = req.known_ids()
                backing_off = req.spec_index is not None and req.spec_index.skip > 0
                draft, req.spec_index = self.proposer.propose(tokens, req.spec_index, limit)
                if not draft and self.table is not None and not backing_off:
                    draft = self.table.lookup(tokens, limit)
                if draft and req.grammar is not None:  # a constrained request drafts what its grammar takes
                    draft = draft[: req.grammar.valid_prefix(draft)]
            budget -= len(draft)
            drafts.append(draft)
        if not any(drafts):
            self.count_plain_decode(len(reqs))
            return None
        return drafts

    def take(
        self,
        reqs: Sequence[Req],
        drafts: Sequence[Sequence[int]],
        result: StepResult,
        first_row: int,
        output: OutputProcessor,
        req_to_token: torch.Tensor,
        free_slots: Callable[[torch.Tensor], None],
        finish: Callable[[Req, dict[str, Any] | None], None],
    ) -> list[Req]:
        """Give each request the tokens it accepted (stop rules apply per token), keep the KV of
        what it emitted, free its rejected drafts' slots, then ``finish`` (the scheduler's: tell the
        client, release the memory) the requests that finished now; returns them."""
        finished: list[Req] = []
        row = first_row
        stats = self.stats
        stats["spec_verify_batches"] += 1
        for req, draft in zip(reqs, drafts):
            req.num_inflight -= 1
            samples = result.token_ids[row : row + 1 + len(draft)]
            accepted = accepted_drafts(samples, draft)
            if req.spec_index is not None:
                req.spec_index.record(len(draft), accepted)
            # (A step is planned only once the previous one was processed: none ran past a finish.)
            assert req.finish_reason is None, "speculative steps never overlap"
            before = len(req.output_ids)
            for j in range(accepted + 1):
                if req.finish_reason is not None:
                    break
                output.append_token(req, result, row + j)
            emitted = len(req.output_ids) - before
            # Kept: the input token's slot (its KV is written whatever happens) and one per accepted
            # draft that was emitted; the rest of the step's slots go back now.
            start = req.kv_committed_len
            kept = max(emitted, 1)
            req.kv_committed_len = start + kept
            if len(draft) + 1 > kept:
                pool_row = req.cache_handle.req_pool_idx
                free_slots(req_to_token[pool_row, start + kept : start + 1 + len(draft)].to(torch.int64))
            stats["spec_decode_req_steps"] += 1
            stats["spec_decode_tokens"] += emitted
            stats["spec_draft_tokens"] += len(draft)
            stats["spec_accepted_drafts"] += accepted
            if req.finish_reason is not None:
                finished.append(req)
                finish(req, req.finish_reason)
            row += 1 + len(draft)
        return finished

    def finished(self, req: Req) -> None:
        """A request ended: its text joins the table of n-grams seen across requests (if kept)."""
        if self.table is not None and req.output_ids:
            self.table.add(req.known_ids())

    def count_plain_decode(self, num_reqs: int) -> None:
        """A decode step without drafts still counts toward the mean accepted length (1 token each)."""
        self.stats["spec_decode_req_steps"] += num_reqs
        self.stats["spec_decode_tokens"] += num_reqs


def accepted_drafts(samples: Sequence[int], draft: Sequence[int]) -> int:
    """How many drafts a request accepts: the samples that equal the draft each follows, up to the
    first that does not (``samples[j]`` was drawn after ``draft[:j]``; it emits one more sample)."""
    accepted = 0
    while accepted < len(draft) and samples[accepted] == draft[accepted]:
        accepted += 1
    return accepted
