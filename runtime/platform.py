"""``ServingPlatform``: what serving on a device assumes besides its kernels.

A leaf module (it imports only torch) so that the device wings can define their constants
(``runtime.cpu.host_memory.CPU_PLATFORM``, ``runtime.cuda.memory.CUDA_PLATFORM``) and the
device ops (``runtime.ops``) can hand them out without importing each other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ServingPlatform:
    """What serving on a device assumes where the user does not say, and what it offers the
    model runner besides kernels (one constant per device, ``DeviceOps.platform``:
    ``runtime.cuda.memory.CUDA_PLATFORM``, ``runtime.cpu.host_memory.CPU_PLATFORM``)."""

    mem_fraction: float  # --mem-fraction-static's default
    max_total_tokens: int | None  # cap on a KV pool sized from memory at the default fraction (None: none)
    warn_over_budget: bool  # log when --max-total-tokens exceeds the memory budget
    budget_bytes: Callable[[torch.device, float], float]  # (device, fraction) -> bytes the KV pools may take
    cuda_graphs: bool  # decode may run in captured CUDA graphs
