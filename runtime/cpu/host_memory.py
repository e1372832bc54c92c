"""Host-memory settings of a CPU serving process: how much RAM there is to size the KV pool
from (``CPU_PLATFORM``, what the model runner assumes on CPU), and keeping freed activation
blocks inside the process."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from runtime.platform import ServingPlatform

# On CPU the KV pool comes out of the same RAM as everything else on the machine, so the
# default budget is a small fraction of MemAvailable rather than the GPU's 0.8.
CPU_DEFAULT_MEM_FRACTION = 0.05
# ...and, by default, no more tokens than a CPU can usefully serve (64 requests x 2048).
CPU_DEFAULT_MAX_TOTAL_TOKENS = 131072


def cpu_mem_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to 4 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def keep_freed_memory_in_process() -> bool:
    """Stop glibc from handing big freed blocks back to the kernel (CPU inference).

    By default glibc serves every allocation above a threshold (at most 32 MiB) with a
    fresh ``mmap`` and unmaps it on free, so each activation of a large prefill (a
    ``[8192, 5632]`` bf16 gate/up output is 92 MiB) is page-faulted in from zeroed pages,
    every layer, every forward: on the bench model that made an 8192-token prefill ~50%
    slower and elementwise ops up to 10x slower. With mmap off and a high trim threshold,
    freed blocks stay in the heap and the next layer reuses them. Returns False where
    glibc's ``mallopt`` is unavailable (other libcs keep their defaults).
    """
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h parameter numbers
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def cpu_budget_bytes(device: torch.device, fraction: float) -> float:
    """Bytes the KV pools may take: ``fraction`` of MemAvailable."""
    return cpu_mem_available_bytes() * fraction


CPU_PLATFORM = ServingPlatform(
    mem_fraction=CPU_DEFAULT_MEM_FRACTION,
    max_total_tokens=CPU_DEFAULT_MAX_TOTAL_TOKENS,
    warn_over_budget=False,
    budget_bytes=cpu_budget_bytes,
    cuda_graphs=False,
)
