"""Req: one request's state inside the scheduler, from arrival to finish.

Memory ownership while a request is alive lives in ``cache_handle``
(:class:`memory.req_state.CacheHandle`), which only the tree cache writes:
- ``req_pool_idx``: its row in ReqToTokenPool (taken by the tree cache's ``attach_rows``
  at its first prefill, freed by ``cache_finished_req`` / ``release_req``).
- ``prefix_indices``: KV slots it shares with the prefix cache, protected by the
  lock on ``last_node``; every slot in its row past the prefix is its own.
The tree cache reads ``origin_input_ids``, ``output_ids``, ``fill_ids`` and ``extra_key``;
the scheduler's modules read the handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memory.req_state import CacheHandle
from runtime.config.args import ServerArgs
from runtime.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from runtime.text.grammar import RequestGrammar


@dataclass(eq=False)  # a request is itself: identity equality and hashing
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # Prompt logprobs from this prompt position on; -1: none (scheduler_proc.input_logprobs).
    logprob_start_len: int = -1
    # SGLang's token_ids_logprob: ids whose logprob each output (and asked prompt) position reports.
    token_ids_logprob: list[int] | None = None
    extra_key: str | None = None
    # Larger is admitted first and may preempt smaller ones (scheduler_proc.priority); always 0
    # without --enable-priority-scheduling.
    priority: int = 0
    # The LoRA adapter it runs on, by load id (scheduler_proc.lora_slots); None: the base model. Its
    # prefix namespace (extra_key) is the adapter's.
    lora_uid: str | None = None

    output_ids: list[int] = field(default_factory=list)
    # The matcher of a constrained request (json_schema / regex / ebnf), set when its grammar
    # is compiled (scheduler_proc.grammar_queue); it has accepted every token of output_ids.
    grammar: "RequestGrammar | None" = None
    # Its output has tokens a jump-forward appended (its re-prefills join the decode batch).
    jumped: bool = False
    # Tokens a launched forward has sampled for this request that have not reached the host
    # yet (overlap scheduling: at most one). They count towards its length, not output_ids.
    num_inflight: int = 0
    # Tokens whose KV this request's row holds or will hold after the current prefill.
    # Written only by ``begin_extend`` (the batch builder carrying out a prefill plan).
    fill_ids: list[int] = field(default_factory=list)
    # Row, matched/held prefix, lock node, host-tier and SWA bookkeeping: the tree cache's to write.
    cache_handle: CacheHandle = field(default_factory=CacheHandle)
    # Tokens of fill_ids computed in the current prefill (after the prefix).
    extend_input_len: int = 0
    # True while a chunked prefill has more chunks to run.
    is_chunked: bool = False
    cached_tokens: int = 0
    # Tokens whose KV is in the request's row now; what cache_finished_req may cache.
    kv_committed_len: int = 0
    # Prefix length found in the cache when the request was first admitted (before chunking).
    first_prefix_len: int = 0
    admitted: bool = False
    is_retracted: bool = False
    # Its KV is (to be) rotated with a LongRoPE model's long factors, all of it; its prefix namespace
    # (extra_key) says so too. Written only by scheduler_proc.long_rope.
    long_rope: bool = False
    # Speculative decoding's n-gram index of this request's tokens (scheduler_proc.spec.ngram writes it).
    spec_index: Any = None
    # An embedding request (prefilled, never decoded: scheduler_proc.embedding): the token type of each
    # prompt token (None: all 0), the running sum of its forwards' pooled parts, and the finished
    # vector its one output carries.
    embed: bool = False
    token_type_ids: list[int] | None = None
    pooled: Any = None
    embedding: list[float] | None = None

    finish_reason: dict[str, Any] | None = None
    to_abort: str | None = None  # abort message, applied at the next safe point
    sent_offset: int = 0  # output ids already sent to the detokenizer
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[list[float]]] = field(default_factory=list)
    # token_ids_logprob per output id: [[logprob, token_id], ...] in the order of the request's ids.
    output_token_ids_logprobs: list[list[list[float]]] = field(default_factory=list)
    # Prompt logprobs collected so far, [logprob or None, token id] per prompt token from
    # logprob_start_len on (and the k best per token), written only by scheduler_proc.input_logprobs.
    input_token_logprobs: list[list[Any]] = field(default_factory=list)
    input_top_logprobs: list[list[list[float]] | None] = field(default_factory=list)
    input_token_ids_logprobs: list[list[list[float]] | None] = field(default_factory=list)  # (token_ids_logprob)
    # Prompt rows the prefill in flight computes for it (set when its batch is built).
    input_logprobs_inflight: int = 0
    input_logprobs_sent: bool = False  # they went out in its first ReqOutput

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def seqlen(self) -> int:
        """Tokens of the request so far (prompt + generated)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def scheduled_len(self) -> int:
        """Tokens of the request once the forwards launched so far have finished."""
        return len(self.origin_input_ids) + len(self.output_ids) + self.num_inflight

    def known_ids(self) -> list[int]:
        """Prompt and generated tokens on the host: what a (re-)prefill must give KV."""
        return self.origin_input_ids + self.output_ids

    def begin_extend(self, prefix_len: int, extend_len: int) -> None:
        """A prefill of ``known_ids()[prefix_len : prefix_len + extend_len]`` is being built."""
        self.fill_ids = self.known_ids()[: prefix_len + extend_len]
        self.extend_input_len = extend_len
        self.is_chunked = prefix_len + extend_len < self.seqlen

    def remaining_new_tokens(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids) - self.num_inflight, 0)

    def finishes_by_length(self, context_len: int) -> bool:
        """Sure to finish once its in-flight tokens land, whatever they are (StopChecker's
        length rules: nothing but an abort ends it before ``min_new_tokens``)."""
        done = len(self.output_ids) + self.num_inflight
        if done < self.sampling_params.min_new_tokens:
            return False
        return done >= self.sampling_params.max_new_tokens or self.scheduled_len >= context_len


# How many output tokens a stop regex is searched in: a pattern has no longest match to size the tail by
# (as a stop string has), so a bounded one keeps the per-token cost fixed; a match longer than this tail
# is not seen.
STOP_REGEX_TAIL_TOKENS = 64


class StopChecker:
    """Decides when a request is done after a token was appended.

    Stop strings and stop regexes need text, so the checker decodes only the tail of the output
    that could contain a newly completed match.
    """

    def __init__(self, eos_token_ids: set[int], context_len: int, tokenizer: Any = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.context_len = context_len
        self._tokenizer = tokenizer

    def load_tokenizer(self, server_args: ServerArgs) -> Any:
        """Stop strings (and grammars) need text: the server's tokenizer, loaded the first time one
        is asked for."""
        if self._tokenizer is None:
            from runtime.text.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(server_args.resolved_tokenizer_path())
        return self._tokenizer

    def check(self, req: Req) -> None:
        if req.finish_reason is not None:
            return
        params = req.sampling_params
        if req.to_abort is not None:
            req.finish_reason = {"type": "abort", "message": req.to_abort}
            return
        if not req.output_ids:
            return
        if req.grammar is not None and req.grammar.terminated:  # complete, and a stop token taken
            req.finish_reason = {"type": "stop", "matched": req.output_ids[-1]}
            return
        if len(req.output_ids) < params.min_new_tokens:
            return  # nothing but an abort ends a request before min_new_tokens
        last = req.output_ids[-1]
        if params.stop_token_ids and last in params.stop_token_ids:
            req.finish_reason = {"type": "stop", "matched": last}
            return
        if not params.ignore_eos and last in self.eos_token_ids:
            req.finish_reason = {"type": "stop", "matched": last}
            return
        stops = params.stop_strs
        if stops and self._tokenizer is not None:
            longest = max(len(s) for s in stops)
            # A character can take up to 4 byte-level tokens; look back far enough.
            tail = self._tokenizer.decode(req.output_ids[-(4 * longest + 4) :], skip_special_tokens=False)
            for stop in stops:
                if stop in tail:
                    req.finish_reason = {"type": "stop", "matched": stop}
                    return
        if params.stop_patterns and self._tokenizer is not None:
            tail = self._tokenizer.decode(req.output_ids[-STOP_REGEX_TAIL_TOKENS:], skip_special_tokens=False)
            for pattern in params.stop_patterns:
                found = pattern.search(tail)
                if found is not None:
                    req.finish_reason = {"type": "stop", "matched": found.group(0)}
                    return
        if len(req.output_ids) >= params.max_new_tokens:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
            return
        if req.seqlen >= self.context_len:
            req.finish_reason = {"type": "length", "length": len(req.output_ids)}
