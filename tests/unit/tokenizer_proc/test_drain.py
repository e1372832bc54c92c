"""The graceful drain on its own (no processes): it waits for the request table to empty,
however the requests leave it, and ends at once when it is empty; past its timeout it aborts
what is left, with a reason naming the timeout; it is told to stop exactly once either way."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenizer_proc.drain import TIMED_OUT_MESSAGE, Drain
from tokenizer_proc.request_table import RequestTable
from tokenizer_proc.routing_state import ReqGroup, SampleState


class _Outputs:
    def __init__(self, table: RequestTable) -> None:
        self.table = table
        self.aborted: list[tuple[str, str]] = []

    async def abort_groups(self, groups: list[ReqGroup], why: str) -> None:
        for group in groups:
            self.aborted.append((group.client_rid, why))
            self.table.remove(group)


class _Manager:
    def __init__(self) -> None:
        self.table = RequestTable()
        self.outputs = _Outputs(self.table)
        self.draining = False


def _group(rid: str) -> ReqGroup:
    return ReqGroup(identity=b"c", client_rid=rid, stream=False, samples=[SampleState(index=0, internal_rid=rid)])


def _drain(manager: Any, timeout_s: float) -> tuple[Drain, list[float]]:
    stopped: list[float] = []

    async def on_drained() -> None:
        stopped.append(asyncio.get_running_loop().time())

    return Drain(manager, timeout_s, on_drained), stopped


def test_the_drain_waits_for_requests_in_flight_then_stops() -> None:
    async def main() -> None:
        manager = _Manager()
        groups = [_group("a"), _group("b")]
        for g in groups:
            manager.table.add(g)
        drain, stopped = _drain(manager, 30.0)
        drain.start("test")
        drain.start("again")  # idempotent
        await asyncio.sleep(0)
        assert manager.draining and not stopped
        manager.table.remove(groups[0])
        await asyncio.sleep(0)
        assert not stopped  # one still in flight
        manager.table.remove(groups[1])
        assert drain.task is not None
        await asyncio.wait_for(drain.task, 5)
        assert len(stopped) == 1 and manager.outputs.aborted == []

    asyncio.run(main())


def test_past_its_timeout_the_drain_aborts_the_rest() -> None:
    async def main() -> None:
        manager = _Manager()
        manager.table.add(_group("slow"))
        drain, stopped = _drain(manager, 0.05)
        drain.start("test")
        assert drain.task is not None
        await asyncio.wait_for(drain.task, 5)
        assert manager.outputs.aborted == [("slow", TIMED_OUT_MESSAGE)] and len(stopped) == 1
        assert manager.table.num_groups == 0

    asyncio.run(main())


def test_an_idle_drain_stops_at_once() -> None:
    async def main() -> None:
        drain, stopped = _drain(_Manager(), 30.0)
        drain.start("test")
        assert drain.task is not None
        await asyncio.wait_for(drain.task, 1)
        assert len(stopped) == 1

    asyncio.run(main())
