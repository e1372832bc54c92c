"""Step results to client-visible outputs: append tokens, decide finishes, stream, count, log.

The OutputProcessor owns the scheduler's outbox (messages for the detokenizer, flushed
after each step) and its counters. It never frees memory: when it marks a request
finished, the scheduler releases the request's KV through the tree cache.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime.protocol.messages import BatchTokenIDOut, ReqOutput, SchedErrorOut
from runtime.protocol.spec_stats import spec_summary
from scheduler_proc import input_logprobs
from scheduler_proc.embedding import EMBED_FINISH
from scheduler_proc.model_worker import StepResult
from scheduler_proc.req import Req, StopChecker

logger = logging.getLogger(__name__)


def new_stats() -> dict[str, int]:
    return {
        "num_retractions": 0,
        "num_retracted_reqs": 0,
        "num_priority_preemptions": 0,
        "num_prefill_batches": 0,
        "num_decode_batches": 0,
        "num_mixed_batches": 0,
        "num_finished": 0,
        "num_aborted": 0,
        "prompt_tokens": 0,
        "cached_prompt_tokens": 0,
        "num_received": 0,
        "jump_forward_tokens": 0,
        "num_refused_overloaded": 0,
        "num_timed_out": 0,
        # requests recomputed because their decoding outgrew a LongRoPE switch (scheduler_proc.long_rope)
        "num_rope_recomputations": 0,
    }


class OutputProcessor:
    def __init__(self, stop_checker: StopChecker, stream_interval: int, decode_log_interval: int) -> None:
        self.stop_checker = stop_checker
        self.stream_interval = stream_interval
        self.decode_log_interval = decode_log_interval
        self.outbox: list[Any] = []
        self.stats = new_stats()
        self._decode_tokens_since_log = 0
        self._last_decode_log = time.monotonic()
        self._spec_tokens_at_log = 0  # speculative decoding's emitted-token counter at the last log line

    # ------------------------------------------------------------------ tokens

    def append_token(self, req: Req, result: StepResult, row: int) -> None:
        """Give ``req`` the token of batch row ``row`` (and its logprobs), then check for a stop."""
        if not req.output_ids and not req.is_retracted:
            req.cached_tokens = req.first_prefix_len
        if len(req.output_ids) >= req.sampling_params.max_new_tokens:
            # max_new_tokens 0: the prefill ran (for its prompt logprobs, or its embedding); its sample is dropped.
            req.finish_reason = (
                dict(EMBED_FINISH) if req.embedding is not None else {"type": "length", "length": len(req.output_ids)}
            )
            return
        token = result.token_ids[row]
        req.output_ids.append(token)
        if req.grammar is not None and not req.grammar.accept(token):
            # Cannot happen with the step's mask applied; a request must never go on unconstrained.
            req.finish_reason = {"type": "abort", "message": f"token {token} does not match the request's grammar"}
        if req.return_logprob and result.logprobs is not None:
            req.output_logprobs.append(result.logprobs[row])
            if req.top_logprobs_num and result.top_logprobs is not None:
                values, ids = result.top_logprobs
                k = req.top_logprobs_num
                req.output_top_logprobs.append([[v, t] for v, t in zip(values[row][:k], ids[row][:k])])
        if req.token_ids_logprob and result.token_ids_logprobs is not None:  # (with or without return_logprob)
            named = result.token_ids_logprobs[row]
            req.output_token_ids_logprobs.append([[v, t] for v, t in zip(named, req.token_ids_logprob)])
        self.stop_checker.check(req)
        if req.finish_reason is None and req.stream:
            self.maybe_stream(req)

    def append_forced(self, req: Req, tokens: list[int]) -> None:
        """Give ``req`` tokens its grammar forces (jump-forward, no logprobs), checking for a stop after each."""
        for token in tokens:
            req.output_ids.append(token)
            self.stop_checker.check(req)
            if req.finish_reason is not None:
                return
        self.maybe_stream(req)

    def finish(self, req: Req, reason: dict[str, Any] | None, error_code: str | None = None) -> None:
        """Mark ``req`` finished and tell the client (its last chunk, or the error)."""
        req.finish_reason = reason
        self.stats["num_finished"] += 1
        if error_code is not None:
            self.error(req.rid, error_code, str((reason or {}).get("message")))
        else:
            self.emit(req)

    def error(self, rid: str, code: str, message: str) -> None:
        self.outbox.append(SchedErrorOut(rid, code, message))

    def maybe_stream(self, req: Req) -> None:
        if not req.stream:
            return
        unsent = len(req.output_ids) - req.sent_offset
        if req.sent_offset == 0 or unsent >= self.stream_interval:
            self.emit(req)

    def emit(self, req: Req) -> None:
        start = req.sent_offset
        params = req.sampling_params
        out = ReqOutput(
            rid=req.rid,
            new_output_ids=req.output_ids[start:],
            finished=req.finished,
            finish_reason=req.finish_reason,
            prompt_tokens=len(req.origin_input_ids),
            completion_tokens=len(req.output_ids),
            cached_tokens=req.cached_tokens,
            output_logprobs=req.output_logprobs[start:] if req.return_logprob else None,
            output_top_logprobs=req.output_top_logprobs[start:] if req.top_logprobs_num else None,
            output_token_ids_logprobs=req.output_token_ids_logprobs[start:] if req.token_ids_logprob else None,
            skip_special_tokens=params.skip_special_tokens,
            stop_strs=(params.stop_strs or None) if start == 0 else None,  # the detokenizer keeps them
            no_stop_trim=params.no_stop_trim,
            embedding=req.embedding,
        )
        if not req.input_logprobs_sent and input_logprobs.wants(req):  # the first output carries them
            # (token_ids_logprob alone asks for its own prompt values, not these)
            out.input_token_logprobs = req.input_token_logprobs if req.return_logprob or req.top_logprobs_num else None
            out.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num else None
            out.input_token_ids_logprobs = req.input_token_ids_logprobs if req.token_ids_logprob else None
            req.input_logprobs_sent = True
        if start == 0 and req.grammar is not None:
            out.grammar_compile_seconds = req.grammar.compile_seconds
            out.grammar_cache_hit = req.grammar.cache_hit
        req.sent_offset = len(req.output_ids)
        if self.outbox and isinstance(self.outbox[-1], BatchTokenIDOut):
            self.outbox[-1].outputs.append(out)
        else:
            self.outbox.append(BatchTokenIDOut([out]))

    def outbox_append(self, msg: Any) -> None:
        """Queue ``msg`` for the detokenizer (the outbox list is replaced at each ``take_outbox``)."""
        self.outbox.append(msg)

    def take_outbox(self) -> list[Any]:
        out, self.outbox = self.outbox, []
        return out

    # ------------------------------------------------------------------ logs

    def log_prefill(
        self, new_seqs: int, new_tokens: int, cached_tokens: int, usage: float, running: int, queued: int
    ) -> None:
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
            "#running-req: %d, #queue-req: %d",
            new_seqs,
            new_tokens,
            cached_tokens,
            usage,
            running,
            queued,
        )

    def log_decode(self, batch_size: int, tokens: int, usage: float, queued: int) -> None:
        """One line every ``decode_log_interval`` decode steps, with the throughput since the last."""
        # (With speculation a request may emit several tokens a step: count what the steps emitted.)
        self._decode_tokens_since_log += batch_size if "spec_decode_tokens" not in self.stats else 0
        if self.decode_log_interval <= 0 or self.stats["num_decode_batches"] % self.decode_log_interval:
            return
        now = time.monotonic()
        emitted = self.stats.get("spec_decode_tokens", 0)
        tokens_since = self._decode_tokens_since_log + emitted - self._spec_tokens_at_log
        throughput = tokens_since / max(now - self._last_decode_log, 1e-9)
        self._decode_tokens_since_log, self._last_decode_log, self._spec_tokens_at_log = 0, now, emitted
        spec = spec_summary(self.stats)
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): "
            "%.2f, #queue-req: %d%s",
            batch_size,
            tokens,
            usage,
            throughput,
            queued,
            f", accept len: {spec['spec_accept_length']:.2f}, accept rate: {spec['spec_accept_rate']:.2f}"
            if spec
            else "",
        )
