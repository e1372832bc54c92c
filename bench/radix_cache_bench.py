"""Radix-cache match+insert throughput for requests that share system prompts.

Workload: ``--prompts`` system prompts of ``--prefix-len`` tokens; each of ``--requests``
requests is one of them (chosen at random) plus a unique ``--suffix-len`` suffix. Per
request: ``match_prefix``, allocate slots for the unmatched tail (evicting when the
pool is short), ``insert``. The table reports the time spent in match + insert alone and
the whole loop (with allocation and eviction). Run:

    .venv/bin/python bench/radix_cache_bench.py
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from memory.allocator import BaseTokenToKVPoolAllocator, PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator  # noqa: E402
from memory.radix_cache import RadixCache  # noqa: E402
from memory.req_to_token_pool import ReqToTokenPool  # noqa: E402


def make_requests(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    vocab = 32000
    systems = [[rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.prompts)]
    return [rng.choice(systems) + [rng.randrange(vocab) for _ in range(args.suffix_len)] for _ in range(args.requests)]


def run(requests: list[list[int]], page_size: int, pool_tokens: int, policy: str) -> dict[str, float]:
    alloc: BaseTokenToKVPoolAllocator
    if page_size == 1:
        alloc = TokenToKVPoolAllocator(pool_tokens, "cpu")
    else:
        alloc = PagedTokenToKVPoolAllocator(pool_tokens, page_size, "cpu")
    cache = RadixCache(ReqToTokenPool(1, 8, "cpu"), alloc, page_size=page_size, eviction_policy=policy)  # type: ignore[arg-type]
    tree_time = 0.0
    evicted = 0
    start = time.perf_counter()
    for key in requests:
        t0 = time.perf_counter()
        m = cache.match_prefix(key)
        tree_time += time.perf_counter() - t0
        prefix = m.device_indices
        need = (len(key) - prefix.numel() + page_size - 1) // page_size * page_size
        cache.inc_lock_ref(m.last_node)  # the matched prefix must survive our own eviction
        if alloc.available_size() < need:
            evicted += cache.evict(need - alloc.available_size())
        new = alloc.alloc(need)
        cache.dec_lock_ref(m.last_node)
        assert new is not None, "pool too small for one request"
        value = torch.cat((prefix, new[: len(key) - prefix.numel()]))
        t0 = time.perf_counter()
        present = cache.insert(key, value)
        tree_time += time.perf_counter() - t0
        aligned = len(key) // page_size * page_size
        assert present == prefix.numel(), (present, prefix.numel())
        alloc.free(new[aligned - prefix.numel() :])  # the unaligned tail (paged) is not cached
    wall = time.perf_counter() - start
    stats = cache.hit_stats()
    n = len(requests)
    tokens = sum(len(k) for k in requests)
    return {
        "req_s_tree": n / tree_time,
        "tok_s_tree": tokens / tree_time,
        "req_s_all": n / wall,
        "hit_rate": stats.hit_rate,
        "evicted": evicted,
        "cached": cache.total_size(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--prefix-len", type=int, default=256)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--pool-tokens",
        type=int,
        nargs="+",
        default=[1 << 20, 1 << 16],
        help="KV pool sizes (the smaller one forces eviction)",
    )
    ap.add_argument("--policy", choices=["lru", "lfu"], default="lru")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    requests = make_requests(args)
    print(
        f"{args.requests} requests = {args.prompts} system prompts x {args.prefix_len} tokens + unique {args.suffix_len}-token suffix;"
        f" policy {args.policy}; torch {torch.__version__}, cpu"
    )
    header = f"{'page':>4} {'pool tokens':>11} | {'match+insert req/s':>18} {'tokens/s':>11} | {'loop req/s':>10} | {'hit rate':>8} {'evicted':>9} {'cached':>8}"
    print(header)
    print("-" * len(header))
    for page_size in args.page_sizes:
        for pool in args.pool_tokens:
            r = run(requests, page_size, pool, args.policy)
            print(
                f"{page_size:>4} {pool:>11} | {r['req_s_tree']:>18,.0f} {r['tok_s_tree']:>11,.0f} | {r['req_s_all']:>10,.0f} |"
                f" {r['hit_rate']:>8.3f} {int(r['evicted']):>9} {int(r['cached']):>8}"
            )


if __name__ == "__main__":
    main()
