"""The scheduler's inputs: new requests, aborts, and the grammar hand-off.

Why a module of its own: everything that enters the scheduler from outside the step (a
tokenized request, an abort, a compiled grammar) arrives here and becomes a queue change or a
mark on a request; the step then carries the marks out. Refusals are decided elsewhere
(``QueueBound``, ``GrammarQueue``); this class only acts on their answers. The scheduler itself
keeps the deadlines (its step loop checks them; an expired one comes back here as an abort) and
answers control requests (they read or reset all of it).
"""

from __future__ import annotations

from runtime.config.args import ServerArgs
from runtime.protocol.messages import TokenizedGenerateReq
from scheduler_proc import input_logprobs
from scheduler_proc.deadlines import TIMEOUT_MESSAGE
from scheduler_proc.grammar_queue import GrammarQueue
from scheduler_proc.long_rope import RopeSwitch
from scheduler_proc.lora_slots import LoraSlots, namespace
from scheduler_proc.output import OutputProcessor
from scheduler_proc.queue_bound import OVERLOADED, QueueBound
from scheduler_proc.queues import RequestQueues
from scheduler_proc.req import Req
from scheduler_proc.scheduler_release import RequestRelease

CLIENT_ABORT = "aborted by the client"


class RequestIntake:
    """Turns inputs into queued requests or abort marks (see the module docstring)."""

    def __init__(
        self,
        args: ServerArgs,
        context_len: int,
        queues: RequestQueues,
        grammars: GrammarQueue,
        queue_bound: QueueBound,
        rope_switch: RopeSwitch,
        output: OutputProcessor,
        release: RequestRelease,
        lora: LoraSlots | None = None,
    ) -> None:
        self.args = args
        self.lora = lora
        self.context_len = context_len
        self.queues = queues
        self.grammars = grammars
        self.queue_bound = queue_bound
        self.rope_switch = rope_switch
        self.output = output
        self.stats = output.stats
        self.release = release

    def add_request(self, msg: TokenizedGenerateReq) -> Req | None:
        """Queue a request the tokenizer validated (prompt length, vocabulary, parameters), unless
        the queue is full (--max-queued-requests): then it is refused at once with ``overloaded``
        (None). Returns the request queued (or waiting for its grammar)."""
        refusal = self.queue_bound.admit(self.num_waiting())
        if refusal is not None:
            self.stats["num_refused_overloaded"] += 1
            self.output.error(msg.rid, OVERLOADED, refusal)
            return None
        lora_uid = None
        if msg.lora_name is not None:
            adapter = self.lora.servable(msg.lora_name) if self.lora is not None else None
            if adapter is None:  # (the front door checked; an unload may have begun since)
                why = "is not loaded" if self.lora is not None else "cannot be served: this server has no --enable-lora"
                self.output.error(msg.rid, "invalid_request", f"LoRA adapter {msg.lora_name!r} {why}")
                return None
            lora_uid = adapter.uid
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
            embed=msg.embed,
            token_type_ids=msg.token_type_ids,
            lora_uid=lora_uid,
            # each adapter's KV is its own: the prefix cache keys its requests apart
            extra_key=namespace(lora_uid) if lora_uid is not None else None,
        )
        # (an embedding prompt may fill the context: it is never decoded)
        assert 0 < req.seqlen < self.context_len + req.embed, (
            f"{req.rid}: {req.seqlen} prompt tokens reached the scheduler"
        )
        self.rope_switch.settle(req)  # (a prompt past a LongRoPE switch is long from the start)
        if req.sampling_params.stop_strs or req.sampling_params.stop_regex:
            self.output.stop_checker.load_tokenizer(self.args)
        input_logprobs.begin(req)  # (max_new_tokens 0 still prefills: its prompt logprobs, its cache entry)
        if req.sampling_params.constraint is not None:
            self.grammars.add(req)
        else:
            self.queues.add(req)
        return req

    def admit_compiled(self) -> None:
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
            self.release.release_unscheduled(req)
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
