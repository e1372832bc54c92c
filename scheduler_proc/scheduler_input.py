"""The scheduler's inputs: messages, new requests, aborts, and the grammar and deadline hand-offs.

Why a module of its own: everything that enters the scheduler from outside the step (a
tokenized request, an abort, a control request, a compiled grammar, an expired deadline)
arrives here and becomes a queue change or a mark on a request; the step then carries the
marks out. Refusals are decided elsewhere (``QueueBound``, ``Deadlines``, ``GrammarQueue``);
this mixin only acts on their answers.
"""

from __future__ import annotations

from runtime.protocol.messages import (
    SchedAbortReq,
    SchedControlReq,
    SchedulerInput,
    TokenizedGenerateReq,
)
from scheduler_proc import input_logprobs
from scheduler_proc.deadlines import TIMEOUT_MESSAGE
from scheduler_proc.queue_bound import OVERLOADED
from scheduler_proc.req import Req
from scheduler_proc.scheduler_wiring import SchedulerWiring

CLIENT_ABORT = "aborted by the client"


class SchedulerInputMixin(SchedulerWiring):
    """Turns inputs into queued requests or abort marks (see the module docstring)."""

    def handle_message(self, msg: SchedulerInput) -> None:
        if isinstance(msg, TokenizedGenerateReq):
            self.stats["num_received"] += 1
            self.add_request(msg)
        elif isinstance(msg, SchedAbortReq):
            self.abort(msg.rid, msg.reason or CLIENT_ABORT)
        elif isinstance(msg, SchedControlReq):
            self.control_request(msg)  # (scheduler_control: some answer later, a weight update)

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        """Queue a request the tokenizer validated (prompt length, vocabulary, parameters), unless
        the queue is full (--max-queued-requests): then it is refused at once with ``overloaded``."""
        refusal = self.queue_bound.admit(self.num_waiting())
        if refusal is not None:
            self.stats["num_refused_overloaded"] += 1
            self.output.error(msg.rid, OVERLOADED, refusal)
            return
        req = Req(
            rid=msg.rid,
            origin_input_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            token_ids_logprob=msg.token_ids_logprob or None,
            priority=msg.priority if self.args.enable_priority_scheduling else 0,
        )
        assert 0 < req.seqlen < self.context_len, f"{req.rid}: {req.seqlen} prompt tokens reached the scheduler"
        self.rope_switch.settle(req)  # (a prompt past a LongRoPE switch is long from the start)
        if req.sampling_params.stop_strs or req.sampling_params.stop_regex:
            self.output.stop_checker.load_tokenizer(self.args)
        input_logprobs.begin(req)  # (max_new_tokens 0 still prefills: its prompt logprobs, its cache entry)
        if msg.deadline is not None and self.tp_rank == 0:
            self.deadlines.add(req, msg.deadline)
        if req.sampling_params.constraint is not None:
            self.grammars.add(req)
            return
        self.queues.add(req)

    def _admit_compiled(self) -> None:
        """Constrained requests whose grammar is ready join the queue; failed ones end with the reason."""
        ready, failed = self.grammars.poll()
        for req in ready:
            self.queues.add(req)
        for req, reason in failed:
            self.output.finish(req, {"type": "abort", "message": reason}, error_code="invalid_request")

    def abort(self, rid: str, message: str = CLIENT_ABORT) -> None:
        """Abort one request (or all when rid is ''): queued ones at once, others at the next step.
        ``message`` is the finish reason's (``timeout`` for an expired deadline)."""
        hit = 0
        for req in self.grammars.remove(rid):
            hit += 1
            self.stats["num_aborted"] += 1
            self.output.finish(req, {"type": "abort", "message": message})
        for req in [r for r in self.queues.waiting if rid in ("", r.rid)]:
            hit += 1
            self.queues.remove_waiting(req)
            self.stats["num_aborted"] += 1
            self._release_unscheduled(req)
            self.output.finish(req, {"type": "abort", "message": message})
        for req in self.queues.holders():
            if rid in ("", req.rid) and req.to_abort is None:
                hit += 1
                req.to_abort = message
        if message == TIMEOUT_MESSAGE:
            self.stats["num_timed_out"] += hit

    def num_waiting(self) -> int:
        """Requests received and not running: what --max-queued-requests bounds."""
        return len(self.queues.waiting) + len(self.grammars)

    def expired_rids(self) -> list[str]:
        """The live requests whose deadline has passed (rank 0 decides; scheduler_proc.deadlines)."""
        return [req.rid for req in self.deadlines.expired()]
