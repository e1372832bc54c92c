"""Tensor parallelism's communication: what layers need of a TP group, the process-wide
registry of it, and the torch.distributed group that serving uses.

- ``TPCommunicator``: the collectives TP layers and the model runner call (torch.distributed
  here; tests plug in a thread-based one);
- ``set_tp_group`` / ``get_tp_group``: this process's group, registered once by the scheduler
  process (None: a single rank, where a layer built with ``tp_size > 1`` refuses to run rather
  than silently return a partial sum);
- ``TPGroup`` / ``init_tp_group``: each scheduler rank joins one group for tensor traffic
  (NCCL on cuda, gloo on CPU) and one gloo group on the CPU for control traffic: rank 0 owns
  the sockets and broadcasts what it received as msgspec bytes, so every rank forms the same
  batch. No pickle: only raw bytes and tensors cross these groups.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Ranks other than 0 wait in a broadcast while the server is idle; never time that out.
IDLE_TIMEOUT = datetime.timedelta(days=365)


class TPCommunicator(Protocol):
    """What TP layers need from a communication group (torch.distributed, threads, ...)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks; may work in place, returns the result."""
        ...

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim`` in rank order."""
        ...

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` in place with rank ``src``'s values (the sampled ids)."""
        ...


# This process's TP group: written once by the scheduler process (or a test), read by every layer.
_TP_GROUP: TPCommunicator | None = None


def set_tp_group(group: TPCommunicator | None) -> None:
    """Register the TP communication group for this process (None: single rank)."""
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group() -> TPCommunicator:
    if _TP_GROUP is None:
        raise RuntimeError(
            "a layer was built with tp_size > 1 but no TP group is registered; "
            "call runtime.engine.distributed.set_tp_group(...) before running the model"
        )
    return _TP_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    return x if tp_size == 1 else get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    return x if tp_size == 1 else get_tp_group().all_gather(x, dim)


class TPPeerLost(RuntimeError):
    """A control broadcast failed because another rank of the TP group is gone."""


@dataclass
class TPGroup:
    """This rank's view of its tensor-parallel group over torch.distributed (a ``TPCommunicator``)."""

    rank: int
    world_size: int
    device_group: dist.ProcessGroup
    cpu_group: dist.ProcessGroup

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Make every rank hold rank ``src``'s values (in place; on the tensor group)."""
        dist.broadcast(tensor, src=src, group=self.device_group)
        return tensor

    def broadcast_bytes(self, payload: bytes | None, src: int = 0) -> bytes:
        """Send ``payload`` from rank ``src`` to all ranks over the CPU group; others pass None.

        Idle ranks wait here; when a peer's process (or its whole node) goes away, gloo
        reports the closed connection and this raises TPPeerLost, so the rank exits and
        its launcher stops instead of waiting forever."""
        try:
            return self._broadcast_bytes(payload, src)
        except RuntimeError as exc:
            raise TPPeerLost(
                f"TP rank {self.rank} of {self.world_size} lost a peer (a rank's process or node stopped): {exc}"
            ) from exc

    def _broadcast_bytes(self, payload: bytes | None, src: int) -> bytes:
        size = torch.zeros(1, dtype=torch.int64)
        sent: bytes | None = None  # this rank's payload when it is the source
        if self.rank == src:
            assert payload is not None
            sent = payload
            size[0] = len(payload)
        dist.broadcast(size, src=src, group=self.cpu_group)
        n = int(size[0])
        if n == 0:
            return b""
        if sent is not None:
            buf = torch.frombuffer(bytearray(sent), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=src, group=self.cpu_group)
        return sent if sent is not None else buf.numpy().tobytes()

    def barrier(self) -> None:
        dist.barrier(group=self.cpu_group)


def init_tp_group(rank: int, world_size: int, init_method: str, device: torch.device) -> TPGroup:
    """Join the TP group. ``init_method`` is a ``tcp://host:port`` every rank can reach."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend=backend, init_method=init_method, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT
    )
    world = dist.group.WORLD
    assert world is not None  # (set by init_process_group above)
    # Control traffic has a group of its own even on CPU: with overlap scheduling the
    # model's collectives run on the worker thread while the scheduler thread broadcasts.
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    logger.info("rank %d/%d joined the TP group (%s)", rank, world_size, backend)
    return TPGroup(rank=rank, world_size=world_size, device_group=world, cpu_group=cpu_group)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
