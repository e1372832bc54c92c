"""Host-memory settings of a CPU serving process: how big the KV pool is by default (what the
configured work needs, within what the machine can hold: MemTotal less a stated headroom, less the
weights: ``CPU_PLATFORM``, what the model runner assumes on CPU), and keeping freed activation
blocks inside the process."""

from __future__ import annotations

import ctypes
import ctypes.util

import torch

from runtime.engine.cpu.process_env import CPU_OPENMP_ENV
from runtime.engine.kv_sizing import kv_pool_tokens
from runtime.engine.platform import ServingPlatform

# By default the KV pool holds what the work the server is configured for needs, like
# llama.cpp's --ctx-size x --parallel, not a share of the machine: --max-running-requests
# (else CPU_PLANNED_RUNNING_REQUESTS) requests of a typical CPU request's tokens each (the
# model's context, where shorter), and at least one request of the full context. A CPU decodes
# tens of requests per step usefully, not hundreds; 512 tokens is a chat turn's prompt and
# answer. For SmolLM2-135M (8192-token context) that is 32,768 tokens: 64 requests of 512, 16
# of 2,048 or 4 of the full context, 0.70 GiB of pool in bf16 (1.41 GiB in fp32), where a
# quarter of a 24 GiB machine (5.6 GiB, ~4 GB resident: the pool is zeroed, so every byte of it
# is resident from the start) was the old default. The benchmark workloads need far less
# (bench/workloads.py: the uniform 64-way load holds 64 x 192 tokens at once, the multi-turn
# sessions ~10k). Longer contexts still run: they share the pool with fewer requests, and ask
# for more with --max-total-tokens, --max-running-requests or --mem-fraction-static.
CPU_PLANNED_RUNNING_REQUESTS = 64
CPU_TYPICAL_REQUEST_TOKENS = 512
# ...within what the machine can hold: the weights and the KV pool together (with the CPU
# backend's decode mirror, which may take as much again: ``kv_bytes_per_token``) take at most this
# share of MemTotal, split between the host's schedulers. The headroom, a quarter of MemTotal, is
# for the OS and page cache, the tokenizer and detokenizer processes (~0.4 GB each), a chunked
# prefill's activations and an optional host tier of the hierarchical cache (--hicache-ratio x the
# pool, outside this share). The work's demand bounds the pool first, so a small model takes what
# its work needs (SmolLM2-135M: 1.4 GiB of 24); the share is what lets a big one start: a 1.5B
# model in fp32 (6.2 GB of weights) was refused at the old share of a quarter of RAM (a budget of
# -0.75 GiB on 24 GiB) and now gets its whole demand. MemTotal, not MemAvailable: the same machine
# and flags always give the same pool, whatever other processes hold at start. An explicit
# --mem-fraction-static sizes the pool by its share alone.
CPU_DEFAULT_MEM_FRACTION = 0.75


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
    """Tokens the configured work needs, the default pool: the request slots asked for (else
    ``CPU_PLANNED_RUNNING_REQUESTS``) x a typical request's tokens (the model's context, where
    shorter), and at least one request of the full context (a server that accepts a context
    of N tokens must be able to run one)."""
    requests = max_running_requests or CPU_PLANNED_RUNNING_REQUESTS
    return max(context_len, requests * min(context_len, CPU_TYPICAL_REQUEST_TOKENS))


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
    CPU, through ``CPU_PLATFORM``): --max-total-tokens as given; else the configured work's
    tokens (``cpu_demand_tokens``), at most the default RAM share's budget; an explicit
    --mem-fraction-static takes its whole share (no cap by the work)."""
    fraction = CPU_DEFAULT_MEM_FRACTION if mem_fraction_static is None else mem_fraction_static
    demand = cpu_demand_tokens(max_running_requests, context_len) if mem_fraction_static is None else None
    return kv_pool_tokens(
        per_token=per_token,
        page_size=page_size,
        max_total_tokens=max_total_tokens,
        budget_bytes=cpu_kv_budget_bytes(mem_total, fraction, weight_bytes, ranks),
        demand_tokens=demand,
    )


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel once (glibc's ``malloc_trim``), after a load.

    ``keep_freed_memory_in_process`` keeps every freed block, which serving wants, but a load's
    transient arrays (each GGUF tensor's raw copy and repacking, the dense values a packed copy is
    made from) would then stay resident for the server's life: on Qwen2.5-Coder-1.5B with
    ``--quantization gguf`` the scheduler held 4.0 GiB for 1.3 GB of weights and a 1.75 GiB KV pool.
    Returns False where glibc's ``malloc_trim`` is unavailable."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True


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
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
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
# n-gram drafts by default on CPUs: one request's time per token 0.43x / 0.50x (copy-heavy / random
# prompts) with them on an AVX-512 EPYC in bf16, 0.47x / 0.57x on an AVX2-only one in fp32, and 16
# concurrent requests' throughput 1.02-1.05x / 0.97-1.04x (the step budget above keeps a loaded
# batch from drafting); docs/benchmarks.md, "Speculative decoding".
CPU_DEFAULT_SPECULATIVE_ALGORITHM = "ngram"

CPU_PLATFORM = ServingPlatform(
    mem_fraction=CPU_DEFAULT_MEM_FRACTION,
    warn_over_budget=False,
    budget_bytes=cpu_budget_bytes,
    demand_tokens=cpu_demand_tokens,
    ram_bytes=cpu_mem_total_bytes,
    cuda_graphs=False,
    process_env=CPU_OPENMP_ENV,
    spec_step_tokens=CPU_SPEC_STEP_TOKENS,
    default_speculative_algorithm=CPU_DEFAULT_SPECULATIVE_ALGORITHM,
)
