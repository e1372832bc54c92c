"""What the device can do, measured: ``MatmulMeter`` times copies and GEMMs at the shapes a model
step runs (weights cycled past the last-level cache), the ceilings ``bench.roofline`` compares a
served run against."""

from __future__ import annotations

import itertools
import math
import time
from typing import Any, Callable

from bench.common import device_sync

# Sizes of the device-wide measurements: past any last-level cache, and a GEMM big enough
# to reach the device's peak (an H100 needs thousands per side; a CPU core count's worth less).
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
PEAK_GEMM_SIZE = {"cuda": 8192, "cpu": 2048}
ROTATE_BYTES = 256 << 20  # weights cycled per measured shape: more than any CPU/GPU last-level cache
MAX_WEIGHT_COPIES = 64


def time_op(
    fn: Callable[[], Any], sync: Callable[[], None], min_time_s: float = 0.2, min_iters: int = 3, max_iters: int = 200
) -> float:
    """Fastest seconds per call of ``fn`` after one warm-up call.

    The fastest call, not the median: a roofline is the best rate the hardware gives,
    and on a shared machine preemption only ever adds time (with cache effects
    excluded by the callers rotating their operands)."""
    fn()
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (len(times) < min_iters or time.perf_counter() - start < min_time_s):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return min(times)


class MatmulMeter:
    """Measures and caches GFLOPS of the shapes asked for (one measurement per shape)."""

    def __init__(self, device: str = "cpu", dtype: str = "bfloat16", min_time_s: float = 0.2) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.min_time_s = min_time_s
        self.cache: dict[tuple[Any, ...], float] = {}
        # per linear shape: (F.linear GFLOPS, oneDNN-prepacked GFLOPS or None where unavailable)
        self.linear_methods: dict[tuple[Any, ...], tuple[float, float | None]] = {}
        self.device_rates: dict[str, float] = {}

    def _sync(self) -> None:
        device_sync(self.device)

    def copy_gbps(self, nbytes: int | None = None) -> float:
        """Memory bandwidth as one ``dst.copy_(src)`` of ``nbytes`` achieves it (read + written, GB/s)."""
        if "copy_gbps" not in self.device_rates:
            n = nbytes or COPY_BYTES.get(self.device.type, COPY_BYTES["cpu"])
            src = self.torch.ones(n, dtype=self.torch.uint8, device=self.device)
            dst = self.torch.empty_like(src)
            sec = time_op(lambda: dst.copy_(src), self._sync, self.min_time_s)
            self.device_rates["copy_bytes"] = float(n)
            self.device_rates["copy_gbps"] = 2.0 * n / sec / 1e9
        return self.device_rates["copy_gbps"]

    def peak_gemm_gflops(self, size: int | None = None) -> float:
        """The dtype's rate on one ``size``-cubed GEMM: the compute ceiling of this device."""
        if "peak_gemm_gflops" not in self.device_rates:
            n = size or PEAK_GEMM_SIZE.get(self.device.type, PEAK_GEMM_SIZE["cpu"])
            self.device_rates["peak_gemm_size"] = float(n)
            self.device_rates["peak_gemm_gflops"] = self.linear_gflops(n, n, n)
        return self.device_rates["peak_gemm_gflops"]

    def _copies(self, nbytes: int) -> int:
        """Weight copies to rotate through so each call reads them from memory, not cache."""
        return max(1, min(MAX_WEIGHT_COPIES, math.ceil(ROTATE_BYTES / max(nbytes, 1))))

    def linear_gflops(self, m: int, k: int, n: int) -> float:
        """[m, k] x [k, n] as ``F.linear(x, W[n, k])``, the way the model runs it.

        In the model every layer's weights are read once per step, so a decode-sized
        matmul that found its weight in cache would overstate the rate: the calls
        rotate through enough weight copies to exceed any last-level cache.

        On CPU the runtime multiplies with prepacked weights where they are faster
        (runtime/engine/cpu/prepacked.py: half precision always, fp32 for a decode batch's rows); the rate
        is the faster of the two, so the roofline stays the best this machine can do.
        """
        key = ("linear", m, k, n)
        if key not in self.cache:
            t = self.torch
            x = t.randn(m, k, device=self.device, dtype=self.dtype)
            ws = [t.randn(n, k, device=self.device, dtype=self.dtype) for _ in range(self._copies(n * k * 2))]
            it = itertools.count()
            with t.inference_mode():
                sec = time_op(lambda: t.nn.functional.linear(x, ws[next(it) % len(ws)]), self._sync, self.min_time_s)
            plain = 2.0 * m * k * n / sec / 1e9
            packed = self._packed_linear_gflops(x, ws)
            self.linear_methods[key] = (plain, packed)
            self.cache[key] = max(plain, packed or 0.0)
        return self.cache[key]

    def _packed_linear_gflops(self, x: Any, ws: list[Any]) -> float | None:
        """The same product through prepacked weights; None where the runtime would not pack."""
        from runtime.engine.cpu.ops import CpuOps
        from runtime.engine.cpu.weight_plan import plan_weight

        if self.device.type != "cpu":
            return None
        plans = [plan_weight(w) for w in ws]
        if not all(plan.bands for plan in plans):  # (a weight nothing packs runs F.linear: no other rate)
            return None
        ops = CpuOps()
        m, k = x.shape
        n = ws[0].shape[0]
        it = itertools.count()
        with self.torch.inference_mode():

            def call() -> Any:
                i = next(it) % len(ws)
                return ops.linear(x, ws[i], None, plans[i])

            sec = time_op(call, self._sync, self.min_time_s)
        return 2.0 * m * k * n / sec / 1e9

    def bmm_gflops(self, b: int, m: int, k: int, n: int) -> float:
        """``b`` independent [m, k] x [k, n] products (attention per KV head; the [k, n]
        side is the KV cache, rotated like the linear weights)."""
        key = ("bmm", b, m, k, n)
        if key not in self.cache:
            t = self.torch
            x = t.randn(b, m, k, device=self.device, dtype=self.dtype)
            ys = [t.randn(b, k, n, device=self.device, dtype=self.dtype) for _ in range(self._copies(b * k * n * 2))]
            it = itertools.count()
            with t.inference_mode():
                sec = time_op(lambda: t.bmm(x, ys[next(it) % len(ys)]), self._sync, self.min_time_s)
            self.cache[key] = 2.0 * b * m * k * n / sec / 1e9
        return self.cache[key]
