"""What the CPU path chose for a model, and why: the kernels' build level and what picked it, each
linear weight's kernel, whether a decode step runs as the one C call, and the KV cache's format with
what writes and reads it (a quantized cache: its codes stored and attended in C). The model runner logs it
at start-up and ``server_info`` carries it (``weights.kernels``), so that a user, a benchmark note
or a bug report says which code served, rather than which code a CPU of that name would run.

Read from what was actually set up (the packed copies and their layouts, the quantized weights,
the layer stack's description), never recomputed from the CPU flags: a weight oneDNN declined to
pack, or a model the one-call stack declined, shows as such.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from torch import nn

from memory.kv_format import KVCacheFormat
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.decode_layers import CpuLayerStack
from runtime.engine.cpu.kv_quant_kernels import format_code
from runtime.engine.cpu.weight_plan import QUANT_SETS, CpuWeightPlan, layer_plan
from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.quant.weight import KEPT_WEIGHTS, KeptWeight, QuantizedWeight

# Each linear path's name in the report, with what runs it.
PATHS = {
    "amx_bf16": "bf16 on AMX tiles (csrc/amx_linear.c) for decode rows, oneDNN for prefill",
    "dp_bf16": "bf16 on AVX512-BF16 dot products (csrc/dp_linear.c) for decode rows, oneDNN for prefill",
    "onednn": "oneDNN on a prepacked copy",
    "fp32_panels": "fp32 column panels (csrc/linear_f32.c) for decode rows, MKL for prefill",
    "torch": "F.linear (no packed copy: the kernel cannot read this weight here)",
}
# What writes and reads a quantized KV cache's codes on this path.
KV_CACHE_KERNELS = "stored by csrc/kv_quant.c, attended as codes by csrc/attention_q8.c (decode mirror kept quantized)"


def isa_reason() -> str:
    """Why the kernels run at the level they do."""
    level = kernel_library.level()
    if level is None:
        return "TINYSERVE_CPU_KERNELS=0 turned them off"
    best = kernel_library.host_levels()[0]
    if level == best:
        return "the best level this CPU runs"
    if os.environ.get("TINYSERVE_CPU_ISA", "").strip().lower() == level:
        return f"TINYSERVE_CPU_ISA={level}; this CPU runs up to {best}"
    return f"chosen in this process; this CPU runs up to {best}"


def linear_plans(model: nn.Module) -> list[tuple[torch.Tensor | KeptWeight, CpuWeightPlan | None]]:
    """Each linear weight of ``model`` with its plan (None: the layer holds none), each weight once
    (a tied LM head's is the embedding's), in module order."""
    seen: set[int] = set()
    plans: list[tuple[torch.Tensor | KeptWeight, CpuWeightPlan | None]] = []
    for module in model.modules():
        if isinstance(module, LinearWeightLayer) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            plans.append((module.weight, layer_plan(module)))
    return plans


def linear_path(weight: torch.Tensor | KeptWeight, plan: CpuWeightPlan | None) -> str:
    """The report's name of the path a linear with this weight and plan takes for a decode step."""
    if plan is not None:
        return plan.path
    return f"kept_{weight.source}" if isinstance(weight, KEPT_WEIGHTS) else "torch"


def kernel_report(model: nn.Module, stack: Any, kv_format: KVCacheFormat | None = None) -> dict[str, Any]:
    """The CPU's choices for ``model`` (after ``prepare_model``), ``stack`` its layer stack, ``kv_format``
    its KV cache's format (``kv_cache``: what writes and reads it)."""
    level = kernel_library.level()
    built = level is not None and kernel_library.load() is not None
    plans = linear_plans(model)
    # each weight once: the linears' by their plans, and the other weights kept quantized (an
    # embedding's; a dual weight's blocks are reported with its plan; a weight in bands, once as a
    # whole: kept_Q4_K+Q6_K)
    reported = {id(weight) for weight, _ in plans}
    reported |= {id(band.operand) for _, plan in plans if plan is not None for band in plan.bands}
    reported |= {
        id(part) for m in model.modules() if id(m) in reported and isinstance(m, KEPT_WEIGHTS) for _, part in m.bands()
    }
    kept = {id(m): m for m in model.modules() if isinstance(m, QuantizedWeight) and id(m) not in reported}
    paths = Counter(linear_path(weight, plan) for weight, plan in plans)
    paths.update(f"kept_{weight.source}" for weight in kept.values())
    layer_stack = stack if isinstance(stack, CpuLayerStack) and built else None
    few_rows = layer_stack.description(1) if layer_stack is not None else None
    decode_stack = few_rows.kernels if few_rows is not None else None
    # a set reading blocks up to some rows (a dual weight's BLOCK_ROWS_MAX; a bf16_prefill weight's few-row
    # kernel): what takes the steps above
    if (
        layer_stack is not None
        and few_rows is not None
        and few_rows.kernels in QUANT_SETS
        and few_rows.rows.stop < 1 << 40
    ):
        above = layer_stack.description(few_rows.rows.stop)
        last = few_rows.rows.stop - 1
        decode_stack = f"{few_rows.kernels} up to {last} rows, {above.kernels if above else 'layer by layer'} above"
    return {
        "isa": level if built else None,
        "isa_reason": isa_reason() if built or level is None else "no C compiler: the kernels' work runs as torch ops",
        "host_levels": list(kernel_library.host_levels()),
        "linears": dict(sorted(paths.items())),
        "decode_stack": decode_stack,
        "kv_cache": kv_cache_report(kv_format, built),
    }


def kv_cache_report(kv_format: KVCacheFormat | None, built: bool) -> dict[str, Any] | None:
    """The KV cache's format and, quantized, what writes and reads its codes (None: not said)."""
    if kv_format is None:
        return None
    quantized = kv_format.quantized and format_code(kv_format) is not None
    return {
        "dtype": kv_format.name,
        "description": kv_format.describe(),
        "kernels": KV_CACHE_KERNELS if quantized and built else None,
    }


def describe(report: dict[str, Any]) -> str:
    """The report as one log line."""
    linears = ", ".join(f"{count} {path}" for path, count in report["linears"].items()) or "none"
    stack = report["decode_stack"]
    kv = report.get("kv_cache")
    kv_line = ""
    if kv is not None:
        kv_line = f"; KV cache: {kv['description']}" + (f", {kv['kernels']}" if kv["kernels"] else "")
    return (
        f"CPU kernels {report['isa'] or 'off'} ({report['isa_reason']}; this CPU: {', '.join(report['host_levels'])}); "
        f"linear weights: {linears}; decode step: "
        + (
            f"one C call (kernels: {stack})"
            if stack
            else "layer by layer (the one-call stack does not take this model)"
        )
        + kv_line
    )
