"""Reply routing of the TokenizerManager: scheduler outputs back to the client that asked.

Every streamed token passes through ``handle_output``: the detokenizer's text delta is found
by its internal rid (``by_internal``), timed for the metrics, and becomes a chunk to the
client's ZMQ identity (stream; a step's chunks for one client go in one frame), or is gathered
into the one reply of a non-stream request.
A reply that cannot be delivered (the client is gone or not reading) aborts the rest of its
request. ``OutputRouting`` is a part of ``TokenizerManager`` (tokenizer_manager.py), which
owns the state named below and the intake of requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from runtime.ipc import AsyncPullSocket
from runtime.messages import (
    BatchStrOut,
    ErrorReply,
    GenerateChunk,
    GenerateChunks,
    SchedControlOut,
    SchedErrorOut,
    StrOutput,
)
from tokenizer_proc.control import ControlCalls
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.req_state import ReqGroup, SampleState

logger = logging.getLogger(__name__)


class OutputRouting:
    """The outputs side of ``TokenizerManager``; the state and the two methods it needs
    (``reply``, ``drop_group``) are the manager's."""

    groups: dict[tuple[bytes, str], ReqGroup]
    by_internal: dict[str, tuple[ReqGroup, SampleState]]
    local: dict[bytes, Any]  # the HTTP server's reply queues
    stats: dict[str, int]
    metrics: Metrics | None
    log_requests: bool
    control: ControlCalls

    async def reply(self, identity: bytes, msg: Any) -> bool:
        raise NotImplementedError  # TokenizerManager.reply

    def drop_group(self, group: ReqGroup, abort_in_scheduler: bool) -> list[SampleState]:
        raise NotImplementedError  # TokenizerManager.drop_group

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
        for identity, replies in by_client.items():
            if identity in self.local or len(replies) == 1:  # (the HTTP server's queues take chunks)
                lost = [group for group, chunk in replies if not await self.reply(identity, chunk)]
            elif await self.reply(identity, GenerateChunks([chunk for _, chunk in replies])):
                lost = []
            else:
                lost = [group for group, _ in replies]
            for group in lost:
                self.reply_lost(group)

    async def handle_output(self, out: StrOutput) -> tuple[ReqGroup, GenerateChunk] | None:
        """Notes ``out``; a stream's chunk is returned for the caller to send (with the step's
        other chunks for the same client), a whole non-stream reply is sent here."""
        entry = self.by_internal.get(out.rid)
        if entry is None:
            return None  # aborted or its client is gone: nobody to send to
        group, sample = entry
        self.note_output(group, sample, out)
        if out.finished:
            sample.finished = True
        routed = None
        if group.stream:
            chunk = GenerateChunk(rid=group.client_rid, text=out.text_delta, output_ids=out.new_output_ids,
                                  finished=out.finished, finish_reason=out.finish_reason,
                                  meta=self.meta(group, sample, out.meta, out.finish_reason if out.finished else None))
            routed = (group, chunk)
        else:
            sample.text.append(out.text_delta)
            sample.output_ids.extend(out.new_output_ids)
            sample.token_logprobs.extend(out.meta.get("output_token_logprobs", ()))
            sample.top_logprobs.extend(out.meta.get("output_top_logprobs", ()))
            if out.finished:
                meta = self.meta(group, sample, out.meta, out.finish_reason)
                if sample.token_logprobs or "output_token_logprobs" in out.meta:
                    meta["output_token_logprobs"] = sample.token_logprobs
                if sample.top_logprobs or "output_top_logprobs" in out.meta:
                    meta["output_top_logprobs"] = sample.top_logprobs
                chunk = GenerateChunk(rid=group.client_rid, text="".join(sample.text), output_ids=sample.output_ids,
                                      finished=True, finish_reason=out.finish_reason, meta=meta)
                if not await self.reply(group.identity, chunk):
                    self.reply_lost(group)
                    return None
        if out.finished:
            self.by_internal.pop(out.rid, None)
            if not group.unfinished():
                self.drop_group(group, abort_in_scheduler=False)
        return routed

    def reply_lost(self, group: ReqGroup) -> None:
        """A reply of ``group`` was dropped (its client is gone or not reading): the rest is
        moot, so abort what is still running (a no-op when client_gone dropped it already)."""
        if (group.identity, group.client_rid) in self.groups:
            self.stats["requests_aborted"] += 1
            self.drop_group(group, abort_in_scheduler=True)

    def note_output(self, group: ReqGroup, sample: SampleState, out: StrOutput) -> None:
        """Timing, metrics and the --log-requests line, as the outputs arrive."""
        now = time.perf_counter()
        first = sample.first_output_at is None
        m = self.metrics
        if first:
            sample.first_output_at = now
            if m is not None:
                m.started(int(out.meta.get("prompt_tokens", 0)), int(out.meta.get("cached_tokens", 0)))
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

    def note_finished(self, group: ReqGroup, sample: SampleState, reason: str, meta: dict[str, Any]) -> None:
        latency = time.perf_counter() - group.started
        if self.metrics is not None:
            self.metrics.finished(reason, latency)
        if self.log_requests:
            ttft = "-" if sample.first_output_at is None else f"{sample.first_output_at - group.started:.3f} s"
            logger.info("finished %s%s: %s, %d prompt tokens (%d cached), %d output tokens, ttft %s, "
                        "latency %.3f s", group.client_rid, f"[{sample.index}]" if group.n > 1 else "", reason,
                        int(meta.get("prompt_tokens", 0)), int(meta.get("cached_tokens", 0)),
                        int(meta.get("completion_tokens", len(sample.output_ids))), ttft, latency)

    def meta(self, group: ReqGroup, sample: SampleState, out_meta: dict[str, Any],
             finish_reason: dict[str, Any] | None) -> dict[str, Any]:
        meta = dict(out_meta)
        if group.n > 1:
            meta["index"] = sample.index
        if sample.finished:
            meta["finish_reason"] = finish_reason
            meta["latency"] = time.perf_counter() - group.started
        return meta

    def final_chunk(self, group: ReqGroup, sample: SampleState, finish_reason: dict[str, Any]) -> GenerateChunk:
        """The last reply of a sample that ends here (abort): what it produced so far (non-stream)."""
        sample.finished = True
        text = "" if group.stream else "".join(sample.text)
        ids = [] if group.stream else sample.output_ids
        return GenerateChunk(rid=group.client_rid, text=text, output_ids=ids, finished=True,
                             finish_reason=finish_reason,
                             meta=self.meta(group, sample, {"completion_tokens": len(sample.output_ids)},
                                            finish_reason))

    async def handle_sched_error(self, err: SchedErrorOut) -> None:
        if await self.control.handle_error(err):
            return
        entry = self.by_internal.get(err.rid)
        if entry is None:
            return
        group, sample = entry
        sample.finished = True  # the scheduler has already dropped it
        self.note_finished(group, sample, "error", {})
        self.drop_group(group, abort_in_scheduler=True)  # the other samples are moot
        await self.reply(group.identity, ErrorReply(rid=group.client_rid, code=err.code, message=err.message))

