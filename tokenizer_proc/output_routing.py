"""Reply routing of the front door: detokenizer outputs back to the client that asked.

Every streamed token passes through ``handle_output``: the detokenizer's text delta is found
by its internal rid in the ``RequestTable``, timed for the metrics, and becomes a chunk to the
client's ZMQ identity (stream; a step's chunks for one client go in one frame), or is gathered
into the one reply of a non-stream request.
A reply that cannot be delivered (the client is gone or not reading) aborts the rest of its
request. Ending a request (``drop_group``: its last output, an error or an abort) is here too,
so that the table entry, the scheduler abort and the finish metrics go together; the table's
entries are removed only through the table's methods.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from runtime.protocol.ipc import AsyncPullSocket, PushSocket
from runtime.protocol.messages import (
    BatchStrOut,
    ChunkMeta,
    ErrorReply,
    GenerateChunk,
    GenerateChunks,
    SchedAbortReq,
    SchedControlOut,
    SchedErrorOut,
    StrOutput,
)
from tokenizer_proc.client_replies import ClientReplies
from tokenizer_proc.control import ControlCalls
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_table import RequestTable
from tokenizer_proc.routing_state import ReqGroup, SampleState

logger = logging.getLogger(__name__)

# Meta keys of the prompt logprobs: sent once per request (its first output), kept for the last reply.


class OutputRouter:
    """Turns the detokenizer's messages into client replies, through the request table."""

    def __init__(
        self,
        table: RequestTable,
        replies: ClientReplies,
        to_scheduler: PushSocket[Any],
        control: ControlCalls,
        stats: dict[str, int],
        metrics: Metrics | None,
        log_requests: bool,
    ) -> None:
        self.table = table
        self.replies = replies
        self.to_scheduler = to_scheduler
        self.control = control
        self._stats = stats  # the TokenizerManager's counters: this bumps "requests_aborted" and "requests_refused_*"
        self.metrics = metrics
        self.log_requests = log_requests

    async def output_loop(self, from_detokenizer: AsyncPullSocket[Any]) -> None:
        while True:
            msg = await from_detokenizer.recv()
            try:
                if isinstance(msg, BatchStrOut):
                    await self.handle_outputs(msg.outputs)
                elif isinstance(msg, SchedErrorOut):
                    await self.handle_sched_error(msg)
                elif isinstance(msg, SchedControlOut):
                    await self.control.handle_out(msg)
            except Exception:
                logger.exception("failed to route a scheduler output")

    async def handle_outputs(self, outs: list[StrOutput]) -> None:
        """One scheduler step's outputs: each client gets its stream chunks of the step in one
        frame (``GenerateChunks`` when there are several), after every output was noted."""
        by_client: dict[bytes, list[tuple[ReqGroup, GenerateChunk]]] = {}
        for out in outs:
            routed = await self.handle_output(out)
            if routed is not None:
                by_client.setdefault(routed[0].identity, []).append(routed)
        for identity, chunks in by_client.items():
            if self.replies.is_open_local(identity) or len(chunks) == 1:  # (the HTTP server's queues take chunks)
                lost = [group for group, chunk in chunks if not await self.replies.send(identity, chunk)]
            elif await self.replies.send(identity, GenerateChunks([chunk for _, chunk in chunks])):
                lost = []
            else:
                lost = [group for group, _ in chunks]
            for group in lost:
                self.reply_lost(group)

    async def handle_output(self, out: StrOutput) -> tuple[ReqGroup, GenerateChunk] | None:
        """Notes ``out``; a stream's chunk is returned for the caller to send (with the step's
        other chunks for the same client), a whole non-stream reply is sent here."""
        entry = self.table.sample(out.rid)
        if entry is None:
            return None  # aborted or its client is gone: nobody to send to
        group, sample = entry
        self.note_output(group, sample, out)
        if out.finished:
            sample.finished = True
        routed = None
        if group.stream:
            chunk = GenerateChunk(
                rid=group.client_rid,
                text=out.text_delta,
                output_ids=out.new_output_ids,
                finished=out.finished,
                finish_reason=out.finish_reason,
                meta=self.meta(group, sample, out.meta, out.finish_reason if out.finished else None),
            )
            routed = (group, chunk)
        else:
            sample.text.append(out.text_delta)
            sample.output_ids.extend(out.new_output_ids)
            got = out.meta
            sample.token_logprobs.extend(got.output_token_logprobs or ())
            sample.top_logprobs.extend(got.output_top_logprobs or ())
            sample.token_ids_logprobs.extend(got.output_token_ids_logprobs or ())
            if (got.input_token_logprobs, got.input_top_logprobs, got.input_token_ids_logprobs) != (None,) * 3:
                sample.input_logprobs = got
            if out.finished:
                meta = self.whole_meta(group, sample, out)
                chunk = GenerateChunk(
                    rid=group.client_rid,
                    text="".join(sample.text),
                    output_ids=sample.output_ids,
                    finished=True,
                    finish_reason=out.finish_reason,
                    meta=meta,
                )
                if not await self.replies.send(group.identity, chunk):
                    self.reply_lost(group)
                    return None
        if out.finished:
            self.table.sample_finished(out.rid)
            if not group.unfinished():
                self.drop_group(group, abort_in_scheduler=False)
        return routed

    def reply_lost(self, group: ReqGroup) -> None:
        """A reply of ``group`` was dropped (its client is gone or not reading): the rest is
        moot, so abort what is still running (a no-op when client_gone dropped it already)."""
        if self.table.contains(group.identity, group.client_rid):
            self._stats["requests_aborted"] += 1
            self.drop_group(group, abort_in_scheduler=True)

    async def abort_groups(self, groups: list[ReqGroup], why: str = "aborted by the client") -> None:
        """Abort each group; its client gets each unfinished sample's last chunk (reason abort)."""
        for group in groups:
            self._stats["requests_aborted"] += 1
            for sample in self.drop_group(group, abort_in_scheduler=True):
                await self.replies.send(
                    group.identity, self.final_chunk(group, sample, finish_reason={"type": "abort", "message": why})
                )

    def drop_group(self, group: ReqGroup, abort_in_scheduler: bool) -> list[SampleState]:
        """Remove a group from the table; abort its unfinished samples in the scheduler (their
        KV is freed). Returns those samples."""
        unfinished = group.unfinished()
        if abort_in_scheduler:
            for sample in unfinished:
                self.to_scheduler.send(SchedAbortReq(rid=sample.internal_rid))
                self.note_finished(group, sample, "abort", ChunkMeta())
        self.table.remove(group)
        return unfinished

    def note_output(self, group: ReqGroup, sample: SampleState, out: StrOutput) -> None:
        """Timing, metrics and the --log-requests line, as the outputs arrive."""
        now = time.perf_counter()
        first = sample.first_output_at is None
        m = self.metrics
        if first:
            sample.first_output_at = now
            if m is not None:
                m.started(out.meta.prompt_tokens or 0, out.meta.cached_tokens or 0)
                if out.meta.grammar_compile_seconds is not None:
                    m.constrained(out.meta.grammar_compile_seconds, bool(out.meta.grammar_cache_hit))
                if group.stream:
                    m.first_token(now - group.started)
        elif m is not None and group.stream:
            m.gap(now - sample.last_output_at, len(out.new_output_ids))
        sample.last_output_at = now
        if m is not None:
            m.generated(len(out.new_output_ids))
        if out.finished:
            reason = (out.finish_reason or {}).get("type", "stop")
            self.note_finished(group, sample, str(reason), out.meta)

    def whole_meta(self, group: ReqGroup, sample: SampleState, out: StrOutput) -> ChunkMeta:
        """A non-stream sample's one reply meta: the last output's counts, the prompt logprobs of
        whichever output carried them, and every output's logprob lists joined (each list where any
        output carried it)."""
        meta = self.meta(group, sample, out.meta, out.finish_reason)
        carried = sample.input_logprobs
        if carried is not None:
            meta = msgspec.structs.replace(
                meta,
                input_token_logprobs=carried.input_token_logprobs,
                input_top_logprobs=carried.input_top_logprobs,
                input_token_ids_logprobs=carried.input_token_ids_logprobs,
            )
        got = out.meta
        return msgspec.structs.replace(
            meta,
            output_token_logprobs=sample.token_logprobs
            if sample.token_logprobs or got.output_token_logprobs is not None
            else None,
            output_top_logprobs=sample.top_logprobs
            if sample.top_logprobs or got.output_top_logprobs is not None
            else None,
            output_token_ids_logprobs=sample.token_ids_logprobs
            if sample.token_ids_logprobs or got.output_token_ids_logprobs is not None
            else None,
        )

    def note_finished(self, group: ReqGroup, sample: SampleState, reason: str, meta: ChunkMeta) -> None:
        latency = time.perf_counter() - group.started
        if self.metrics is not None:
            self.metrics.finished(reason, latency)
        if self.log_requests:
            ttft = "-" if sample.first_output_at is None else f"{sample.first_output_at - group.started:.3f} s"
            logger.info(
                "finished %s%s: %s, %d prompt tokens (%d cached), %d output tokens, ttft %s, latency %.3f s",
                group.client_rid,
                f"[{sample.index}]" if group.n > 1 else "",
                reason,
                meta.prompt_tokens or 0,
                meta.cached_tokens or 0,
                meta.completion_tokens if meta.completion_tokens is not None else len(sample.output_ids),
                ttft,
                latency,
            )

    def meta(
        self, group: ReqGroup, sample: SampleState, out_meta: ChunkMeta, finish_reason: dict[str, Any] | None
    ) -> ChunkMeta:
        """An output's meta as its client gets it: the sample's index (n > 1), and once it finished
        its finish reason and latency."""
        index = sample.index if group.n > 1 else out_meta.index
        if not sample.finished:
            return out_meta if index == out_meta.index else msgspec.structs.replace(out_meta, index=index)
        latency = time.perf_counter() - group.started
        return msgspec.structs.replace(out_meta, index=index, finish_reason=finish_reason, latency=latency)

    def final_chunk(self, group: ReqGroup, sample: SampleState, finish_reason: dict[str, Any]) -> GenerateChunk:
        """The last reply of a sample that ends here (abort): what it produced so far (non-stream)."""
        sample.finished = True
        text = "" if group.stream else "".join(sample.text)
        ids = [] if group.stream else sample.output_ids
        return GenerateChunk(
            rid=group.client_rid,
            text=text,
            output_ids=ids,
            finished=True,
            finish_reason=finish_reason,
            meta=self.meta(group, sample, ChunkMeta(completion_tokens=len(sample.output_ids)), finish_reason),
        )

    async def handle_sched_error(self, err: SchedErrorOut) -> None:
        if await self.control.handle_error(err):
            return
        entry = self.table.sample(err.rid)
        if entry is None:
            return
        group, sample = entry
        sample.finished = True  # the scheduler has already dropped it
        if err.code == "overloaded":  # --max-queued-requests: once per request (its group ends here)
            self._stats["requests_refused_overloaded"] += 1
            if self.metrics is not None:
                self.metrics.refused_request("overloaded")
        self.note_finished(group, sample, "error", ChunkMeta())
        self.drop_group(group, abort_in_scheduler=True)  # the other samples are moot
        await self.replies.send(group.identity, ErrorReply(rid=group.client_rid, code=err.code, message=err.message))
