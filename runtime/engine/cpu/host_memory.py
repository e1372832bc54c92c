"""Host-memory settings of a CPU serving process: how big the KV pool is by default (a share
of MemTotal less the weights, at most what the expected work needs: ``CPU_PLATFORM``, what the
model runner assumes on CPU), and keeping freed activation blocks inside the process."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from runtime.engine.cpu.process_env import CPU_OPENMP_ENV
from runtime.engine.kv_sizing import kv_pool_tokens
from runtime.engine.platform import ServingPlatform

# On CPU the weights and the KV pool (with the CPU backend's decode mirror, which may take as
# much again: ``kv_bytes_per_token``) come out of the machine's RAM. By default together they
# may take 25% of MemTotal: the rest is for the OS and page cache, the tokenizer and
# detokenizer processes, a chunked prefill's activations, and an optional host tier of the
# hierarchical cache (--hicache-ratio 2 by default, outside this share). On a 24 GiB machine
# that gives SmolLM2-135M in fp32 ~63k tokens (64 requests of ~980 tokens, five times the old
# default); the pool is zeroed at start, so a larger default would also cost start-up time.
# MemTotal, not MemAvailable: the same machine and flags always give the same pool, whatever
# other processes hold at start. --mem-fraction-static or --max-total-tokens ask for more.
CPU_DEFAULT_MEM_FRACTION = 0.25
# ...and, by default, no more than the expected work needs: --max-running-requests (else
# CPU_PLANNED_RUNNING_REQUESTS) requests of a typical context each. A CPU decodes tens of
# requests per step usefully, not hundreds (the old fixed cap was 64 x 2048 tokens); 4096
# tokens covers a chat turn's prompt and answer, and the pool's spare room keeps prefixes
# cached. Longer contexts still run: they share the pool with fewer requests.
CPU_PLANNED_RUNNING_REQUESTS = 64
CPU_TYPICAL_CONTEXT = 4096


def cpu_mem_total_bytes() -> int:
    """MemTotal from /proc/meminfo (falls back to 16 GiB where it cannot be read): the machine's
    RAM, which does not change with what other processes hold."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 << 30


def cpu_kv_budget_bytes(mem_total: int, fraction: float, weight_bytes: int, ranks: int = 1) -> float:
    """Bytes one scheduler's KV pool may take: its share of ``fraction`` of RAM (the ``ranks``
    schedulers on the host, TP ranks x DP replicas, split it evenly) less its own weights."""
    return mem_total * fraction / max(1, ranks) - weight_bytes


def cpu_demand_tokens(max_running_requests: int | None, context_len: int) -> int:
    """Tokens the expected work needs: the request slots asked for (else
    ``CPU_PLANNED_RUNNING_REQUESTS``) x a typical context (the model's, where shorter)."""
    requests = max_running_requests or CPU_PLANNED_RUNNING_REQUESTS
    return requests * min(context_len, CPU_TYPICAL_CONTEXT)


def cpu_kv_pool_tokens(
    *,
    mem_total: int,
    weight_bytes: int,
    per_token: int,
    context_len: int,
    page_size: int = 1,
    ranks: int = 1,
    mem_fraction_static: float | None = None,
    max_total_tokens: int | None = None,
    max_running_requests: int | None = None,
) -> int:
    """The CPU rule as a pure function of the machine and the model (what ``ModelRunner`` does on
    CPU, through ``CPU_PLATFORM``): --max-total-tokens as given; else min(the RAM share's
    budget, the expected work's tokens); an explicit --mem-fraction-static takes its whole
    share (no cap by the work)."""
    fraction = CPU_DEFAULT_MEM_FRACTION if mem_fraction_static is None else mem_fraction_static
    demand = cpu_demand_tokens(max_running_requests, context_len) if mem_fraction_static is None else None
    return kv_pool_tokens(
        per_token=per_token,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        budget_bytes=cpu_kv_budget_bytes(mem_total, fraction, weight_bytes, ranks),
        demand_tokens=demand,
    )


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


def cpu_budget_bytes(device: torch.device, fraction: float, weight_bytes: int, ranks: int) -> float:
    """Bytes the KV pools may take: ``fraction`` of MemTotal, split between the host's
    schedulers, less the weights."""
    return cpu_kv_budget_bytes(cpu_mem_total_bytes(), fraction, weight_bytes, ranks)


# A CPU decode step of SmolLM2 (fp32, 2 cores, AVX2) took 1.04x / 1.09x / 1.33x / 1.54x / 1.81x / 2.1x
# the time of one row at 2 / 3 / 4 / 5 / 8 / 12 rows, 2.8x at 16 and then ~0.1x more per row (compute
# bound): a draft row accepted about half of the time pays below 16 rows, not above
# (docs/benchmarks.md, "Speculative decoding").
CPU_SPEC_STEP_TOKENS = 16

CPU_PLATFORM = ServingPlatform(
    mem_fraction=CPU_DEFAULT_MEM_FRACTION,
    warn_over_budget=False,
    budget_bytes=cpu_budget_bytes,
    demand_tokens=cpu_demand_tokens,
    ram_bytes=cpu_mem_total_bytes,
    cuda_graphs=False,
    process_env=CPU_OPENMP_ENV,
    spec_step_tokens=CPU_SPEC_STEP_TOKENS,
)
