"""How many requests at a long context fit in one KV memory budget: hybrid SWA pools vs one full pool.

The model is the bench checkpoint's shape (``bench.checkpoint.BENCH_SPEC``: 12 layers, 4 KV
heads of 64) with a window of ``--window`` tokens in every other layer; only its KV layout
matters here, so no weights are built. The budget is ``--budget-requests`` full-length
requests of a full-attention cache (``--budget-requests * --context`` tokens in every
layer); the hybrid layout splits the same bytes into a full pool and an SWA pool of
``--swa-full-tokens-ratio`` times its size (``memory.swa_kv_pool.swa_pool_sizes``, what the
model runner does).

Requests run the memory lifecycle the scheduler drives, through the real allocator and prefix
cache (``SWATokenToKVPoolAllocator`` + ``SWAChunkCache`` or ``SWARadixCache``): each request is
prefilled in chunks of ``--chunk`` (one chunked prefill at a time, as the scheduler runs them),
SWA slots that left the window are freed after every step, then all requests decode together
until each holds ``--context`` tokens. The figure is the largest number of requests for which
every allocation succeeds, against the full-attention cache's ``--budget-requests``.

    .venv/bin/python bench/swa_capacity.py                      # 4096-token contexts, window 256
    .venv/bin/python bench/swa_capacity.py --context 512 --window 32 --budget-requests 4 --chunk 64   # smoke
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.checkpoint import BENCH_SPEC  # noqa: E402
from bench.common import default_output_path, print_table, write_json  # noqa: E402
from memory.req_state import SimpleCacheRequest  # noqa: E402
from memory.req_to_token_pool import ReqToTokenPool  # noqa: E402
from memory.swa_allocator import SWATokenToKVPoolAllocator  # noqa: E402
from memory.swa_chunk_cache import SWAChunkCache  # noqa: E402
from memory.swa_kv_pool import swa_pool_sizes  # noqa: E402
from memory.swa_radix_cache import SWARadixCache  # noqa: E402


def fits(num_requests: int, full_size: int, swa_size: int, args: argparse.Namespace) -> bool:
    """Whether ``num_requests`` requests reach ``args.context`` tokens each in these pools."""
    alloc = SWATokenToKVPoolAllocator(full_size, swa_size, torch.zeros(full_size + 1, dtype=torch.int64), "cpu")
    pool = ReqToTokenPool(num_requests + 1, args.context + 8, "cpu")
    cache: Any = SWARadixCache(pool, alloc, args.window) if args.radix else SWAChunkCache(pool, alloc, args.window)
    prompt_len = args.context - args.decode
    reqs = []
    for r in range(num_requests):
        prompt = [r * args.context + i for i in range(prompt_len)]  # unique: no prefix sharing
        req = SimpleCacheRequest(prompt)
        if not cache.attach_rows([req]):
            return False
        row = req.cache_handle.req_pool_idx
        done = 0
        while done < prompt_len:  # chunked prefill, one request at a time
            n = min(args.chunk, prompt_len - done)
            slots = alloc.alloc(n)
            if slots is None:
                return False
            pool.write(row, done, slots.to(torch.int32))
            done += n
            req.fill_ids = prompt[:done]
            cache.cache_unfinished_req(req)
            cache.free_out_of_window(req, done)
        reqs.append(req)
    for step in range(args.decode):  # every request decodes together
        slots = alloc.alloc(len(reqs))
        if slots is None:
            return False
        for req, slot in zip(reqs, slots.tolist()):
            pos = prompt_len + step
            pool.req_to_token[req.cache_handle.req_pool_idx, pos] = slot
            cache.free_out_of_window(req, pos + 1)
    return True


def max_requests(full_size: int, swa_size: int, args: argparse.Namespace) -> int:
    """The largest count that fits (``fits`` is monotone in the count): grow, then bisect."""
    lo, hi = 0, 1
    while fits(hi, full_size, swa_size, args):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid, full_size, swa_size, args) else (lo, mid)
    return lo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=4096, help="tokens per request at the end (default 4096)")
    parser.add_argument("--decode", type=int, default=256, help="of which generated one by one (default 256)")
    parser.add_argument("--window", type=int, default=256, help="window of the windowed layers (default 256)")
    parser.add_argument(
        "--budget-requests",
        type=int,
        default=16,
        help="the KV budget, in full-length requests of a full-attention cache (default 16)",
    )
    parser.add_argument("--swa-full-tokens-ratio", type=float, default=0.125, help="SWA / full pool size (0.125)")
    parser.add_argument("--chunk", type=int, default=512, help="chunked prefill size (default 512)")
    parser.add_argument("--radix", action="store_true", help="the radix cache instead of the chunk cache")
    parser.add_argument(
        "--output", default=None, help="JSON path (default bench/results/swa_capacity_<cache>_<time>.json)"
    )
    args = parser.parse_args()
    layers = BENCH_SPEC.num_layers
    swa_layers = layers // 2  # every other layer windowed
    budget_tokens = args.budget_requests * args.context
    full_size, swa_size = swa_pool_sizes(budget_tokens, args.swa_full_tokens_ratio, layers - swa_layers, swa_layers)
    head_bytes = 2 * BENCH_SPEC.num_kv_heads * (BENCH_SPEC.hidden_size // BENCH_SPEC.num_heads) * 2  # K+V, bf16
    hybrid = max_requests(full_size, swa_size, args)
    result = {
        "context": args.context,
        "window": args.window,
        "windowed_layers": f"{swa_layers}/{layers}",
        "cache": "radix" if args.radix else "chunk",
        "kv_bytes": budget_tokens * layers * head_bytes,
        "hybrid_bytes": (full_size * (layers - swa_layers) + swa_size * swa_layers) * head_bytes,
        "full_attention_requests": args.budget_requests,
        "full_pool_tokens": full_size,
        "swa_pool_tokens": swa_size,
        "hybrid_requests": hybrid,
        "ratio": round(hybrid / args.budget_requests, 3),
    }
    print_table(
        [result],
        [
            ("context", "context"),
            ("window", "window"),
            ("windowed_layers", "windowed layers"),
            ("cache", "cache"),
            ("full_attention_requests", "full-attention requests"),
            ("hybrid_requests", "hybrid SWA requests"),
            ("ratio", "ratio"),
            ("full_pool_tokens", "full pool tokens"),
            ("swa_pool_tokens", "SWA pool tokens"),
        ],
        title="requests that reach the context in the same KV bytes",
    )
    out = write_json(args.output or default_output_path("swa_capacity", result["cache"]), result)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
