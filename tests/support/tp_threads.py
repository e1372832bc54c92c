"""Tensor parallelism inside one test process: one thread per rank, communication faked.

``ThreadTPGroup`` stands in for the NCCL / gloo group (``runtime.engine.distributed.set_tp_group``),
so TP=2 shards can be checked against TP=1 on CPU without spawning processes.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


class ThreadTPGroup:
    """all_reduce / all_gather between threads, one thread per rank (test stand-in for NCCL/gloo)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.local = threading.local()
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.local.rank] = tensor
        self.barrier.wait()
        everyone = [t for t in self.slots if t is not None]
        self.barrier.wait()
        return everyone

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(tensor)).sum(0)

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        return torch.cat(self._exchange(tensor), dim=dim)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        source = self._exchange(tensor)[src].clone()
        self.barrier.wait()  # every rank has read rank src's values before anyone overwrites its own
        return tensor.copy_(source)


def run_on_ranks(group: ThreadTPGroup, work: Callable[[int], T], timeout_s: float = 120.0) -> list[T]:
    """``work(rank)`` on one thread per rank of ``group``; the first rank's exception is re-raised
    (a failing rank aborts the barrier, so the others do not wait for it forever)."""
    results: list[T | BaseException | None] = [None] * group.size

    def run(rank: int) -> None:
        group.local.rank = rank
        try:
            results[rank] = work(rank)
        except BaseException as exc:  # surfaced below
            group.barrier.abort()
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(group.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return results  # type: ignore[return-value]
