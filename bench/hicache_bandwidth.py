"""Load-back bandwidth of the hierarchical cache against the machine's plain copy rate.

Builds a device KV pool and a host pool of one model's KV shape (Llama-3.2-1B by default: 16
layers, 8 KV heads of 64, bf16), then times

- ``copy``: one contiguous pinned host tensor of the same bytes copied to the device (on cuda:
  the card's measured host->device rate; on cpu: a memcpy);
- ``load``: ``KVTransfer.to_device`` of ``--tokens`` tokens from scattered host pages into
  scattered device pages (the hierarchical cache's load-back: gather into pinned staging,
  upload on the copy stream, scatter into the pool), waited for;
- ``backup``: ``KVTransfer.to_host`` of the same slots (device -> host).

GB/s counts KV bytes moved (``tokens x bytes_per_token``); each figure is the median of
``--repeat`` timings, and ``load / copy`` says how close load-back gets to the plain copy.

    python -m bench.hicache_bandwidth --device cuda               # the figure for docs/benchmarks.md
    python -m bench.hicache_bandwidth --device cpu --tokens 512   # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from bench.common import default_output_path, device_sync, machine_info, print_table, write_json
from memory.host_pool import HostKVPool
from memory.kv_pool import MHATokenToKVPool
from memory.kv_transfer import make_kv_transfer

SHAPES = {"llama-1b": (16, 8, 64), "tiny": (2, 2, 32)}  # layers, KV heads, head dim


def _timed(fn: Callable[[], Any], device: torch.device, repeat: int) -> float:
    """Median seconds of ``fn`` (one warm-up call first), with the device synced around each call."""
    fn()
    device_sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        device_sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    device: torch.device,
    shape: tuple[int, int, int],
    tokens: int,
    page_size: int,
    dtype: torch.dtype,
    repeat: int,
    seed: int = 0,
) -> list[dict[str, Any]]:
    layers, heads, dim = shape
    pool_tokens = 2 * tokens  # room to scatter: every other page is used
    pool = MHATokenToKVPool(pool_tokens, page_size, dtype, layers, heads, dim, device)
    host = HostKVPool(pool, pool_tokens)
    transfer = make_kv_transfer(pool, host)
    gen = torch.Generator().manual_seed(seed)
    pages = pool_tokens // page_size

    def slots() -> torch.Tensor:
        picked = torch.randperm(pages, generator=gen)[: tokens // page_size] + 1  # page 0 is padding
        return (picked[:, None] * page_size + torch.arange(page_size)).reshape(-1)

    host_idx, dev_idx = slots(), slots().to(device)
    nbytes = tokens * pool.bytes_per_token()
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    rows = []
    for name, fn in (
        ("copy", lambda: dst.copy_(src, non_blocking=True)),
        ("load", lambda: transfer.to_device(host_idx, dev_idx).wait()),
        ("backup", lambda: transfer.to_host(dev_idx, host_idx).wait()),
    ):
        seconds = _timed(fn, device, repeat)
        rows.append(
            {
                "op": name,
                "tokens": tokens,
                "mib": nbytes / (1 << 20),
                "ms": seconds * 1e3,
                "gb_s": nbytes / seconds / 1e9,
            }
        )
    copy_rate = rows[0]["gb_s"]
    for row in rows:
        row["of_copy"] = row["gb_s"] / copy_rate
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="llama-1b")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens moved per copy (default 16384)")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    tokens = args.tokens // args.page_size * args.page_size
    rows = measure(device, SHAPES[args.shape], tokens, args.page_size, getattr(torch, args.dtype), args.repeat)
    print_table(
        rows,
        [("op", "op"), ("tokens", "tokens"), ("mib", "MiB"), ("ms", "ms"), ("gb_s", "GB/s"), ("of_copy", "of copy")],
        title=f"hierarchical cache transfers on {device} ({args.shape})",
    )
    out = write_json(
        args.output or default_output_path("hicache_bandwidth", args.shape),
        {
            "kind": "hicache_bandwidth",
            "device": str(device),
            "shape": args.shape,
            "page_size": args.page_size,
            "dtype": args.dtype,
            "rows": rows,
            "machine": machine_info(),
        },
    )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
