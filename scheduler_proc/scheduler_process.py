"""The scheduler process: device placement, sockets, the TP broadcast of inputs, the loop.

``run_scheduler_process`` is spawned through ``runtime.protocol.child_process.run_child``, which owns the
logging set-up, the signals and the error half of the ready handshake; this module only
reports ready with what the tokenizer needs to validate requests.
"""

from __future__ import annotations

import logging
import os
import random
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from runtime.config.args import ServerArgs
from runtime.config.port_args import PortArgs
from runtime.engine.device import resolve_device
from runtime.engine.distributed import TPGroup, init_tp_group, set_tp_group
from runtime.protocol.child_process import send_status
from runtime.protocol.ipc import PullSocket, PushSocket
from runtime.protocol.messages import ControllerInput, DetokenizerInput, SchedAbortReq, SchedControlOut, SchedulerInput
from scheduler_proc.admission_gate import AdmissionGate
from scheduler_proc.deadlines import TIMEOUT_MESSAGE
from scheduler_proc.reports import kv_pool_info
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.watchdog import install_test_step_delay, start_watchdog

logger = logging.getLogger(__name__)


def place_rank(server_args: ServerArgs, tp_rank: int, dp_rank: int) -> None:
    """Pin this rank to its GPU, or give it its share of the CPU threads."""
    device = resolve_device(server_args.device)
    if device.type == "cuda":
        # This node holds tp_size // nnodes ranks of each DP group: number them densely.
        ranks_per_node = max(server_args.tp_size // server_args.nnodes, 1)
        local = dp_rank * ranks_per_node + tp_rank % ranks_per_node
        torch.cuda.set_device(server_args.base_gpu_id + local * server_args.gpu_id_step)
    else:
        if server_args.attention_backend == "triton":
            # Triton kernels run on CPU only under the interpreter, which Triton reads at import.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        ranks_here = max(server_args.tp_size // server_args.nnodes, 1) * server_args.dp_size
        torch.set_num_threads(max(1, usable_cpus() // ranks_here))


def usable_cpus() -> int:
    """The cores this process may run on: its affinity (taskset, a container's cpuset), not the
    machine's count, so a server pinned to some cores runs one thread per core it has."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class SchedulerIO:
    """Rank 0's sockets, and the broadcast that gives every TP rank the same inputs.

    Only rank 0 of a TP group talks to other processes; the other ranks receive
    rank 0's messages as msgspec bytes over the CPU group and discard their
    outputs (they are identical to rank 0's).
    """

    def __init__(
        self, server_args: ServerArgs, port_args: PortArgs, tp_rank: int, dp_rank: int, tp_group: TPGroup | None
    ) -> None:
        self.tp_rank, self.dp_rank, self.tp_group = tp_rank, dp_rank, tp_group
        self.dp = server_args.dp_size > 1
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(list[SchedulerInput])
        self.recv: PullSocket | None = None
        self.send: PushSocket | None = None
        self.controller: PushSocket | None = None
        self.gate: AdmissionGate | None = None  # --max-queued-requests: refusals off the loop
        if tp_rank == 0:
            endpoint = port_args.dp_scheduler_input_ipcs[dp_rank] if self.dp else port_args.scheduler_input_ipc
            self.recv = PullSocket(endpoint, SchedulerInput, bind=True)
            self.send = PushSocket(port_args.detokenizer_ipc, DetokenizerInput, bind=False)
            if self.dp:
                self.controller = PushSocket(port_args.dp_controller_ipc, ControllerInput, bind=False)
            if server_args.max_queued_requests is not None:
                self.gate = AdmissionGate(self.recv, port_args.detokenizer_ipc, server_args.max_queued_requests)
                self.recv = None  # the gate's thread owns it now

    def receive(self, block_ms: int, scheduler: Scheduler | None = None) -> list[Any]:
        msgs: list[Any] = []
        if self.gate is not None:
            msgs = self.gate.take(block_ms)
        elif self.recv is not None and self.recv.poll(block_ms):
            while (msg := self.recv.recv_nowait()) is not None:
                msgs.append(msg)
        if scheduler is not None and self.tp_rank == 0 and len(scheduler.deadlines):
            # Under TP rank 0 alone reads the clock: its expiries go to every rank as aborts, so
            # all abort at the same step (a lone rank does this itself in Scheduler.step).
            msgs.extend(SchedAbortReq(rid, TIMEOUT_MESSAGE) for rid in scheduler.expired_rids())
        if self.tp_group is None:
            return msgs
        payload = self.tp_group.broadcast_bytes(self._encoder.encode(msgs) if self.tp_rank == 0 else None)
        return msgs if self.tp_rank == 0 else self._decoder.decode(payload)

    def report_queue(self, scheduler: Scheduler) -> None:
        """Tell the admission gate (if any) how many requests wait now."""
        if self.gate is not None:
            scheduler.stats["num_refused_overloaded"] += self.gate.report(scheduler.num_waiting())

    def publish(self, scheduler: Scheduler) -> None:
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


def run_scheduler_process(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, ready_conn: Connection, dp_rank: int = 0
) -> None:
    """Child-process main: build the scheduler, report ready, then loop forever."""
    if server_args.random_seed is not None:
        random.seed(server_args.random_seed)
        torch.manual_seed(server_args.random_seed)
    place_rank(server_args, tp_rank, dp_rank)
    tp_group = None
    if server_args.tp_size > 1:
        tp_group = init_tp_group(
            tp_rank, server_args.tp_size, port_args.dist_init_method(dp_rank), resolve_device(server_args.device)
        )
        set_tp_group(tp_group)
    # Only rank 0 reports to the DP controller; events on other ranks would pile up unread.
    kv_events = server_args.load_balance_method == "cache_aware" and server_args.dp_size > 1 and tp_rank == 0
    scheduler = Scheduler(server_args, tp_rank, kv_events=kv_events, dp_rank=dp_rank)
    io = SchedulerIO(server_args, port_args, tp_rank, dp_rank, tp_group)
    send_status(
        ready_conn,
        {
            "status": "ready",
            "max_total_tokens": scheduler.max_total_tokens,
            "context_len": scheduler.context_len,
            "vocab_size": scheduler.runner.vocab_size,
            # (a generated token needs a position past the prompt; an embedding prompt may fill the context)
            "max_req_input_len": min(
                scheduler.context_len - (0 if scheduler.pooling is not None else 1),
                scheduler.max_total_tokens - 2 * scheduler.page_size,
            ),
            # What this rank reserved, for launch.py's ready line (kv_sizing.host_kv_pool, ready_note).
            "dp_rank": dp_rank,
            "kv_pool": kv_pool_info(
                scheduler.runner, scheduler.max_total_tokens, scheduler.context_len, scheduler.max_running_requests
            ),
        },
    )
    logger.info(
        "scheduler ready: %d KV tokens, overlap schedule %s",
        scheduler.max_total_tokens,
        "on" if scheduler.worker.overlap else "off",
    )
    install_test_step_delay(scheduler.runner)  # (tests only; after start-up, so only served steps sleep)
    watchdog = start_watchdog(server_args.watchdog_timeout, f"scheduler dp{dp_rank} tp{tp_rank}")
    while True:
        # Block only when there is nothing to run, so the model step is never delayed.
        msgs = io.receive(scheduler.receive_timeout_ms(), scheduler if server_args.tp_size > 1 else None)
        watchdog.begin_step()  # the wait above is idle time; from here on the loop must not stall
        for msg in msgs:
            scheduler.handle_message(msg)
        io.report_queue(scheduler)
        scheduler.step()
        io.report_queue(scheduler)
        io.publish(scheduler)
        watchdog.end_step()
