"""DP controller: one process that routes requests over ``--dp-size`` scheduler replicas.

Routing methods:
- ``round_robin``: in turn.
- ``shortest_queue``: the replica with the fewest running + queued requests, by
  the replicas' load reports plus what was dispatched since their last report.
- ``cache_aware``: the replica whose prefix cache holds the longest prefix of the
  prompt, known from the replicas' KV events (stored/removed token paths); when
  loads diverge, or nothing matches, the least loaded replica instead.

Control requests (flush_cache, server_info, profiling, weight updates) go to every replica;
their replies come back here and leave as one merged reply, so the tokenizer sees one server.

``--max-queued-requests`` is enforced by each replica on its own queue, not here: a request
routed to a full replica is refused by it (``overloaded``) even if another has room, because
the replica's count is exact and the load reports are a step old. The server as a whole
holds at most N x dp-size waiting requests (scheduler_proc/queue_bound.py).
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import zmq

from runtime.config.args import ServerArgs
from runtime.config.port_args import PortArgs
from runtime.engine.kv_sizing import merge_kv_pools
from runtime.protocol.child_process import send_status
from runtime.protocol.ipc import PullSocket, PushSocket
from runtime.protocol.messages import (
    ControllerInput,
    DetokenizerInput,
    KVEvent,
    LoadReport,
    SchedAbortReq,
    SchedControlOut,
    SchedControlReq,
    SchedulerInput,
    TokenizedGenerateReq,
)
from runtime.protocol.spec_stats import SPEC_STATS, spec_summary

logger = logging.getLogger(__name__)

METHODS = ("round_robin", "shortest_queue", "cache_aware")
# Prefixes are indexed in blocks: a match shorter than one block is no match.
BLOCK = 16
# cache_aware falls back to the least loaded replica when the preferred one has
# this many more requests than it and more than BALANCE_REL times as many.
BALANCE_ABS = 8
BALANCE_REL = 1.5


def block_hashes(token_ids: list[int], extra_key: str | None = None) -> list[int]:
    """Chained hash of every block-aligned prefix: element j covers tokens [0, (j+1)*BLOCK)."""
    out: list[int] = []
    h = hash(("prefix", extra_key))
    for end in range(BLOCK, len(token_ids) + 1, BLOCK):
        h = hash((h, tuple(token_ids[end - BLOCK : end])))
        out.append(h)
    return out


@dataclass
class ReplicaState:
    num_running: int = 0
    num_queued: int = 0
    num_dispatched: int = 0  # requests the controller sent to this replica
    num_received: int = 0  # of those, how many the replica had seen at its last report
    cached_blocks: set[int] = field(default_factory=set)
    host_blocks: set[int] = field(default_factory=set)  # in the hierarchical cache's host tier

    @property
    def load(self) -> int:
        # Requests in flight to the replica are not in its report yet: count them exactly.
        return self.num_running + self.num_queued + self.num_dispatched - self.num_received

    def apply(self, event: KVEvent) -> None:
        if event.kind == "cleared":
            self.cached_blocks.clear()
            self.host_blocks.clear()
            return
        hashes = block_hashes(event.token_ids, event.extra_key)
        # Block j covers tokens [0, (j+1)*BLOCK): those ending after ``start`` hold changed
        # tokens (stored: now complete; removed: no longer complete), those before it are untouched.
        changed = hashes[event.start // BLOCK :]
        blocks = self.host_blocks if event.tier == "host" else self.cached_blocks
        if event.kind == "stored":
            blocks.update(changed)
        else:
            blocks.difference_update(changed)

    def matched_blocks(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:  # a block in either tier is a hit (the host tier loads it back)
            if h not in self.cached_blocks and h not in self.host_blocks:
                break
            n += 1
        return n


class Router:
    """The routing decision alone (no sockets), so it can be tested directly."""

    def __init__(self, dp_size: int, method: str) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown load balance method {method!r}; choose from {', '.join(METHODS)}")
        self.method = method
        self.replicas = [ReplicaState() for _ in range(dp_size)]
        self._round_robin = itertools.cycle(range(dp_size))
        self.dispatch_counts = [0] * dp_size

    def on_report(self, report: LoadReport) -> None:
        state = self.replicas[report.dp_rank]
        state.num_running, state.num_queued = report.num_running, report.num_queued
        state.num_received = report.num_received
        for event in report.events:
            state.apply(event)

    def least_loaded(self) -> int:
        return min(range(len(self.replicas)), key=lambda i: (self.replicas[i].load, self.dispatch_counts[i]))

    def choose(self, input_ids: list[int]) -> int:
        if self.method == "round_robin":
            target = next(self._round_robin)
        elif self.method == "shortest_queue":
            target = self.least_loaded()
        else:
            target = self._cache_aware(input_ids)
        self.replicas[target].num_dispatched += 1
        self.dispatch_counts[target] += 1
        return target

    def _cache_aware(self, input_ids: list[int]) -> int:
        hashes = block_hashes(input_ids)
        matches = [r.matched_blocks(hashes) for r in self.replicas]
        best = max(range(len(self.replicas)), key=lambda i: (matches[i], -self.replicas[i].load))
        lightest = self.least_loaded()
        if matches[best] == 0:
            return lightest
        best_load, light_load = self.replicas[best].load, self.replicas[lightest].load
        if best_load - light_load > BALANCE_ABS and best_load > BALANCE_REL * light_load:
            return lightest
        return best


def merge_control_replies(kind: str, payloads: list[dict[str, Any]]) -> dict[str, Any]:
    """One reply for the whole server: per-replica payloads plus the sums a client wants first."""
    if kind == "flush_cache":
        return {"success": all(p.get("success") for p in payloads), "replicas": payloads}
    if kind in ("start_profile", "stop_profile", "update_weights", "load_lora", "unload_lora"):
        # Done on every replica: a failure's message (its error code) first, the traces of all.
        failed = [p for p in payloads if not p.get("success")]
        done = {**(failed or payloads)[0], "success": not failed, "replicas": payloads}
        if kind == "update_weights":
            done["num_paused_requests"] = sum(int(p.get("num_paused_requests", 0)) for p in payloads)
        if any("trace_files" in p for p in payloads):
            done["trace_files"] = [f for p in payloads for f in p.get("trace_files", [])]
        return done
    merged: dict[str, Any] = {"dp_size": len(payloads), "replicas": payloads}
    for key in (
        "num_running",
        "num_queued",
        "max_total_tokens",
        "available_tokens",
        "evictable_tokens",
        "protected_tokens",
        "num_retractions",
        "num_finished",
        "prompt_tokens",
        "cached_prompt_tokens",
        "host_hit_tokens",
        "num_refused_overloaded",
        "num_timed_out",
        *SPEC_STATS,
    ):
        if all(key in p for p in payloads):
            merged[key] = sum(p[key] for p in payloads)
    if payloads and all("context_len" in p for p in payloads):
        merged["context_len"] = payloads[0]["context_len"]
    if payloads and all("kv_pool" in p for p in payloads):
        merged["kv_pool"] = merge_kv_pools([p["kv_pool"] for p in payloads])
    invariants = [p.get("memory_invariant", {}) for p in payloads]
    merged["memory_invariant"] = {"ok": all(inv.get("ok", False) for inv in invariants), "replicas": invariants}
    looked_up = merged.get("prompt_tokens", 0)
    merged["cache_hit_rate"] = merged.get("cached_prompt_tokens", 0) / looked_up if looked_up else 0.0
    merged.update(spec_summary(merged))  # (speculative decoding only: from the summed counters)
    return merged


def run_dp_controller_process(server_args: ServerArgs, port_args: PortArgs, ready_conn: Connection) -> None:
    """Child-process main (spawned through ``runtime.protocol.child_process.run_child``, which reports errors):
    PULL from the tokenizer, PUSH to each replica, merge control replies."""
    router = Router(server_args.dp_size, server_args.load_balance_method)
    from_tokenizer: PullSocket[SchedulerInput] = PullSocket(port_args.scheduler_input_ipc, SchedulerInput, bind=True)
    from_replicas: PullSocket[ControllerInput] = PullSocket(port_args.dp_controller_ipc, ControllerInput, bind=True)
    to_replicas: list[PushSocket[SchedulerInput]] = [
        PushSocket(addr, SchedulerInput, bind=False) for addr in port_args.dp_scheduler_input_ipcs
    ]
    to_detokenizer: PushSocket[DetokenizerInput] = PushSocket(port_args.detokenizer_ipc, DetokenizerInput, bind=False)
    send_status(ready_conn, {"status": "ready"})
    pending: dict[str, list[dict[str, Any]]] = {}
    poller = zmq.Poller()
    poller.register(from_tokenizer.socket, zmq.POLLIN)
    poller.register(from_replicas.socket, zmq.POLLIN)
    while True:
        poller.poll()
        while (msg := from_replicas.recv_nowait()) is not None:
            if isinstance(msg, LoadReport):
                router.on_report(msg)
            else:
                replies = pending.setdefault(msg.rid, [])
                replies.append(msg.payload)
                if len(replies) == server_args.dp_size:
                    del pending[msg.rid]
                    payload = merge_control_replies(msg.kind, replies)
                    if msg.kind == "server_info":
                        payload["dispatch_counts"] = list(router.dispatch_counts)
                        payload["load_balance_method"] = router.method
                    to_detokenizer.send(SchedControlOut(msg.rid, msg.kind, payload))
        while (req := from_tokenizer.recv_nowait()) is not None:
            if isinstance(req, TokenizedGenerateReq):
                to_replicas[router.choose(req.input_ids)].send(req)
            elif isinstance(req, (SchedAbortReq, SchedControlReq)):
                for sock in to_replicas:
                    sock.send(req)
