"""CPU linears: ``F.linear`` against the prepacked-weight variants this torch offers.

Shapes are the bench model's linears (hidden 1024): qkv ``[1536, 1024]``, o ``[1024, 1024]``,
gate_up ``[5632, 1024]``, down ``[1024, 2816]``, lm_head ``[32000, 1024]``, each at decode
sizes (M = 1, 16, 64) and prefill sizes (M = 2048, 8192; the LM head only at decode sizes,
the model computes logits for the sampled rows alone, ``--all-pairs`` times it anyway).
Variants, each on the same input, timed in turn inside every repeat (so a noisy neighbour
slows them alike):

- ``plain``: ``F.linear(x, w)`` (fp32: MKL's sgemm; bf16/fp16: oneDNN, re-laid-out per call);
- ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on a weight reordered once by
  ``_reorder_linear_weight`` (``--batch-hint``), what ``runtime/engine/cpu/prepacked.py`` runs in
  half precision;
- ``amx``: ``prepacked.amx_linear`` (``csrc/amx_linear.c``) on that same oneDNN-packed copy,
  what bf16 calls of up to ``AMX_LINEAR_MAX_ROWS`` rows run on a CPU with AMX;
- ``dp``: ``prepacked.dp_linear`` (``csrc/dp_linear.c``) on the oneDNN-packed copy where oneDNN
  packed it for AVX512-BF16 without AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` on an AMX host),
  what bf16 calls of up to ``AMX_LINEAR_MAX_ROWS`` rows run there;
- ``panel``: ``prepacked.panel_linear`` (``csrc/linear_f32.c``) on the weight's panel copy, what
  fp32 calls of ``fp32_panel_rows`` rows run (timed at every M, inside the band or not);
- ``mkl``: ``torch.ops.mkl._mkl_linear`` on an MKL-packed weight (``cblas_sgemm_pack``,
  fp32 only). torch packs it for one M and falls back to plain ``F.linear`` for any other,
  so it is timed packed for exactly the M of the row: its best case.
- ``q8_0`` / ``q4_1``: ``quant_kernels.quant_linear`` (``csrc/quant_linear.c``) on the weight
  quantized to GGUF Q8_0 / Q4_1 by the ``gguf`` package and kept so (``--quantization gguf``;
  weight-only: the activations as they are), fp32 only; ``q8_0_a8`` / ``q4_1_a8`` the same blocks
  with the activations quantized per block of 32 on the fly below 24 rows
  (``--quantized-activations int8``). Their ``diff`` is the quantization's error (the weight's, and
  the activations' for ``_a8``), not rounding.

A variant this CPU or dtype refuses prints ``-``. ``diff`` is the largest ``|variant - plain|``
over the output and ``rel`` that over ``max |plain|``; 0 means bit-identical.

Timing: with one thread (the default) each call is timed in this thread's CPU time, which a
busy neighbour on a shared host barely moves; with more threads, in wall-clock time. Every
figure is the median of ``--repeat`` samples, a sample being as many calls as fill ~20 ms.
At decode sizes each call reads its weight from memory, not cache, as a model's layers (each
its own weight) do: calls cycle through copies of the weight that together exceed
``--stream-mib``. Prefill sizes reuse one weight over M rows, so one copy serves there.

``--isa avx2`` measures what an AVX2-only host gets: it re-runs this script with
``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2``
set before torch loads (they are read once, at library start), and our kernels' AVX2 build
(``TINYSERVE_CPU_ISA=avx2``). ``ONEDNN_VERBOSE=1`` /
``MKL_VERBOSE=1`` show the ISA each library picked.

    .venv/bin/python -m bench.cpu_linear                       # fp32, this CPU's ISA, 1 thread
    .venv/bin/python -m bench.cpu_linear --isa avx2
    .venv/bin/python -m bench.cpu_linear --dtype bfloat16 --m 1 64 2048
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import default_output_path, machine_info, pin_threads, print_table, write_json  # noqa: E402

SHAPES: dict[str, tuple[int, int]] = {  # name -> (out, in) of the bench model's weight
    "qkv": (1536, 1024),
    "o": (1024, 1024),
    "gate_up": (5632, 1024),
    "down": (1024, 2816),
    "lm_head": (32000, 1024),
}
DECODE_MAX_M = 64  # the LM head runs at most this many rows per step (sampled rows only)
ISA_ENV = {
    "avx2": {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "TINYSERVE_CPU_ISA": "avx2",
    }
}
SAMPLE_SECONDS = 0.02
VARIANTS = ("plain", "onednn", "amx", "dp", "panel", "mkl", "q8_0", "q4_1", "q8_0_a8", "q4_1_a8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--m", nargs="+", type=int, default=[1, 16, 64, 2048, 8192], help="rows (tokens) per call")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument(
        "--isa",
        choices=["native", *ISA_ENV],
        default="native",
        help="cap oneDNN, MKL and ATen at this ISA and use our kernels' build of it "
        "(re-runs the script with their env set)",
    )
    p.add_argument("--batch-hint", type=int, default=64, help="the M oneDNN's reorder is told to expect")
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--stream-mib",
        type=float,
        default=256.0,
        help="cycle through weight copies totalling at least this much (0: one copy, cache-warm)",
    )
    p.add_argument("--all-pairs", action="store_true", help="also time the LM head at prefill sizes")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (1: timed in CPU time)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here (default: bench/results/)")
    p.add_argument("--no-json", action="store_true")
    return p.parse_args(argv)


def isa_env_missing(isa: str) -> dict[str, str]:
    """The variables ``--isa`` needs that this process was not started with."""
    return {k: v for k, v in ISA_ENV.get(isa, {}).items() if os.environ.get(k) != v}


def make_variants(weight: Any, m: int, batch_hint: int) -> dict[str, Callable[[Any], Any] | None]:
    """Per variant, ``x -> x @ weight.T`` through that variant, or None where it cannot run here."""
    import torch
    import torch.nn.functional as F

    variants: dict[str, Callable[[Any], Any] | None] = {"plain": lambda x: F.linear(x, weight)}
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        variants["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        variants["onednn"] = None  # no oneDNN, or it has no kernel for this dtype on this CPU
    variants["amx"] = variants["dp"] = None
    if variants["onednn"] is not None and weight.dtype == torch.bfloat16:
        from runtime.engine.cpu.prepacked import amx_linear, dp_linear, pack_weight

        n_out, n_in = weight.shape
        tagged = pack_weight(weight, batch_hint)  # the same copy, with the layout checks the runtime makes
        for name, kernel in (("amx", amx_linear), ("dp", dp_linear)):
            if tagged is not None and kernel(weight.new_zeros(m, n_in), tagged, None) is not None:  # applies
                variants[name] = lambda x, kernel=kernel: kernel(x, tagged, None)
    variants["panel"] = None
    if weight.dtype == torch.float32:
        from runtime.engine.cpu.prepacked import pack_weight, panel_linear

        n_out, n_in = weight.shape
        copy = pack_weight(weight)
        panels = copy.tensor if copy is not None else None
        if panels is not None and panel_linear(weight.new_zeros(m, n_in), panels, None, n_out) is not None:
            variants["panel"] = lambda x: panel_linear(x, panels, None, n_out)
    variants["mkl"] = None
    if weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        try:
            mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, m)
            variants["mkl"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, weight, None, m)
        except (RuntimeError, AttributeError):
            pass
    for name, type_name, int8 in (
        ("q8_0", "Q8_0", False),
        ("q4_1", "Q4_1", False),
        ("q8_0_a8", "Q8_0", True),
        ("q4_1_a8", "Q4_1", True),
    ):
        variants[name] = None
        if weight.dtype == torch.float32:
            from gguf import GGMLQuantizationType, quantize

            from runtime.engine.cpu.quant_kernels import quant_linear
            from runtime.engine.quant.gguf_blocks import from_gguf

            blocks = from_gguf(quantize(weight.numpy(), GGMLQuantizationType[type_name]), type_name, weight.shape[1])
            blocks.int8_activations = int8
            if quant_linear(weight.new_zeros(m, weight.shape[1]), blocks, None) is not None:
                variants[name] = lambda x, blocks=blocks: quant_linear(x, blocks, None)
    return variants


def diff_vs(ref: Any, got: Any) -> tuple[float, float]:
    """Largest absolute difference, and that over the largest ``|ref|``."""
    d = (got.float() - ref.float()).abs().max().item()
    return d, d / max(ref.float().abs().max().item(), 1e-30)


def measure(name: str, m: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    dtype = getattr(torch, args.dtype)
    n_out, n_in = SHAPES[name]
    gen = torch.Generator().manual_seed(n_out * 7 + n_in)
    weight_bytes = n_out * n_in * torch.finfo(dtype).bits // 8
    streamed = args.stream_mib > 0 and m <= DECODE_MAX_M  # prefill reuses each weight over M rows anyway
    copies = max(1, math.ceil(args.stream_mib * 2**20 / weight_bytes)) if streamed else 1
    weights = [(torch.randn(n_out, n_in, generator=gen) * n_in**-0.5).to(dtype) for _ in range(copies)]
    x = torch.randn(m, n_in, generator=gen).to(dtype)
    per_copy = [make_variants(w, m, args.batch_hint) for w in weights]
    names = [v for v in VARIANTS if per_copy[0][v] is not None]
    row: dict[str, Any] = {"shape": f"{name} {n_out}x{n_in}", "m": m, "copies": copies}
    with torch.inference_mode():
        ref = per_copy[0]["plain"](x)
        for v in names[1:]:
            row[f"{v}_diff"], row[f"{v}_rel"] = diff_vs(ref, per_copy[0][v](x))
        clock = time.thread_time if args.threads == 1 else time.perf_counter
        calls = {}
        for v in names:  # warm up every copy once; size a sample from the last call
            for fns in per_copy:
                start = clock()
                fns[v](x)
            calls[v] = max(1, round(SAMPLE_SECONDS / max(clock() - start, 1e-7)))
        samples: dict[str, list[float]] = {v: [] for v in names}
        turn = 0
        for _ in range(args.repeat):
            for v in names:  # the variants alternate inside every repeat
                start = clock()
                for i in range(calls[v]):
                    per_copy[(turn + i) % copies][v](x)
                samples[v].append((clock() - start) / calls[v])
                turn += calls[v]
    for v in names:
        row[f"{v}_ms"] = statistics.median(samples[v]) * 1e3
        if v != "plain":
            row[f"{v}_speedup"] = row["plain_ms"] / row[f"{v}_ms"]
    row["plain_gflops"] = 2.0 * m * n_out * n_in / row["plain_ms"] / 1e6
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = isa_env_missing(args.isa)
    if missing:  # the libraries read these once when they load: a fresh process is the only way
        cmd = [sys.executable, "-m", "bench.cpu_linear", *(sys.argv[1:] if argv is None else argv)]
        return subprocess.call(cmd, env={**os.environ, **missing}, cwd=Path(__file__).resolve().parent.parent)
    import torch

    pinning = pin_threads(args.threads)
    rows = [
        measure(name, m, args)
        for name in args.shapes
        for m in args.m
        if args.all_pairs or name != "lm_head" or m <= DECODE_MAX_M
    ]
    env = {k: os.environ[k] for k in ISA_ENV["avx2"] if k in os.environ}
    columns = [("shape", "shape"), ("m", "M"), ("plain_ms", "plain ms"), ("plain_gflops", "plain GFLOPS")]
    for v in VARIANTS[1:]:
        columns += [
            (f"{v}_ms", f"{v} ms"),
            (f"{v}_speedup", f"plain/{v}"),
            (f"{v}_diff", f"{v} diff"),
            (f"{v}_rel", f"{v} rel"),
        ]
    clock = "thread CPU time" if args.threads == 1 else "wall-clock time"
    print_table(
        rows,
        columns,
        digits=3,
        title=f"linear x @ W.T, {args.dtype}, {args.threads} thread(s), ISA cap {env or 'none'}"
        f" (ATen: {torch.backends.cpu.get_cpu_capability()}), medians of {args.repeat} in {clock}",
    )
    if not args.no_json:
        path = args.json or default_output_path("cpu_linear", f"{args.dtype}_{args.isa}")
        write_json(
            path,
            {"kind": "cpu_linear", "machine": machine_info(pinning), "args": vars(args), "isa_env": env, "rows": rows},
        )
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
