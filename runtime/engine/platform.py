"""``ServingPlatform``: what serving on a device assumes besides its kernels.

A leaf module (it imports only torch) so that the device wings can define their constants
(``runtime.engine.cpu.host_memory.CPU_PLATFORM``, ``runtime.engine.cuda.memory.CUDA_PLATFORM``) and the
device ops (``runtime.engine.ops``) can hand them out without importing each other in a circle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class ServingPlatform:
    """What serving on a device assumes where the user does not say, and what it offers the
    model runner besides kernels (one constant per device, ``DeviceOps.platform``:
    ``runtime.engine.cuda.memory.CUDA_PLATFORM``, ``runtime.engine.cpu.host_memory.CPU_PLATFORM``)."""

    mem_fraction: float  # --mem-fraction-static's default
    warn_over_budget: bool  # log when --max-total-tokens exceeds the memory budget
    # (device, fraction, this rank's weight bytes, schedulers on the host) -> bytes the KV pools may take
    budget_bytes: Callable[[torch.device, float, int, int], float]
    # (--max-running-requests or None, context_len) -> tokens a pool sized at the default fraction
    # need not exceed (None: no such cap, the pool takes the whole budget)
    demand_tokens: Callable[[int | None, int], int] | None
    ram_bytes: Callable[[], int] | None  # the host RAM the pool comes out of (None: device memory)
    cuda_graphs: bool  # decode may run in captured CUDA graphs
    # Environment defaults the serving processes must start with (read by libraries as they load,
    # so set by launch.py before it spawns them; a value already in the environment wins).
    process_env: tuple[tuple[str, str], ...] = ()
    # The most tokens a speculative verify step feeds the model by default (--speculative-max-step-tokens;
    # None: no limit): as long as a step's extra rows cost little next to streaming the weights, drafts
    # pay; past that each draft row costs more than the tokens it is likely to save.
    spec_step_tokens: int | None = None
    # What --speculative-algorithm auto (launch.py's default) runs here (None: no speculation).
    default_speculative_algorithm: str | None = None
