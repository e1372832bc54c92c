"""CPU fp32 elementwise ops: the C kernels (``csrc/elementwise_f32.c``) against the torch ops they replace.

Ops and shapes are the bench model's (hidden 1024, gate_up 2 x 2816, 16 query + 4 KV heads of
64): RMSNorm with the residual add fused (``[rows, 1024]``), silu*mul (``[rows, 5632]`` in),
rotary in place on the q and k heads of the fused qkv output (``[rows, 1536]``), at a decode
step's rows (64) and a prefill's (8192). ``torch`` is ``TorchOps`` (what ``CpuOps`` ran for
fp32 before), ``kernel`` is ``runtime.engine.cpu.kernels``; both run on the same inputs in turn
inside every repeat, so a noisy neighbour slows them alike.

Timing: one thread (torch's and the kernels' OpenMP), each call timed in this process's CPU
time, which a busy neighbour on a shared host barely moves; freed memory stays in the process
(as in a CPU server: ``keep_freed_memory_in_process``), so outputs are not page-faulted in;
every figure is the median of
``--repeat`` samples, a sample being as many calls as fill ~20 ms.

``--isa avx2`` measures what an AVX2-only host gets: the kernels' AVX2 build
(``TINYSERVE_CPU_ISA``) and torch's AVX2 kernels (``ATEN_CPU_CAPABILITY``), both set here
before torch loads.

    .venv/bin/python -m bench.cpu_elementwise_f32               # this CPU's best level
    .venv/bin/python -m bench.cpu_elementwise_f32 --isa avx2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table  # noqa: E402


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 8192])
    p.add_argument("--repeat", type=int, default=7)
    return p.parse_args()


def _per_call_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    calls = 1
    while True:  # calls per sample: ~20 ms of CPU time
        start = time.process_time()
        for _ in range(calls):
            fn()
        if time.process_time() - start >= 0.02:
            break
        calls *= 2
    samples = []
    for _ in range(repeat):
        start = time.process_time()
        for _ in range(calls):
            fn()
        samples.append((time.process_time() - start) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    args = _parse()
    os.environ["OMP_NUM_THREADS"] = "1"
    if args.isa == "avx2":
        os.environ.update(TINYSERVE_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2")
    import torch

    from runtime.engine.cpu import kernel_library
    from runtime.engine.cpu import kernels as cpu_kernels
    from runtime.engine.cpu.host_memory import keep_freed_memory_in_process
    from runtime.engine.layers.rotary import RotaryEmbedding
    from runtime.engine.ops.torch_ops import TorchOps, rotate_half_
    from runtime.engine.rope_config import RopeConfig

    torch.set_num_threads(1)
    keep_freed_memory_in_process()  # as CpuOps.prepare_process: outputs reuse freed blocks, no page faults
    assert cpu_kernels.available(), "the CPU kernels did not build"
    ref, hidden, inter, heads, kv_heads, d = TorchOps(), 1024, 2816, 16, 4, 64
    rope = RotaryEmbedding(d, 8192, RopeConfig(rope_type="default", theta=10000.0))
    table = []
    for rows in args.rows:
        gen = torch.Generator().manual_seed(rows)
        x, res, w = (
            torch.randn(rows, hidden, generator=gen),
            torch.randn(rows, hidden, generator=gen),
            torch.randn(hidden),
        )
        gate_up = torch.randn(rows, 2 * inter, generator=gen)
        qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
        qk = qkv[:, : (heads + kv_heads) * d].view(rows, heads + kv_heads, d)
        cos, sin = rope.cos_sin(torch.arange(rows) % 8192, torch.float32)
        ops = {
            "rms_norm+residual": (lambda: ref.rms_norm(x, w, 1e-6, res), lambda: cpu_kernels.rms_norm(x, res, w, 1e-6)),
            "silu_and_mul": (lambda: ref.silu_and_mul(gate_up), lambda: cpu_kernels.silu_and_mul(gate_up)),
            "rotary_": (lambda: rotate_half_(qk, cos, sin, d), lambda: cpu_kernels.rotary_(qk, cos, sin, d)),
        }
        for name, (torch_fn, kernel_fn) in ops.items():
            t_us, k_us = _per_call_us(torch_fn, args.repeat), _per_call_us(kernel_fn, args.repeat)
            table.append({"op": name, "rows": rows, "torch_us": t_us, "kernel_us": k_us, "speedup": t_us / k_us})
    print_table(
        table,
        [("op", "op"), ("rows", "rows"), ("torch_us", "torch us"), ("kernel_us", "kernel us"), ("speedup", "x")],
        title=f"fp32, 1 thread, kernels {kernel_library.level()}, torch {torch.backends.cpu.get_cpu_capability()}",
    )


if __name__ == "__main__":
    main()
