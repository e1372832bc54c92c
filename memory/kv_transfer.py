"""Copies of KV between the device pool and the host pool: every layer, one set of slots per call.

``make_kv_transfer`` picks the implementation for the device pool's device (the one place that
asks): on cpu both pools are RAM and a copy is a synchronous gather/scatter; on cuda it runs on
a copy stream of its own, so it overlaps the forward on the compute stream.

Ordering on cuda (why the events are where they are):
- device -> host (backup): the copy stream first waits for the scheduler's stream, so the KV it
  reads (written by forwards the host already waited for) and the index tensors are ready. The
  gathered KV lands in a pinned staging buffer; ``wait()`` synchronizes on the op's event and
  then scatters it into the host pool, so host slots hold the KV once ``wait`` returned.
- host -> device (load): the host pool is gathered into a pinned staging buffer (host work),
  then the copy stream uploads it and scatters it into the device slots, and the scheduler's
  stream waits on the op's event. Every forward launched afterwards (the worker records its
  start event on that stream) reads the loaded KV only after the copy.
An op keeps every tensor the copy stream reads or writes alive until ``wait``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from memory.host_pool import HostKVPool
from memory.kv_pool import MHATokenToKVPool


class TransferOp:
    """One batched copy; ``wait`` returns once its destination slots hold the KV."""

    def __init__(self, num_tokens: int, nbytes: int, to_device: bool) -> None:
        self.num_tokens = num_tokens
        self.nbytes = nbytes
        self.to_device = to_device
        self.seconds = 0.0  # time the copy took where it was waited for (synchronous: its whole time)
        self._done = True

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        self._done = True


class KVTransfer:
    """Synchronous copies between two pools in host memory (the cpu device)."""

    asynchronous = False  # ops are complete when they are returned

    def __init__(self, device_pool: MHATokenToKVPool, host_pool: HostKVPool) -> None:
        if (device_pool.num_layers, device_pool.kv_heads, device_pool.head_dim, device_pool.format) != (
            host_pool.num_layers,
            host_pool.kv_heads,
            host_pool.head_dim,
            host_pool.format,
        ):
            raise ValueError("the host pool's layout differs from the device pool's")
        self.device_pool = device_pool
        self.host_pool = host_pool
        self.bytes_per_token = device_pool.bytes_per_token()

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        d, h = self.device_pool, self.host_pool
        return list(zip(d.k_buffer, h.k_buffer)) + list(zip(d.v_buffer, h.v_buffer))

    def to_host(self, device_idx: torch.Tensor, host_idx: torch.Tensor) -> TransferOp:
        """Copy the KV of ``device_idx`` into host slots ``host_idx`` (equal lengths)."""
        return self._copy(device_idx, host_idx, to_device=False)

    def to_device(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> TransferOp:
        """Copy the KV of host slots ``host_idx`` into device slots ``device_idx``."""
        return self._copy(device_idx, host_idx, to_device=True)

    def _copy(self, device_idx: torch.Tensor, host_idx: torch.Tensor, to_device: bool) -> TransferOp:
        start = time.perf_counter()
        dev_idx = device_idx.to(torch.int64)
        for dev, host in self._pairs():
            if to_device:
                dev.index_copy_(0, dev_idx, host.index_select(0, host_idx))
            else:
                host.index_copy_(0, host_idx, dev.index_select(0, dev_idx))
        n = host_idx.numel()
        op = TransferOp(n, n * self.bytes_per_token, to_device)
        op.seconds = time.perf_counter() - start
        return op


class CudaTransferOp(TransferOp):
    """A copy in flight on the copy stream; ``wait`` syncs its event (and scatters a backup)."""

    def __init__(
        self,
        num_tokens: int,
        nbytes: int,
        to_device: bool,
        started: Any,
        event: Any,
        keep: tuple[Any, ...],
        finish: Any = None,
    ) -> None:
        super().__init__(num_tokens, nbytes, to_device)
        self._done = False
        self._started, self._event, self._keep, self._finish = started, event, keep, finish

    def done(self) -> bool:
        return self._done or bool(self._event.query())

    def wait(self) -> None:
        if self._done:
            return
        self._event.synchronize()
        self.seconds = self._started.elapsed_time(self._event) / 1e3
        if self._finish is not None:
            self._finish()
        self._done = True
        self._keep = ()
        self._finish = None


class CudaKVTransfer(KVTransfer):
    """Copies on a dedicated CUDA stream through pinned staging buffers."""

    asynchronous = True

    def __init__(self, device_pool: MHATokenToKVPool, host_pool: HostKVPool) -> None:
        super().__init__(device_pool, host_pool)
        self.device = device_pool.device
        self.stream = torch.cuda.Stream(self.device)

    def _staging(self, n: int) -> torch.Tensor:
        d = self.device_pool
        return torch.empty((2 * d.num_layers, n, d.kv_heads, d.row_width), dtype=d.dtype, pin_memory=True)

    def _events(self) -> tuple[Any, Any]:
        return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def to_host(self, device_idx: torch.Tensor, host_idx: torch.Tensor) -> TransferOp:
        n = host_idx.numel()
        staging = self._staging(n)
        started, event = self._events()
        dev_idx = device_idx.to(device=self.device, dtype=torch.int64)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            started.record(self.stream)
            for i, (dev, _) in enumerate(self._pairs()):
                staging[i].copy_(dev.index_select(0, dev_idx), non_blocking=True)
            event.record(self.stream)
        host_idx = host_idx.cpu()

        def scatter() -> None:
            for i, (_, host) in enumerate(self._pairs()):
                host.index_copy_(0, host_idx, staging[i])

        return CudaTransferOp(n, n * self.bytes_per_token, False, started, event, (dev_idx, staging), scatter)

    def to_device(self, host_idx: torch.Tensor, device_idx: torch.Tensor) -> TransferOp:
        n = host_idx.numel()
        staging = self._staging(n)
        host_idx = host_idx.cpu()
        for i, (_, host) in enumerate(self._pairs()):
            torch.index_select(host, 0, host_idx, out=staging[i])
        started, event = self._events()
        dev_idx = device_idx.to(device=self.device, dtype=torch.int64)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            started.record(self.stream)
            uploaded = staging.to(self.device, non_blocking=True)
            for i, (dev, _) in enumerate(self._pairs()):
                dev.index_copy_(0, dev_idx, uploaded[i])
            event.record(self.stream)
        current.wait_event(event)  # forwards launched from here on see the loaded KV
        return CudaTransferOp(n, n * self.bytes_per_token, True, started, event, (dev_idx, staging, uploaded))


def make_kv_transfer(device_pool: MHATokenToKVPool, host_pool: HostKVPool) -> KVTransfer:
    """The copy engine for the device pool's device: a CUDA copy stream, else synchronous copies."""
    if device_pool.device.type == "cuda":
        return CudaKVTransfer(device_pool, host_pool)
    return KVTransfer(device_pool, host_pool)
