"""One merged linear whose parts come in different GGUF block formats, kept in bands or dense.

A Q4_K_M file stores q/k in Q4_K and v in Q6_K on about half the layers (llama.cpp's
``use_more_bits``). Until such a merged linear was kept as row bands (``QuantizedBands``) it loaded
dense: fp32 where the CPU has no native bf16. This times one such qkv at Qwen2.5-1.5B's shape
(hidden 1536, 12 query heads and 2 KV heads of 128: ``[1536 + 256 + 256, 1536]``), through each
weight's CPU plan (``weight_plan.plan_linear``: what a layer's product runs), for:

- ``dense_f32``: the dequantized weight in fp32 (the old fallback; fp32 panels at decode rows);
- ``bands``: q/k as Q4_K (q4) and v as Q6_K (int8, a scale per 16), weight-only numerics;
- ``bands_a8``: the same bands with int8 activations (``--quantized-activations int8``);
- ``q4k``: the whole weight in Q4_K, what a file of one format gives (the floor of the bands' bytes).

The blocks are random (the kernels' time does not depend on the values). Decode sizes stream the
weight from memory as a model's layers do: calls cycle through copies that together exceed
``--stream-mib``. Timed in this thread's CPU time with one thread (the default; a busy neighbour on
a shared host barely moves it), else in wall-clock time; each figure the median of ``--repeat``
samples of ~20 ms.

    .venv/bin/python -m bench.cpu_banded_linear
    .venv/bin/python -m bench.cpu_banded_linear --m 1 4 --threads 2
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

Q_ROWS, KV_ROWS, HIDDEN = 1536, 256, 1536  # Qwen2.5-1.5B: 12 x 128 query rows, 2 x 128 per k and v
SAMPLE_SECONDS = 0.02
VARIANTS = ("dense_f32", "bands", "bands_a8", "q4k")
GGUF_BYTES_PER_VALUE = {"Q4_K": 144 / 256, "Q6_K": 210 / 256}  # the file's own blocks


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", nargs="+", type=int, default=[1, 4, 16], help="rows (tokens) per call")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--stream-mib", type=float, default=256.0, help="copies cycled through per variant")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: timed in CPU time)")
    return p.parse_args(argv)


def _q4(rows: int, gen: Any) -> Any:
    import torch

    from runtime.engine.quant.weight import QuantizedWeight

    qs = torch.randint(0, 256, (rows, HIDDEN // 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    scales = torch.rand(rows, HIDDEN // 32, generator=gen) * 0.002
    mins = -torch.rand(rows, HIDDEN // 32, generator=gen) * 0.015
    return QuantizedWeight("q4", "Q4_K", (rows, HIDDEN), qs, scales, mins)


def _q6(rows: int, gen: Any) -> Any:
    import torch

    from runtime.engine.quant.weight import QuantizedWeight

    qs = torch.randint(-32, 32, (rows, HIDDEN), generator=gen, dtype=torch.int32).to(torch.int8)
    scales = torch.rand(rows, HIDDEN // 16, generator=gen) * 0.001
    return QuantizedWeight("q8", "Q6_K", (rows, HIDDEN), qs, scales, group=16)


def make_weights(gen: Any) -> dict[str, Any]:
    """One copy of each variant's weight (the int8-activation bands share the bands' tensors)."""
    from runtime.engine.quant.weight import QuantizedBands, QuantizedWeight

    bands = QuantizedBands([_q4(Q_ROWS + KV_ROWS, gen), _q6(KV_ROWS, gen)])
    bands_a8 = QuantizedBands(
        [
            QuantizedWeight(p.kind, p.source, p.shape, p.qs, p.scales, p.mins, p.group, supers=p.supers)
            for p in bands.weights()
        ]
    )
    bands_a8.int8_activations = True
    return {
        "dense_f32": bands.dequantize(),
        "bands": bands,
        "bands_a8": bands_a8,
        "q4k": _q4(Q_ROWS + 2 * KV_ROWS, gen),
    }


def weight_bytes(weight: Any) -> int:
    return weight.nbytes() if hasattr(weight, "nbytes") and callable(weight.nbytes) else weight.numel() * 4


def measure(m: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from runtime.engine.cpu.weight_plan import plan_linear, plan_weight

    gen = torch.Generator().manual_seed(m)
    first = make_weights(gen)
    copies = max(1, math.ceil(args.stream_mib * 2**20 / weight_bytes(first["bands"])))
    sets = [first] + [make_weights(gen) for _ in range(copies - 1)]
    plans = [{v: plan_weight(weights[v]) for v in VARIANTS} for weights in sets]
    x = torch.randn(m, HIDDEN, generator=gen)
    calls_of: dict[str, Callable[[int], Any]] = {
        v: (lambda i, v=v: plan_linear(plans[i % copies][v], x, None)) for v in VARIANTS
    }
    row: dict[str, Any] = {"m": m, "copies": copies}
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    with torch.inference_mode():
        ref = calls_of["dense_f32"](0)
        for v in ("bands", "bands_a8"):
            row[f"{v}_diff"] = float((calls_of[v](0) - ref).abs().max())
        calls = {}
        for v in VARIANTS:
            for i in range(copies):
                start = clock()
                calls_of[v](i)
            calls[v] = max(1, round(SAMPLE_SECONDS / max(clock() - start, 1e-7)))
        samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        turn = 0
        for _ in range(args.repeat):
            for v in VARIANTS:
                start = clock()
                for i in range(calls[v]):
                    calls_of[v](turn + i)
                samples[v].append((clock() - start) / calls[v])
                turn += calls[v]
    for v in VARIANTS:
        row[f"{v}_us"] = statistics.median(samples[v]) * 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    weights = make_weights(torch.Generator().manual_seed(0))
    gguf = int(Q_ROWS * HIDDEN * GGUF_BYTES_PER_VALUE["Q4_K"] + 2 * KV_ROWS * HIDDEN * GGUF_BYTES_PER_VALUE["Q4_K"])
    gguf_bands = int(
        (Q_ROWS + KV_ROWS) * HIDDEN * GGUF_BYTES_PER_VALUE["Q4_K"] + KV_ROWS * HIDDEN * GGUF_BYTES_PER_VALUE["Q6_K"]
    )
    print(f"qkv [{Q_ROWS + 2 * KV_ROWS}, {HIDDEN}] (Qwen2.5-1.5B), {args.threads} thread(s)")
    print(
        f"  resident bytes: dense fp32 {weight_bytes(weights['dense_f32']):,}, bands {weight_bytes(weights['bands']):,} "
        f"(file {gguf_bands:,}), all Q4_K {weight_bytes(weights['q4k']):,} (file {gguf:,})"
    )
    print("  m  " + "".join(f"{v + ' us':>14}" for v in VARIANTS) + f"{'bands x':>9}{'diff':>10}{'diff a8':>10}")
    for m in args.m:
        row = measure(m, args)
        speedup = row["dense_f32_us"] / row["bands_us"]
        print(
            f"{m:>3}  "
            + "".join(f"{row[v + '_us']:>14.1f}" for v in VARIANTS)
            + f"{speedup:>9.2f}{row['bands_diff']:>10.1e}{row['bands_a8_diff']:>10.1e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
