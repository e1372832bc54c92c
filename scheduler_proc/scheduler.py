"""The scheduler: continuous batching over one ModelRunner, SGLang's request lifecycle.

Per step: take new messages, pick a batch (a prefill of waiting requests, or a
decode of the running ones), run it, then for every request: append the token,
check whether it finished, and hand its KV to the prefix cache
(``cache_unfinished_req`` keeps it running, ``cache_finished_req`` releases it).

Memory owners: the scheduler's ``allocator`` hands out KV slots, the model
runner owns the pools, ``tree_cache`` owns cached prefixes, and each running
request owns its row plus the slots past its locked prefix.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import time
import traceback
from collections import deque
from typing import Any

import msgspec
import torch

from memory import ChunkCache, PagedTokenToKVPoolAllocator, RadixCache, TokenToKVPoolAllocator
from memory.invariant import InvariantReport, check_memory_invariant
from runtime.forward_batch import ForwardMode
from runtime.messages import (
    BatchTokenIDOut,
    ReqOutput,
    SchedAbortReq,
    SchedControlOut,
    SchedControlReq,
    SchedErrorOut,
    SchedulerInput,
    TokenizedGenerateReq,
)
from scheduler_proc.batch_builder import BatchBuilder, OutOfMemory
from scheduler_proc.policy import SchedulePolicy
from scheduler_proc.prefill_adder import AddResult, PrefillAdder
from scheduler_proc.req import Req, StopChecker

logger = logging.getLogger(__name__)

# new_token_ratio: the fraction of max_new_tokens a running request is expected to
# still use; starts optimistic, jumps up on retraction, decays back on success.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
# Decode never starves: at most this many prefill batches in a row while requests are running.
MAX_CONSECUTIVE_PREFILLS = 2
# Requests sharing at least this many leading tokens with one already in the batch wait a round.
IN_BATCH_PREFIX_TOKENS = 32


class Scheduler:
    """One TP rank's scheduler. Usable in-process (tests call ``add_request``/``step``)."""

    def __init__(self, server_args: Any, tp_rank: int = 0, model_runner: Any = None, kv_events: bool = False) -> None:
        self.args = server_args
        self.tp_rank = tp_rank
        if model_runner is None:
            from runtime.model_runner import ModelRunner

            model_runner = ModelRunner(
                server_args.resolved_model_path(),
                device=server_args.device,
                dtype=server_args.dtype,
                attention_backend=server_args.attention_backend,
                max_total_tokens=server_args.max_total_tokens,
                mem_fraction_static=server_args.mem_fraction_static,
                page_size=server_args.page_size,
                max_running_requests=server_args.max_running_requests,
                context_length=server_args.context_length,
                tp_rank=tp_rank,
                tp_size=server_args.tp_size,
                random_seed=server_args.random_seed or 0,
            )
        self.runner = model_runner
        self.page_size = server_args.page_size
        self.context_len: int = model_runner.context_len
        self.max_running_requests: int = model_runner.max_running_requests
        device = model_runner.device
        if self.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(model_runner.max_total_tokens, device)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(model_runner.max_total_tokens, self.page_size, device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        # The allocator rounds the pool down to whole pages: that is the real capacity.
        self.max_total_tokens: int = self.allocator.size
        self.radix_enabled = not server_args.disable_radix_cache
        if self.radix_enabled:
            self.tree_cache: Any = RadixCache(
                self.req_to_token_pool, self.allocator, self.page_size,
                eviction_policy=server_args.radix_eviction_policy, enable_kv_events=kv_events,
            )
        else:
            self.tree_cache = ChunkCache(self.req_to_token_pool, self.allocator, self.page_size)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, self.radix_enabled,
                                     seed=server_args.random_seed or 0)
        self.builder = BatchBuilder(model_runner, self.allocator, self.tree_cache, self.page_size)
        self.stop_checker = StopChecker(set(model_runner.eos_token_ids), self.context_len, tokenizer=None)
        self.max_prefill_tokens: int = server_args.max_prefill_tokens
        chunk = server_args.chunked_prefill_size
        self.chunked_prefill_size: int | None = chunk if chunk and chunk > 0 else None
        self.stream_interval: int = server_args.stream_interval

        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.consecutive_prefills = 0
        self.outbox: list[Any] = []  # messages for the detokenizer, flushed after each step
        self.stats = {"num_retractions": 0, "num_retracted_reqs": 0, "num_prefill_batches": 0,
                      "num_decode_batches": 0, "num_mixed_batches": 0, "num_finished": 0, "num_aborted": 0,
                      "prompt_tokens": 0, "cached_prompt_tokens": 0, "num_received": 0}
        self._was_idle = True
        self.last_invariant: InvariantReport | None = None

    # ------------------------------------------------------------------ inputs

    def _tokenizer(self) -> Any:
        if self.stop_checker._tokenizer is None:
            from transformers import AutoTokenizer

            path = self.args.tokenizer_path or self.args.resolved_model_path()
            self.stop_checker._tokenizer = AutoTokenizer.from_pretrained(path)
        return self.stop_checker._tokenizer

    def handle_message(self, msg: SchedulerInput) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.stats["num_received"] += 1
            self.add_request(msg)
        elif isinstance(msg, SchedAbortReq):
            self.abort(msg.rid)
        elif isinstance(msg, SchedControlReq):
            self.outbox.append(SchedControlOut(msg.rid, msg.kind, self.control(msg.kind)))

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
        )
        error = self._reject_reason(req)
        if error is not None:
            self.outbox.append(SchedErrorOut(req.rid, error[0], error[1]))
            return
        if req.sampling_params.stop_strs:
            self._tokenizer()
        if req.sampling_params.max_new_tokens == 0:
            # Nothing to generate: answer at once, no memory touched.
            req.finish_reason = {"type": "length", "length": 0}
            self._emit(req)
            return
        self.waiting.append(req)

    def _reject_reason(self, req: Req) -> tuple[str, str] | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "invalid_request", "the prompt is empty"
        if n >= self.context_len:
            return "too_long", f"the prompt has {n} tokens; the context length is {self.context_len}"
        if n + 1 > self.max_total_tokens - self.page_size:
            return "too_long", f"the prompt has {n} tokens; the KV pool holds {self.max_total_tokens}"
        vocab = self.runner.vocab_size
        bad = next((t for t in req.origin_input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            return "invalid_request", f"token id {bad} is outside the vocabulary [0, {vocab})"
        return None

    def abort(self, rid: str) -> None:
        """Abort one request (or all when rid is ''): queued ones at once, others at the next step."""
        for req in list(self.waiting):
            if rid in ("", req.rid):
                self.waiting.remove(req)
                req.finish_reason = {"type": "abort", "message": "aborted by the client"}
                self.stats["num_aborted"] += 1
                self._release_unscheduled(req)
                self._emit(req)
        for req in self.running + ([self.chunked_req] if self.chunked_req else []):
            if rid in ("", req.rid):
                req.to_abort = "aborted by the client"

    # ------------------------------------------------------------------ one step

    def step(self) -> bool:
        """Run one batch if there is work. Returns True when a batch ran."""
        self._apply_aborts()
        ran = False
        batch_reqs = self._get_new_prefill()
        if batch_reqs:
            self._run_extend(batch_reqs)
            ran = True
        elif self.running:
            self._run_decode()
            ran = True
        if not ran and not self.waiting and self.chunked_req is None:
            if not self._was_idle:
                self.on_idle()
            self._was_idle = True
        else:
            self._was_idle = False
        return ran

    def on_idle(self) -> InvariantReport:
        report = self.check_memory()
        if not report.ok:
            logger.error("memory invariant violated when idle: %s", report.message)
        return report

    def check_memory(self) -> InvariantReport:
        holders = self.running + ([self.chunked_req] if self.chunked_req else [])
        active_rows = {r.req_pool_idx: r.kv_committed_len for r in holders if r.req_pool_idx is not None}
        self.last_invariant = check_memory_invariant(
            self.allocator, self.tree_cache, self.req_to_token_pool, self.max_total_tokens,
            idle=not holders, active_rows=active_rows,
        )
        return self.last_invariant

    def _apply_aborts(self) -> None:
        """Finish requests marked for abort through the normal release path."""
        for req in [r for r in self.running if r.to_abort]:
            self.running.remove(req)
            self._finish(req, {"type": "abort", "message": req.to_abort})
            self.stats["num_aborted"] += 1
        req = self.chunked_req
        if req is not None and req.to_abort:
            self.chunked_req = None
            self._finish(req, {"type": "abort", "message": req.to_abort})
            self.stats["num_aborted"] += 1

    def _get_new_prefill(self) -> list[Req]:
        if not self.waiting and self.chunked_req is None:
            return []
        if self.running and self.consecutive_prefills >= MAX_CONSECUTIVE_PREFILLS:
            # Let the running requests decode; a chunked prefill resumes next step.
            self.consecutive_prefills = 0
            return []
        if len(self.running) >= self.max_running_requests and self.chunked_req is None:
            return []
        adder = PrefillAdder(
            self.tree_cache, self.allocator, self.running, self.new_token_ratio, self.max_prefill_tokens,
            self.chunked_prefill_size, self.max_running_requests, self.page_size,
        )
        if self.chunked_req is not None:
            req, self.chunked_req = self.chunked_req, None
            req.fill_ids = req.origin_input_ids + req.output_ids
            adder.add_chunked_req(req)
            if req not in adder.can_run:
                # No room for its next chunk yet; decode makes progress meanwhile.
                req.fill_ids = req.fill_ids[: len(req.prefix_indices)]
                self.chunked_req = req
                return []
        ordered = self.policy.order(self.waiting)
        matched = self.policy.effective_policy(len(self.waiting)) in ("lpm", "dfs-weight")
        in_batch_prefixes: set[tuple[int, ...]] = set()
        for req in ordered:
            if adder.new_chunked_req is not None:
                break
            if not matched:
                self.policy.match(req)
            if self._never_fits(req):
                continue
            if self._defer_for_in_batch_prefix(req, in_batch_prefixes):
                continue
            if adder.add_one_req(req) != AddResult.CONTINUE:
                break
        for req in adder.can_run:
            if req in self.waiting:
                self.waiting.remove(req)
            if not req.admitted:
                req.admitted = True
                req.first_prefix_len = len(req.prefix_indices)
                self.stats["prompt_tokens"] += len(req.origin_input_ids)
                self.stats["cached_prompt_tokens"] += req.first_prefix_len
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if adder.can_run:
            self.consecutive_prefills += 1
        return adder.can_run

    def _defer_for_in_batch_prefix(self, req: Req, seen: set[tuple[int, ...]]) -> bool:
        """Hold back a request that shares its start with one already in this prefill batch.

        Both would compute the shared tokens; waiting one round lets the first cache
        them, so the rest hit the cache (SGLang's in-batch prefix caching check). A
        prompt shorter than the threshold only clashes with an identical prompt: the
        samples of a parallel-sampling (n > 1) request share their prompt this way.
        """
        if not self.radix_enabled or len(req.prefix_indices) >= IN_BATCH_PREFIX_TOKENS:
            return False
        key = tuple(req.fill_ids[:IN_BATCH_PREFIX_TOKENS])
        if key in seen:
            return True
        seen.add(key)
        return False

    def _never_fits(self, req: Req) -> bool:
        """A request that could not run even alone on an empty pool finishes with an error."""
        if len(req.fill_ids) + self.page_size < self.max_total_tokens:
            return False
        self.waiting.remove(req)
        req.finish_reason = {"type": "abort", "message": "out of memory"}
        self._release_unscheduled(req)
        self.outbox.append(SchedErrorOut(
            req.rid, "out_of_memory",
            f"the request needs {len(req.fill_ids) + 1} KV slots; the pool holds {self.max_total_tokens}"))
        return True

    def _release_unscheduled(self, req: Req) -> None:
        """A waiting request holds nothing: no lock, no row (retracted ones released theirs)."""
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None

    # ------------------------------------------------------------------ running batches

    def _run_extend(self, reqs: list[Req]) -> None:
        """Prefill ``reqs``; with --enable-mixed-chunk the running requests decode in the same forward."""
        mix = self.args.enable_mixed_chunk and bool(self.running)
        try:
            if mix:
                batch = self.builder.build_mixed(reqs, self.running)
            else:
                batch = self.builder.build_extend(reqs)
        except OutOfMemory as exc:
            # The adder budgets KV, so this is a budgeting slip: never retry the same batch
            # forever. Put back all but the first request and try it alone.
            logger.warning("prefill of %d requests could not allocate (%s)", len(reqs), exc)
            for req in reversed(reqs[1:]):
                self._requeue(req)
            if len(reqs) > 1:
                self._run_extend(reqs[:1])
            else:
                self._requeue(reqs[0])
            return
        self.stats["num_prefill_batches"] += 1
        output = self.runner.forward(batch)
        next_ids = output.next_token_ids.tolist()
        decoding = list(self.running) if batch.forward_mode == ForwardMode.MIXED else []
        for i, req in enumerate(reqs):
            req.kv_committed_len = len(req.fill_ids)
            if req.is_chunked:
                # More chunks to come: keep its KV as a cached prefix, don't sample.
                self.tree_cache.cache_unfinished_req(req)
                continue
            self._append_token(req, next_ids[i], output, i)
            if req.finished:
                self._finish(req, req.finish_reason)
            else:
                self.tree_cache.cache_unfinished_req(req)
                self.running.append(req)
                self._maybe_stream(req)
        if decoding:
            self.consecutive_prefills = 0  # the running requests made progress too
            self.stats["num_mixed_batches"] += 1
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
            finished = self._process_decoded(decoding, next_ids, output, offset=len(reqs))
            self.running = [r for r in self.running if r not in finished]

    def _run_decode(self) -> None:
        self.consecutive_prefills = 0
        if not self._reserve_decode_memory():
            return
        reqs = list(self.running)
        batch = self.builder.build_decode(reqs)
        self.stats["num_decode_batches"] += 1
        output = self.runner.forward(batch)
        finished = self._process_decoded(reqs, output.next_token_ids.tolist(), output, offset=0)
        if finished:
            self.running = [r for r in reqs if r not in finished]
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)

    def _process_decoded(self, reqs: list[Req], next_ids: list[int], output: Any, offset: int) -> set[Req]:
        """Append each decoded token (batch rows ``offset..``); returns the requests that finished."""
        finished: set[Req] = set()
        for i, req in enumerate(reqs, start=offset):
            req.kv_committed_len += 1
            self._append_token(req, next_ids[i], output, i)
            if req.finished:
                self._finish(req, req.finish_reason)
                finished.add(req)
            else:
                self._maybe_stream(req)
        return finished

    def _reserve_decode_memory(self) -> bool:
        """Make room for one decode step, retracting the least-progressed requests if needed."""
        needed = self.builder.decode_tokens_needed(self.running)
        if self.builder.ensure_available(needed):
            return True
        if self.chunked_req is not None:
            # A half-prefilled prompt gives way first: its chunks become evictable cache,
            # and it resumes from whatever of them is still cached.
            self._requeue(self.chunked_req)
            if self.builder.ensure_available(needed):
                return True
        # Retract: fewest generated tokens first, longest prompt first among equals.
        order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted: list[Req] = []
        while order and not self.builder.ensure_available(self.builder.decode_tokens_needed(self.running)):
            if len(self.running) == 1:
                req = self.running.pop()
                self._finish(req, {"type": "abort", "message": "out of memory"}, error_code="out_of_memory")
                return False
            req = order.pop(0)
            self.running.remove(req)
            self._retract(req)
            retracted.append(req)
        if retracted:
            self.stats["num_retractions"] += 1
            self.stats["num_retracted_reqs"] += len(retracted)
            self.new_token_ratio = min(1.0, self.new_token_ratio + 0.1 * len(retracted) + 0.1)
            logger.info("retracted %d requests; new_token_ratio=%.2f", len(retracted), self.new_token_ratio)
        return bool(self.running)

    def _retract(self, req: Req) -> None:
        """Back to the queue: its computed KV goes to the prefix cache (evictable), its row is freed."""
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_retracted = True
        self.waiting.insert(0, req)

    def _requeue(self, req: Req) -> None:
        """Undo a scheduling decision that could not be carried out."""
        # The failed extend allocated nothing: its row (if any) holds what it held before.
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        req.is_chunked = False
        if req not in self.waiting:
            self.waiting.insert(0, req)
        if self.chunked_req is req:
            self.chunked_req = None

    # ------------------------------------------------------------------ results

    def _append_token(self, req: Req, token: int, output: Any, i: int) -> None:
        if not req.output_ids and not req.is_retracted:
            req.cached_tokens = req.first_prefix_len
        req.output_ids.append(token)
        if req.return_logprob and output.logprobs is not None:
            req.output_logprobs.append(float(output.logprobs[i]))
            if req.top_logprobs_num and output.top_logprobs is not None:
                vals, ids = output.top_logprobs
                k = req.top_logprobs_num
                req.output_top_logprobs.append(
                    [[float(v), int(t)] for v, t in zip(vals[i, :k].tolist(), ids[i, :k].tolist())])
        self.stop_checker.check(req)

    def _finish(self, req: Req, reason: dict[str, Any] | None, error_code: str | None = None) -> None:
        req.finish_reason = reason
        # Caches what has KV, frees the rest and the row, and drops the prefix lock.
        self.tree_cache.cache_finished_req(req, kv_len=req.kv_committed_len)
        self.stats["num_finished"] += 1
        if error_code is not None:
            self.outbox.append(SchedErrorOut(req.rid, error_code, str((reason or {}).get("message"))))
        else:
            self._emit(req)

    def _maybe_stream(self, req: Req) -> None:
        if not req.stream:
            return
        unsent = len(req.output_ids) - req.sent_offset
        if req.sent_offset == 0 or unsent >= self.stream_interval:
            self._emit(req)

    def _emit(self, req: Req) -> None:
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
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
            stop_strs=params.stop_strs or None,
            no_stop_trim=params.no_stop_trim,
        )
        req.sent_offset = len(req.output_ids)
        if self.outbox and isinstance(self.outbox[-1], BatchTokenIDOut):
            self.outbox[-1].outputs.append(out)
        else:
            self.outbox.append(BatchTokenIDOut([out]))

    def take_outbox(self) -> list[Any]:
        out, self.outbox = self.outbox, []
        return out

    # ------------------------------------------------------------------ control

    def is_idle(self) -> bool:
        return not self.running and not self.waiting and self.chunked_req is None

    def control(self, kind: str) -> dict[str, Any]:
        if kind == "flush_cache":
            if not self.is_idle():
                return {"success": False, "message": "requests are running; flush when idle"}
            # Idle: nothing but the tree holds slots, so every slot and row goes back.
            self.tree_cache.reset()
            self.allocator.clear()
            self.req_to_token_pool.clear()
            return {"success": True}
        if kind == "server_info":
            return self.server_info()
        return {"success": False, "message": f"unknown control request {kind!r}"}

    def load_report(self, dp_rank: int) -> Any:
        """Load and prefix-cache changes for the DP controller's routing."""
        from runtime.messages import KVEvent, LoadReport

        events = [KVEvent(e.kind, list(e.token_ids), e.start, e.extra_key) for e in self.tree_cache.take_events()]
        return LoadReport(dp_rank, len(self.running), len(self.waiting), self.allocator.available_size(),
                          num_received=self.stats["num_received"], events=events)

    def server_info(self) -> dict[str, Any]:
        report = self.check_memory()
        looked_up = self.stats["prompt_tokens"]
        return {
            "max_total_tokens": self.max_total_tokens,
            "context_len": self.context_len,
            "page_size": self.page_size,
            "available_tokens": self.allocator.available_size(),
            "evictable_tokens": self.tree_cache.evictable_size(),
            "protected_tokens": self.tree_cache.protected_size(),
            "kv_usage": 1.0 - (self.allocator.available_size() + self.tree_cache.evictable_size()) / self.max_total_tokens,
            "num_running": len(self.running),
            "num_queued": len(self.waiting),
            "num_chunked": int(self.chunked_req is not None),
            "new_token_ratio": self.new_token_ratio,
            "cache_hit_rate": self.stats["cached_prompt_tokens"] / looked_up if looked_up else 0.0,
            "memory_invariant": dataclasses.asdict(report),
            **self.stats,
        }


# ---------------------------------------------------------------------- process entry


def _place_rank(server_args: Any, tp_rank: int, dp_rank: int) -> None:
    """Pin this rank to its GPU, or give it its share of the CPU threads."""
    from runtime.device import resolve_device

    device = resolve_device(server_args.device)
    if device.type == "cuda":
        # This node holds tp_size // nnodes ranks of each DP group: number them densely.
        ranks_per_node = max(server_args.tp_size // server_args.nnodes, 1)
        local = dp_rank * ranks_per_node + tp_rank % ranks_per_node
        gpu = server_args.base_gpu_id + local * server_args.gpu_id_step
        torch.cuda.set_device(gpu)
    else:
        if server_args.attention_backend == "triton":
            # Triton kernels run on CPU only under the interpreter, which Triton reads at import.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        ranks_here = max(server_args.tp_size // server_args.nnodes, 1) * server_args.dp_size
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks_here))


class SchedulerIO:
    """Rank 0's sockets, and the broadcast that gives every TP rank the same inputs.

    Only rank 0 of a TP group talks to other processes; the other ranks receive
    rank 0's messages as msgspec bytes over the CPU group and discard their
    outputs (they are identical to rank 0's).
    """

    def __init__(self, server_args: Any, port_args: Any, tp_rank: int, dp_rank: int, tp_group: Any) -> None:
        from runtime.ipc import PullSocket, PushSocket
        from runtime.messages import ControllerInput, DetokenizerInput

        self.tp_rank, self.dp_rank, self.tp_group = tp_rank, dp_rank, tp_group
        self.dp = server_args.dp_size > 1
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[SchedulerInput])
        self.recv = self.send = self.controller = None
        if tp_rank == 0:
            endpoint = port_args.dp_scheduler_input_ipcs[dp_rank] if self.dp else port_args.scheduler_input_ipc
            self.recv = PullSocket(endpoint, SchedulerInput, bind=True)
            self.send = PushSocket(port_args.detokenizer_ipc, DetokenizerInput, bind=False)
            if self.dp:
                self.controller = PushSocket(port_args.dp_controller_ipc, ControllerInput, bind=False)

    def receive(self, block_ms: int) -> list[Any]:
        msgs: list[Any] = []
        if self.recv is not None and self.recv.poll(block_ms):
            while (msg := self.recv.recv_nowait()) is not None:
                msgs.append(msg)
        if self.tp_group is None:
            return msgs
        payload = self.tp_group.broadcast_bytes(self._encoder.encode(msgs) if self.tp_rank == 0 else None)
        return msgs if self.tp_rank == 0 else self._decoder.decode(payload)

    def publish(self, scheduler: "Scheduler") -> None:
        outputs = scheduler.take_outbox()
        if self.send is None:
            return
        for msg in outputs:
            if self.controller is not None and isinstance(msg, SchedControlOut):
                self.controller.send(msg)  # the controller merges the replicas' replies
            else:
                self.send.send(msg)
        if self.controller is not None:
            self.controller.send(scheduler.load_report(self.dp_rank))


def run_scheduler_process(server_args: Any, port_args: Any, tp_rank: int, ready_conn: Any, dp_rank: int = 0) -> None:
    """Child-process main: build the scheduler, report ready (or the error), then loop forever."""
    logging.basicConfig(level=getattr(logging, str(server_args.log_level).upper(), logging.INFO),
                        format=f"%(asctime)s scheduler[dp{dp_rank} tp{tp_rank}] %(levelname)s %(message)s")
    try:
        if server_args.random_seed is not None:
            random.seed(server_args.random_seed)
            torch.manual_seed(server_args.random_seed)
        _place_rank(server_args, tp_rank, dp_rank)
        tp_group = None
        if server_args.tp_size > 1:
            from runtime.device import resolve_device
            from runtime.distributed import init_tp_group
            from runtime.layers.linear import set_tp_group

            tp_group = init_tp_group(tp_rank, server_args.tp_size, port_args.dist_init_method(dp_rank),
                                     resolve_device(server_args.device))
            set_tp_group(tp_group)
        # Only rank 0 reports to the DP controller; events on other ranks would pile up unread.
        scheduler = Scheduler(server_args, tp_rank, kv_events=server_args.load_balance_method == "cache_aware"
                              and server_args.dp_size > 1 and tp_rank == 0)
        io = SchedulerIO(server_args, port_args, tp_rank, dp_rank, tp_group)
    except Exception:
        ready_conn.send_bytes(msgspec.json.encode({"status": "error", "error": traceback.format_exc()}))
        raise
    ready_conn.send_bytes(msgspec.json.encode({
        "status": "ready",
        "max_total_tokens": scheduler.max_total_tokens,
        "context_len": scheduler.context_len,
        "vocab_size": scheduler.runner.vocab_size,
        "max_req_input_len": min(scheduler.context_len - 1, scheduler.max_total_tokens - 2 * scheduler.page_size),
    }))
    logger.info("scheduler ready: %d KV tokens", scheduler.max_total_tokens)
    while True:
        # Block only when there is nothing to run, so the model step is never delayed.
        for msg in io.receive(0 if not scheduler.is_idle() else 1000):
            scheduler.handle_message(msg)
        scheduler.step()
        io.publish(scheduler)
