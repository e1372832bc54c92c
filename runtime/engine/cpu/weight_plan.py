"""One linear weight's plan on CPU (``CpuWeightPlan``): which kernel runs it at each row count,
decided once, here, and read by both paths that multiply by it.

A CPU weight can run on several kernels (``prepacked`` lays the copies out and calls the C code):

- ``blocks``: the weight's quantized blocks through ``quant_linear_f32`` (``quant_kernels``): every
  row count for a weight kept quantized (below ``BF16_DENSE_MIN_ROWS`` for one marked ``bf16_prefill``),
  up to ``BLOCK_ROWS_MAX`` rows for a dense weight that keeps its blocks beside it (``--quantization
  gguf_dual``); fp32 or bf16 activations (bf16 on ``quant_linear_bf16`` where the build has it);
- ``dequantized_bf16``: a ``bf16_prefill`` weight's products of more rows, on the weight dequantized
  to bf16 for oneDNN (``quant_kernels``: no set of the one-call stack runs it);
- ``amx`` / ``dp``: bf16, up to ``AMX_LINEAR_MAX_ROWS`` rows, on oneDNN's packed copy where it is in
  the layout ``amx_linear_bf16`` (AMX tiles) or ``dp_linear_bf16`` (AVX512-BF16 dot products) reads;
- ``f32``: fp32, the rows of ``fp32_panel_rows()``, on the panel copy (``linear_f32``);
- ``onednn``: half precision at any row count, oneDNN's own kernel on its packed copy;
- anything the plan does not cover: ``F.linear`` (or, for a weight kept quantized, its dequantized
  reference).

A plan is an ordered list of ``KernelBand`` s (kernel, row counts, activation dtype, operand, address):
a product of ``n`` rows tries each band that covers ``n`` in order (a kernel that declines its
operands at run time hands on to the next: ``CpuOps``), and the one-call decode stack
(``decode_layers``) runs a step only where every linear's first band for the step's rows is of one
kernel set (``stack_kernels``) and that set runs in this process (``stack_runs``). So the two paths
cannot disagree on which kernel a weight's product of ``n`` rows takes: they read one record.

Ownership: a plan is made by ``CpuOps.prepare_model`` for each ``LinearWeightLayer`` and kept by the
layer (``LinearWeightLayer.plan``), which drops it when its weight is written again; the plan holds the
packed copy (the only reference to it), so the copy lives exactly as long as the plan.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.engine.cpu import attention_kernels_f32 as attn_f32
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.prepacked import (
    AMX_LINEAR_MAX_ROWS,
    AMX_TILES,
    DP_PAIRS,
    PANELS,
    PackedCopy,
    amx_linear,
    amx_linear_silu_mul,
    dp_linear,
    fp32_panel_rows,
    onednn_linear,
    pack_weight,
    panel_linear,
    unpacked,
)
from runtime.engine.cpu.quant_kernels import BF16_DENSE_MIN_ROWS, BLOCK_ROWS_MAX, quant_linear
from runtime.engine.ops.linear_weights import LinearWeightLayer, WeightPlan, values_released
from runtime.engine.quant.weight import KEPT_WEIGHTS, KeptWeight, weight_blocks

logger = logging.getLogger(__name__)

ANY_ROWS = range(0, sys.maxsize)
# The kernel sets of the one-call decode stack (csrc/decode_layers.c's entry points), by the
# activations' dtype they take; a set's linears are one kernel of a plan's bands.
STACK_DTYPES = {
    "amx": torch.bfloat16,
    "dp": torch.bfloat16,
    "qbf16": torch.bfloat16,
    "f32": torch.float32,
    "qf32": torch.float32,
}
QUANT_SETS = ("qf32", "qbf16")  # the sets whose linears read blocks
# A sparse layer's router that no set's kernel reads (too few experts for a packed copy: Mixtral's 8)
# runs products of these rows (decode steps) on the plain dot kernel (csrc/moe_mlp.c: moe_router_*)
# on both paths, the layers' (CpuOps.moe_route) and the one-call stack's; larger ones keep F.linear.
DOT_ROUTER_ROWS = range(1, AMX_LINEAR_MAX_ROWS + 1)


@dataclass(frozen=True, eq=False)
class KernelBand:
    """One kernel's share of a weight's products: the row counts it takes, the activations' dtype
    (None: fp32 or bf16, which the blocks' kernel takes alike), what it reads (a ``PackedCopy`` or a
    weight kept quantized, one ``QuantizedWeight`` or its ``QuantizedBands``, kept alive here) and the
    address the C kernels read (0: none)."""

    kernel: str  # "blocks", "dequantized_bf16", "amx", "dp", "f32" or "onednn"
    rows: range
    dtype: torch.dtype | None
    operand: PackedCopy | KeptWeight
    address: int = 0

    def takes(self, rows: int, dtype: torch.dtype) -> bool:
        return rows in self.rows and (self.dtype is None or self.dtype == dtype)


@dataclass(frozen=True, eq=False)
class CpuWeightPlan(WeightPlan):
    """How a ``[out, in]`` weight runs on this CPU at each row count (see the module doc); identity
    compares (a new plan is a new weight state)."""

    weight: torch.Tensor | KeptWeight  # the weight as its layer holds it (the source of truth)
    bands: tuple[KernelBand, ...]  # in the order tried

    def band(self, rows: int, dtype: torch.dtype) -> KernelBand | None:
        """The first band that takes a product of ``rows`` rows of ``dtype`` activations (None: F.linear)."""
        for band in self.bands:
            if band.takes(rows, dtype):
                return band
        return None

    def band_of(self, kernel: str) -> KernelBand | None:
        """The band of ``kernel``, if the plan has one."""
        return next((band for band in self.bands if band.kernel == kernel), None)

    def weight_values(self) -> torch.Tensor | None:
        """The dense values the packed copy of our bf16 kernels holds (``prepacked.unpacked``)."""
        copy = next(
            (b.operand for b in self.bands if b.kernel in ("amx", "dp") and isinstance(b.operand, PackedCopy)), None
        )
        return unpacked(copy) if copy is not None else None

    @property
    def path(self) -> str:
        """The kernel report's name of what runs this weight (``kernel_report``)."""
        kernels = [band.kernel for band in self.bands]
        if isinstance(self.weight, KEPT_WEIGHTS):
            return f"kept_{self.weight.source}"
        dense = _DENSE_PATHS.get(next((k for k in kernels if k != "blocks"), ""), "torch")
        blocks = self.band_of("blocks")
        if blocks is not None and isinstance(blocks.operand, KEPT_WEIGHTS):
            return f"kept_{blocks.operand.source}_upto_{blocks.rows.stop - 1}_rows+{dense}"
        return dense


# The report's name of a dense weight's path, by its first band's kernel (no band: "torch").
_DENSE_PATHS = {"amx": "amx_bf16", "dp": "dp_bf16", "onednn": "onednn", "f32": "fp32_panels"}


def plan_weight(weight: torch.Tensor | KeptWeight, blocks: KeptWeight | None = None) -> CpuWeightPlan:
    """The plan for ``weight`` (with its ``blocks`` kept beside it, for a dual weight): packs the
    copy its kernels read. fp32 weights get a panel copy only where ``linear_f32`` runs (else it
    would never be read)."""
    bands: list[KernelBand] = []
    if isinstance(weight, KEPT_WEIGHTS):
        if weight.device.type == "cpu" and weight.bf16_prefill:
            # (the product of many rows is the dequantized weight's in bf16: no kernel set's linear)
            bands.append(KernelBand("blocks", range(0, BF16_DENSE_MIN_ROWS), None, weight))
            bands.append(KernelBand("dequantized_bf16", ANY_ROWS, None, weight))
        elif weight.device.type == "cpu":
            bands.append(KernelBand("blocks", ANY_ROWS, None, weight))
        return CpuWeightPlan(weight, tuple(bands))
    if blocks is not None and blocks.device.type == "cpu":
        bands.append(KernelBand("blocks", range(0, BLOCK_ROWS_MAX + 1), None, blocks))
    panel_rows = fp32_panel_rows()
    packed = pack_weight(weight) if weight.dtype != torch.float32 or len(panel_rows) else None
    if packed is None:
        return CpuWeightPlan(weight, tuple(bands))
    if packed.layout == PANELS:
        bands.append(KernelBand("f32", panel_rows, torch.float32, packed, packed.address))
        return CpuWeightPlan(weight, tuple(bands))
    decode_rows = range(1, AMX_LINEAR_MAX_ROWS + 1)
    if packed.layout == AMX_TILES:
        bands.append(KernelBand("amx", decode_rows, torch.bfloat16, packed, packed.address))
    elif packed.layout == DP_PAIRS:
        bands.append(KernelBand("dp", decode_rows, torch.bfloat16, packed, packed.address))
    bands.append(KernelBand("onednn", ANY_ROWS, weight.dtype, packed))
    return CpuWeightPlan(weight, tuple(bands))


def plan_model(model: nn.Module) -> int:
    """A plan for every ``LinearWeightLayer`` of ``model`` (set as its ``plan``); returns how many
    weights got a packed copy. Call after the weights are loaded (and after every reload)."""
    packed = released = 0
    for module in model.modules():
        if isinstance(module, LinearWeightLayer):
            current = layer_plan(module)
            # (a weight whose values only its plan's copy holds keeps that plan: its values were not
            # written since, or dropping the plan would have given them back)
            plan = current if current is not None and values_released(module.weight) else None
            plan = plan or plan_weight(module.weight, weight_blocks(module))
            module.plan = plan
            packed += any(isinstance(band.operand, PackedCopy) for band in plan.bands)
            if _runs_every_product(plan) and getattr(module, "tied_to", None) is None:
                module.release_values()
                released += 1
    if packed:
        logger.info("prepacked %d linear weights (%d read only through their packed copy)", packed, released)
    return packed


def _runs_every_product(plan: CpuWeightPlan) -> bool:
    """Whether every product of the plan's weight runs on its packed copy, never on the layer's tensor:
    a half-precision weight whose copy our kernels read for a decode batch's rows (so no dot-router
    path reads the tensor: ``dot_router``) and oneDNN for every other row count of its dtype. (An fp32
    weight's prefills stay on F.linear, which reads the tensor.)"""
    weight = plan.weight
    if not isinstance(weight, nn.Parameter) or weight.dtype not in (torch.bfloat16, torch.float16):
        return False
    kernels = {band.kernel for band in plan.bands if isinstance(band.operand, PackedCopy)}
    onednn = plan.band_of("onednn")
    return bool(kernels & {"amx", "dp"}) and onednn is not None and onednn.rows == ANY_ROWS


def packed_bytes(model: nn.Module) -> int:
    """The bytes of the packed copies ``model``'s layers' plans hold (each copy once)."""
    copies: dict[int, PackedCopy] = {}
    for module in model.modules():
        plan = layer_plan(module) if isinstance(module, LinearWeightLayer) else None
        for band in plan.bands if plan is not None else ():
            if isinstance(band.operand, PackedCopy):
                copies[id(band.operand)] = band.operand
    return sum(copy.nbytes for copy in copies.values())


def layer_plan(layer: LinearWeightLayer) -> CpuWeightPlan | None:
    """The CPU plan a layer holds (None: none made yet, or dropped since its weight was written)."""
    plan = layer.plan
    return plan if isinstance(plan, CpuWeightPlan) else None


def stack_kernels(band: KernelBand | None, dtype: torch.dtype) -> str | None:
    """The one-call stack's kernel set whose linear is ``band``'s kernel for ``dtype`` activations
    (None: no set runs it, e.g. oneDNN's or F.linear's products)."""
    if band is None:
        return None
    if band.kernel == "blocks":
        return {torch.float32: "qf32", torch.bfloat16: "qbf16"}.get(dtype)
    return band.kernel if band.kernel in STACK_DTYPES and STACK_DTYPES[band.kernel] == dtype else None


def dot_router(plan: CpuWeightPlan, dtype: torch.dtype) -> bool:
    """Whether a router with this plan runs its products of ``DOT_ROUTER_ROWS`` rows of ``dtype``
    activations on the plain dot kernel: no band of the plan is a kernel set's, and its weight is
    dense, contiguous, of ``dtype``."""
    weight = plan.weight
    return (
        isinstance(weight, torch.Tensor)
        and not values_released(weight)  # (LinearWeightLayer.release_values)
        and weight.dtype == dtype
        and weight.is_contiguous()
        and all(stack_kernels(band, dtype) is None for band in plan.bands)
    )


def stack_runs(kernels: str, lib: Any) -> bool:
    """Whether the set's kernels run in this process as the layers one by one would reach them: the
    linears' (a plan's band can name a kernel a library switch turned off since) and the attention
    kernels the call runs beside them (else the layers take another path: the call must not run)."""
    if kernels == "amx":
        return lib.tinyserve_amx(-1) == 1
    if kernels in ("dp", "qbf16"):
        # (dp_linear_bf16 declines in other builds, and the bf16 attention kernels are the layers'
        # path only in this one)
        return kernel_library.level() == "avx512bf16"
    return attn_f32.applies()  # (f32, qf32)


def plan_linear(
    plan: CpuWeightPlan, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool = False
) -> torch.Tensor | None:
    """``F.linear(x, plan.weight, bias)`` (fp32 with ``float_out``) on the first of the plan's bands
    for ``x``'s rows whose kernel takes the operands; None where none does (the caller's F.linear)."""
    rows = x.numel() // max(x.shape[-1], 1)
    for band in plan.bands:
        if band.takes(rows, x.dtype):
            out = _run_band(band, x, bias, float_out)
            if out is not None:
                return out
    return None


def unplanned_linear(
    x: torch.Tensor, weight: torch.Tensor | KeptWeight, bias: torch.Tensor | None, float_out: bool = False
) -> torch.Tensor | None:
    """A product no plan covers (one made before ``prepare_model``, or after a load dropped the plan):
    a weight kept quantized still runs on its kernel; a dense one on F.linear (None)."""
    if isinstance(weight, KEPT_WEIGHTS):
        return quant_linear(x, weight, bias, float_out=float_out)
    return None


def plan_linear_silu_mul(plan: CpuWeightPlan, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``silu(gate) * up`` of a merged gate/up product in one pass, where the plan's band for ``x``'s
    rows is the AMX kernel (which fuses the two); None: run the product, then the activation."""
    band = plan.band(x.numel() // max(x.shape[-1], 1), x.dtype)
    if band is None or band.kernel != "amx" or not isinstance(band.operand, PackedCopy):
        return None
    return amx_linear_silu_mul(x, band.operand, bias)


def _run_band(band: KernelBand, x: torch.Tensor, bias: torch.Tensor | None, float_out: bool) -> torch.Tensor | None:
    operand = band.operand
    if isinstance(operand, KEPT_WEIGHTS):
        return quant_linear(x, operand, bias, float_out=float_out)
    if band.kernel == "f32":
        return panel_linear(x, operand.tensor, bias, operand.out_features)
    if band.kernel == "amx":
        return amx_linear(x, operand, bias, float_out)
    if band.kernel == "dp":
        return dp_linear(x, operand, bias, float_out)
    out = onednn_linear(x, operand, bias)
    return out.float() if float_out else out
