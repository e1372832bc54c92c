"""The "memory" flags: how big the KV cache is and how it is paged, cached across requests
(the radix cache and its host-memory tier) and split for sliding-window layers."""

from __future__ import annotations

import argparse
from typing import Protocol

from runtime.config.flag_checks import choice

EVICTION_POLICY_CHOICES = ("lru", "lfu")
HICACHE_WRITE_POLICY_CHOICES = ("write_through", "write_back")
# --kv-cache-dtype: SGLang's names (``bfloat16`` is ``bf16``'s other spelling) plus int8 (llama.cpp's
# q8_0 idea per token and KV head); what each stores: memory.kv_format.
KV_CACHE_DTYPE_CHOICES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8")


class MemoryFlags(Protocol):
    """The ``ServerArgs`` fields of this group (a protocol, so that this module need not import
    ``runtime.config.server_args``, which imports it)."""

    mem_fraction_static: float | None
    max_total_tokens: int | None
    kv_cache_dtype: str
    page_size: int
    disable_radix_cache: bool
    radix_eviction_policy: str
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: float
    hicache_write_policy: str
    swa_full_tokens_ratio: float
    disable_hybrid_swa_memory: bool


def add_memory_args(parser: argparse.ArgumentParser, defaults: MemoryFlags) -> None:
    """The "memory" group; ``defaults`` is a default ``ServerArgs``."""
    d = defaults
    g = parser.add_argument_group("memory")
    g.add_argument(
        "--mem-fraction-static",
        type=float,
        default=d.mem_fraction_static,
        help="fraction of device memory for weights + KV cache, in (0, 1); given, the KV pool takes all of it "
        "(default: cuda 0.8; cpu: the pool is sized by the work, with the weights at most 0.75 of RAM)",
    )
    g.add_argument(
        "--max-total-tokens",
        type=int,
        default=d.max_total_tokens,
        help="KV cache size in tokens; overrides --mem-fraction-static (default: cuda from memory; cpu what "
        "the work needs, N x min(context, 512) with N --max-running-requests or 64, at least one context; "
        "launch.py's ready line says it)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        type=str,
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPE_CHOICES,
        help="how the KV cache stores K and V: auto (the model's dtype), bf16, fp8_e4m3 / fp8_e5m2 (one byte, a "
        "per-layer scale: 1.0 or the checkpoint's k_scale/v_scale), int8 (one byte, one fp32 scale per token "
        f"and KV head): about twice the tokens of a bf16 cache in the same memory (default {d.kv_cache_dtype})",
    )
    g.add_argument(
        "--page-size", type=int, default=d.page_size, help=f"tokens per KV page, a power of two (default {d.page_size})"
    )
    g.add_argument(
        "--disable-radix-cache",
        action="store_true",
        default=d.disable_radix_cache,
        help="turn off prefix caching (every request prefills its whole prompt)",
    )
    g.add_argument(
        "--radix-eviction-policy",
        type=str,
        default=d.radix_eviction_policy,
        choices=EVICTION_POLICY_CHOICES,
        help=f"which cached prefixes are evicted first (default {d.radix_eviction_policy})",
    )
    g.add_argument(
        "--enable-hierarchical-cache",
        action="store_true",
        default=d.enable_hierarchical_cache,
        help="keep prefixes evicted from the KV pool in a host-memory tier and load them "
        "back when a request matches them",
    )
    g.add_argument(
        "--hicache-ratio",
        type=float,
        default=d.hicache_ratio,
        help=f"host tier size in host tokens per KV pool token (default {d.hicache_ratio}); "
        "--hicache-size wins when set",
    )
    g.add_argument(
        "--hicache-size",
        type=float,
        default=d.hicache_size,
        help="host tier size in GB (default 0: use --hicache-ratio)",
    )
    g.add_argument(
        "--hicache-write-policy",
        type=str,
        default=d.hicache_write_policy,
        choices=HICACHE_WRITE_POLICY_CHOICES,
        help="write_through copies a prefix to the host when it is cached, write_back only "
        f"when the KV pool evicts it (default {d.hicache_write_policy})",
    )
    g.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=d.swa_full_tokens_ratio,
        help="models with sliding-window layers: SWA pool tokens per full pool token, in "
        f"(0, 1] (default {d.swa_full_tokens_ratio}); windowed layers keep only each "
        "request's last W tokens",
    )
    g.add_argument(
        "--disable-hybrid-swa-memory",
        action="store_true",
        default=d.disable_hybrid_swa_memory,
        help="keep every layer's KV for the whole sequence (one pool) even when some layers are windowed",
    )


def check_cache_policies(args: MemoryFlags) -> None:
    """--radix-eviction-policy and --hicache-write-policy name policies the caches have."""
    choice("--radix-eviction-policy", args.radix_eviction_policy, EVICTION_POLICY_CHOICES)
    choice("--hicache-write-policy", args.hicache_write_policy, HICACHE_WRITE_POLICY_CHOICES)
    choice("--kv-cache-dtype", args.kv_cache_dtype, KV_CACHE_DTYPE_CHOICES)


def check_page_size(args: MemoryFlags) -> None:
    """Pages are addressed by shifts and masks: a page must be a power of two tokens."""
    if args.page_size < 1 or args.page_size & (args.page_size - 1):
        raise ValueError(f"--page-size must be a power of two >= 1, got {args.page_size}")


def check_mem_fraction(args: MemoryFlags) -> None:
    """A fraction outside (0, 1) leaves no room for the KV cache or for everything else."""
    if args.mem_fraction_static is not None and not 0.0 < args.mem_fraction_static < 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")


def check_cache_tiers(args: MemoryFlags) -> None:
    """The host tier holds what the radix cache evicts (so it needs that cache); both it and the
    sliding-window pool are sized as ratios that must leave them some room."""
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise ValueError("--enable-hierarchical-cache needs the radix cache (drop --disable-radix-cache)")
    if not args.hicache_ratio > 0:
        raise ValueError(f"--hicache-ratio must be > 0, got {args.hicache_ratio}")
    if not 0.0 < args.swa_full_tokens_ratio <= 1.0:
        raise ValueError(f"--swa-full-tokens-ratio must be in (0, 1], got {args.swa_full_tokens_ratio}")
    if not args.hicache_size >= 0:
        raise ValueError(f"--hicache-size must be >= 0 (GB), got {args.hicache_size}")
