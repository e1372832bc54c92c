"""Prefill attention on CPU (bf16): the C kernel against the matmul path and torch's flash kernel.

Each shape is ``n`` prompts of ``L`` new tokens with no cached keys, the bench model's heads
(16 query heads, 4 KV heads, head dim 64), q/k/v as strided views of one fused qkv output as
the model has them. Paths, timed one after another on the same inputs:

- ``C kernel``: ``attn_kernels.causal_attention`` (what the torch-native backend runs);
- ``matmul path``: ``fastpaths.matmul_causal_attention`` (bf16 GEMMs around the C row
  softmax; where the kernel does not apply);
- ``flash``: ``F.scaled_dot_product_attention(is_causal=True)`` (torch's CPU flash kernel).

GFLOPS count the causal half of QK^T and PV. Run:

    .venv/bin/python -m bench.cpu_prefill_attention [--shapes 64x128 16x512 ...] [--repeat 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, pin_threads, print_table, write_json  # noqa: E402
from runtime.engine.cpu import attention_fastpaths as fastpaths  # noqa: E402
from runtime.engine.cpu import attention_kernels as attn_kernels  # noqa: E402
from runtime.engine.cpu.host_memory import keep_freed_memory_in_process  # noqa: E402

DEFAULT_SHAPES = ("64x128", "16x512", "4x2048", "256x32")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="NxL: N prompts of L tokens")
    p.add_argument("--num-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--skip-flash", action="store_true", help="leave out torch's flash kernel (slow at long L)")
    p.add_argument("--threads", type=int, default=None, help="intra-op threads (default: one per allowed cpu)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: bench/results/)")
    p.add_argument("--no-json", action="store_true")
    return p.parse_args(argv)


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    """Median wall-clock milliseconds of ``repeat`` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(n: int, length: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(n * 100_003 + length)
    qkv = torch.randn(n * length, (h + 2 * hkv) * d, generator=gen).bfloat16()
    q = qkv[:, : h * d].view(n, length, h, d)
    k = qkv[:, h * d : (h + hkv) * d].view(n, length, hkv, d)
    v = qkv[:, (h + hkv) * d :].view(n, length, hkv, d)
    scale = d**-0.5
    paths: dict[str, Callable[[], Any]] = {
        "C kernel": lambda: attn_kernels.causal_attention(q, k, v, scale),
        "matmul path": lambda: fastpaths.matmul_causal_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale),
    }
    if not args.skip_flash:
        paths["flash"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
        )
    if attn_kernels.causal_attention(q, k, v, scale) is None:
        del paths["C kernel"]  # no AVX-512 or no compiler here: the backend runs the matmul path
    flops = 4.0 * n * h * d * length * (length + 1) / 2
    rows = []
    with torch.inference_mode():
        times = {name: median_ms(fn, args.repeat) for name, fn in paths.items()}
    base = times["matmul path"]
    for name, ms in times.items():
        rows.append(
            {"shape": f"{n}x{length}", "path": name, "ms": ms, "gflops": flops / ms / 1e6, "vs_matmul": base / ms}
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pinning = pin_threads(args.threads)
    keep_freed_memory_in_process()  # as the runtime runs: no page faults on each fresh activation
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        n, length = (int(x) for x in shape.lower().split("x"))
        rows.extend(measure(n, length, args))
    print_table(
        rows,
        [
            ("shape", "N x L"),
            ("path", "path"),
            ("ms", "ms / layer"),
            ("gflops", "GFLOPS"),
            ("vs_matmul", "speed-up vs matmul path"),
        ],
        title=f"prefill attention, bf16, {args.num_heads}/{args.num_kv_heads} heads, head dim {args.head_dim}"
        f" (medians of {args.repeat})",
    )
    if not args.no_json:
        path = args.json or default_output_path("cpu_prefill_attention", "cpu")
        write_json(path, {"kind": "cpu_prefill_attention", "machine": machine_info(pinning), "rows": rows})
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
