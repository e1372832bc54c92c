"""The DetokenizerManager process: token ids from the scheduler in, text deltas out.

A plain synchronous loop (it has one input socket and nothing else to wait for).
It owns one ``DecodeState`` per unfinished request that has produced output; the
state is freed when the request finishes or errors. The per-request settings (stop
strings, special-token handling) are taken from a request's first ``ReqOutput`` and
kept in its state: later outputs need not carry them. An embedding request's one
output has no tokens; its vector passes through to the meta unchanged. Control
replies and errors from the scheduler pass through unchanged.
"""

from __future__ import annotations

import logging
from multiprocessing.connection import Connection
from typing import Any

from detokenizer_proc.incremental import Decoder, DecodeState
from runtime.config.args import ServerArgs
from runtime.config.port_args import PortArgs
from runtime.protocol.child_process import send_status
from runtime.protocol.ipc import PullSocket, PushSocket
from runtime.protocol.messages import (
    BatchStrOut,
    BatchTokenIDOut,
    ChunkMeta,
    DetokenizerInput,
    ReqOutput,
    SchedControlOut,
    SchedErrorOut,
    StrOutput,
    TokenizerInput,
)
from runtime.text.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


class DetokenizerManager:
    """Turns ``BatchTokenIDOut`` into ``BatchStrOut``; pure logic, no sockets (testable)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}  # rid -> state, owned here until finish

    def handle(self, msg: Any) -> Any | None:
        """The message to forward to the tokenizer for one input message (None: nothing)."""
        if isinstance(msg, BatchTokenIDOut):
            return self.handle_batch(msg)
        if isinstance(msg, SchedErrorOut):
            self.states.pop(msg.rid, None)
            return msg
        if isinstance(msg, SchedControlOut):
            return msg
        logger.error("unexpected message type %s", type(msg).__name__)
        return None

    def handle_batch(self, batch: BatchTokenIDOut) -> BatchStrOut:
        return BatchStrOut(outputs=[self._one(out) for out in batch.outputs])

    def _one(self, out: ReqOutput) -> StrOutput:
        state = self.states.get(out.rid)
        if state is None:
            state = DecodeState(
                skip_special_tokens=out.skip_special_tokens,
                stop_strs=tuple(out.stop_strs or ()),
                no_stop_trim=out.no_stop_trim,
            )
            if not out.finished:
                self.states[out.rid] = state
        try:
            delta = state.step(self.tokenizer, out.new_output_ids, out.finished, out.finish_reason)
        except Exception:  # a tokenizer failure must not take the process down
            logger.exception("detokenization of %s failed", out.rid)
            delta = ""
        if out.finished:
            self.states.pop(out.rid, None)
        compiled = out.grammar_compile_seconds is not None
        meta = ChunkMeta(
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens,
            grammar_compile_seconds=out.grammar_compile_seconds,
            grammar_cache_hit=out.grammar_cache_hit if compiled else None,
            embedding=out.embedding,  # an embedding request's one output: the vector, as the scheduler pooled it
            output_token_logprobs=None
            if out.output_logprobs is None
            else [[lp, tid] for lp, tid in zip(out.output_logprobs, out.new_output_ids)],
            output_top_logprobs=out.output_top_logprobs,
            output_token_ids_logprobs=out.output_token_ids_logprobs,  # SGLang's token_ids_logprob, per new id
            input_token_logprobs=out.input_token_logprobs,  # (the input lists: a request's first output only)
            input_top_logprobs=out.input_top_logprobs,
            input_token_ids_logprobs=out.input_token_ids_logprobs,
        )
        return StrOutput(
            rid=out.rid,
            text_delta=delta,
            new_output_ids=out.new_output_ids,
            finished=out.finished,
            finish_reason=out.finish_reason,
            meta=meta,
        )


SIGNAL_CHECK_MS = 200  # the longest the loop blocks without letting a signal handler run


def run_detokenizer_process(server_args: ServerArgs, port_args: PortArgs, ready_conn: Connection) -> None:
    """Child-process main: load the tokenizer, bind, report ready, loop until killed."""
    manager = DetokenizerManager(load_tokenizer(server_args.resolved_tokenizer_path()))
    recv: PullSocket[Any] = PullSocket(port_args.detokenizer_ipc, DetokenizerInput, bind=True)
    send: PushSocket[Any] = PushSocket(port_args.tokenizer_ipc, TokenizerInput, bind=False)
    send_status(ready_conn, {"status": "ready"})
    logger.info("detokenizer ready")
    while True:
        # A bounded wait: SIGTERM may be delivered to one of zmq's own threads, and Python runs its
        # handler only when this thread returns from the poll (an endless poll ignored SIGTERM).
        if not recv.poll(SIGNAL_CHECK_MS):
            continue
        # Merge the text of every waiting batch into one message; pass-through messages
        # keep their place in the order.
        merged: list[StrOutput] = []
        for msg in recv.recv_all_nowait():
            out = manager.handle(msg)
            if isinstance(out, BatchStrOut):
                merged.extend(out.outputs)
                continue
            if merged:
                send.send(BatchStrOut(outputs=merged))
                merged = []
            if out is not None:
                send.send(out)
        if merged:
            send.send(BatchStrOut(outputs=merged))
