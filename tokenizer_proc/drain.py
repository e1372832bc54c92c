"""Graceful drain: stop admitting, let what is in flight finish, then stop the server.

A rolling deploy sends SIGTERM and waits; aborting every request at once (the plain stop,
``server_shutdown``) throws away work a few more seconds would finish. A drain (the
launcher's first SIGTERM, or ``POST /drain``) instead:

1. refuses new generate requests with ``draining`` (HTTP 503 with ``Retry-After``) and
   answers health checks ``draining`` (``/health`` 503), so a load balancer stops sending;
2. waits, up to ``--graceful-shutdown-timeout`` seconds, until no request is in flight
   (queued and running ones go on as usual, across every DP replica: they are all this
   front door's);
3. aborts what is left through the normal path (each client gets its last chunk, finish
   reason ``abort``, and the scheduler frees its KV), then tells the launcher ``drained``;
   the launcher stops the other processes and exits 0.

The drain is the tokenizer process's (it owns the requests in flight); the launcher only
starts it and bounds it. A second SIGTERM, or SIGINT, stops the server at once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

from tokenizer_proc.output_routing import OutputRouter
from tokenizer_proc.request_table import RequestTable

logger = logging.getLogger(__name__)

DRAINING_MESSAGE = "the server is draining (shutting down): send the request to another replica"
TIMED_OUT_MESSAGE = "the server stopped: its graceful-shutdown timeout passed before this request finished"


class Drained(Protocol):
    """What a drain needs of the front door (the TokenizerManager is one)."""

    table: RequestTable
    outputs: OutputRouter
    draining: bool


class Drain:
    """One drain of the front door; ``start`` is idempotent (SIGTERM and /drain may both come)."""

    def __init__(self, manager: Drained, timeout_s: float, on_drained: Callable[[], Awaitable[None]]) -> None:
        self.manager = manager
        self.timeout_s = timeout_s
        self.on_drained = on_drained  # stops the process (the launcher then stops the others)
        self.task: asyncio.Task[None] | None = None

    @property
    def started(self) -> bool:
        return self.task is not None

    def start(self, why: str) -> None:
        if self.task is None:
            self.task = asyncio.ensure_future(self._run(why))

    async def _run(self, why: str) -> None:
        manager = self.manager
        manager.draining = True
        table = manager.table
        changed = asyncio.Event()
        table.on_remove = changed.set
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        logger.info(
            "draining (%s): %d request(s) in flight, new ones refused; waiting up to %.0f s",
            why,
            table.num_groups,
            self.timeout_s,
        )
        while table.num_groups and loop.time() < deadline:
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        left = table.all_groups()
        if left:
            logger.warning("graceful-shutdown timeout: aborting %d request(s) still in flight", len(left))
            await manager.outputs.abort_groups(left, TIMED_OUT_MESSAGE)
        else:
            logger.info("drained: every request finished")
        await self.on_drained()
