"""``CpuOps``: the device-ops seam on CPU.

Each op goes to its C kernel (``runtime.engine.cpu.kernels``) under exactly the conditions the
kernel states (dtype, packed heads, sizes within its bounds, the library built), and to the plain
torch op otherwise. A linear runs as its weight's plan says (``runtime.engine.cpu.weight_plan``:
made by ``prepare_model``, owned by the layer, handed back with every product).
bf16 takes each of them. fp32 (what an AVX2-only host serves in, and what the equivalence
tests compare with transformers) takes the fp32 kernels of RMSNorm, silu*mul and rotary,
which keep torch's fp32 formulas (RMSNorm and rotary bit-identical, silu*mul within a few ulp),
the byte-exact KV row copy and the argmax; its linears take the fp32 panel kernel on the
weights' panel copies for a decode batch's rows, where it beats ``F.linear`` (within a few
fp32 epsilons of ``sum |x * w|`` of it, see ``prepacked``). An encoder's LayerNorm and GELU are
torch's own (vectorised ATen kernels: ``TorchOps``); its linears take the plans as any others.
A quantized KV cache (``--kv-cache-dtype``) is written by the C quantizing store
(``runtime.engine.cpu.kv_quant_kernels``: the bytes of the pool's own, reference, store).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from memory.kv_format import KVCacheFormat
from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.cpu import kv_quant_kernels, lora_kernels
from runtime.engine.cpu.decode_layers import CpuLayerStack
from runtime.engine.cpu.host_memory import CPU_PLATFORM, keep_freed_memory_in_process, release_freed_memory
from runtime.engine.cpu.kernel_report import describe, kernel_report
from runtime.engine.cpu.weight_plan import (
    DOT_ROUTER_ROWS,
    CpuWeightPlan,
    dot_router,
    packed_bytes,
    plan_linear,
    plan_linear_silu_mul,
    plan_model,
    unplanned_linear,
)
from runtime.engine.ops.experts import ExpertRouting
from runtime.engine.ops.layer_stack import DecoderStackModel, LayerStack
from runtime.engine.ops.linear_weights import WeightPlan, values_released
from runtime.engine.ops.lora import LoraSegments, LoraWeights
from runtime.engine.ops.rope import RopeInputs
from runtime.engine.ops.torch_ops import TorchOps, rope_cos_sin, rotate_half_
from runtime.engine.platform import ServingPlatform
from runtime.engine.quant.weight import KeptWeight

logger = logging.getLogger(__name__)


class CpuOps(TorchOps):
    name = "cpu"

    def prepare_process(self) -> None:
        if not keep_freed_memory_in_process():
            logger.info("mallopt is unavailable: large CPU activations are allocated with mmap")

    def platform(self, device: torch.device) -> ServingPlatform:
        return CPU_PLATFORM

    def prepare_model(self, model: nn.Module) -> None:
        plan_model(model)  # every linear layer's plan: which kernel at which rows, with its packed copy
        release_freed_memory()  # (the load's transient arrays: see its doc)

    def prepared_bytes(self, model: nn.Module) -> int:
        return packed_bytes(model)  # (each linear's packed copy; a released weight's only values)

    def layer_stack(self, model: DecoderStackModel) -> LayerStack | None:
        return CpuLayerStack(model)

    def kernel_report(
        self, model: nn.Module, stack: LayerStack | None, kv_format: KVCacheFormat | None = None
    ) -> dict[str, Any]:
        report = kernel_report(model, stack, kv_format)
        return {"ops": self.name, **report, "summary": describe(report)}

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        current = _current(plan, weight)
        out = plan_linear(current, x, bias) if current is not None else unplanned_linear(x, weight, bias)
        return out if out is not None else super().linear(x, _readable(weight), bias)

    def float_linear(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None = None
    ) -> torch.Tensor:
        current = _current(plan, weight)
        if current is not None:
            out = plan_linear(current, x, None, float_out=True)
        else:
            out = unplanned_linear(x, weight, None, float_out=True)
        return out if out is not None else super().float_linear(x, _readable(weight))

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        fused = cpu_kernels.rms_norm(x, residual, weight, eps)  # one pass, torch's roundings
        return fused if fused is not None else super().rms_norm(x, weight, eps, residual)

    def moe_route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        plan: WeightPlan | None,
        top_k: int,
        renormalize: bool,
        in_model_dtype: bool,
    ) -> ExpertRouting:
        """The router's product and the routing as the one-call decode stack runs them (csrc/moe_mlp.c):
        the product on the plan's kernel, or for a decode step's rows of a router no kernel set reads,
        the plain dot kernel (``dot_router``); the routing kernel (softmax, top-k) on its logits."""
        logits = self._router_product(x, weight, plan)
        routed = cpu_kernels.moe_route(logits, top_k, renormalize)
        if routed is None:
            return super().moe_route(x, weight, plan, top_k, renormalize, in_model_dtype)
        ids, weights = routed
        return ExpertRouting(ids=ids, weights=weights.to(logits.dtype) if in_model_dtype else weights)

    def moe_shared_gate(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None
    ) -> torch.Tensor:
        """The gate as the one-call decode stack runs it (csrc/moe_mlp.c): its product as a router's
        (the plain dot kernel for a decode step's rows where no kernel set reads it), the sigmoid
        kernel on the logits."""
        logits = self._router_product(x, weight, plan)
        gate = cpu_kernels.sigmoid(logits)
        return gate if gate is not None else torch.sigmoid(logits)

    def _router_product(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None
    ) -> torch.Tensor:
        """A routing projection's ``linear(x, weight)`` as the one-call decode stack computes it: on the
        plan's kernel, or for a decode step's rows of a weight no kernel set reads, the plain dot kernel
        (``dot_router``)."""
        current = _current(plan, weight)
        rows = x.numel() // max(x.shape[-1], 1)
        if current is not None and rows in DOT_ROUTER_ROWS and dot_router(current, x.dtype) and x.dim() == 2:
            assert isinstance(weight, torch.Tensor)  # (dot_router)
            logits = cpu_kernels.router_logits(x, weight)
            if logits is not None:
                return logits
        return self.linear(x, weight, None, plan)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
        cos, sin = rope_cos_sin(rope, q.dtype)
        rotary_dim = rope.cache.rotary_dim
        joint = _adjacent_heads(q, k)  # q and k as one run of a fused qkv output: one call for both
        for x in (q, k) if joint is None else (joint,):
            if not cpu_kernels.rotary_(x, cos, sin, rotary_dim):
                rotate_half_(x, cos, sin, rotary_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernels.silu_and_mul(x)
        return fused if fused is not None else super().silu_and_mul(x)

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernels.gelu_tanh_and_mul(x)  # (the one-call decode stack's kernel too)
        return fused if fused is not None else super().gelu_tanh_and_mul(x)

    def linear_silu_and_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        current = _current(plan, weight)
        fused = plan_linear_silu_mul(current, x, bias) if current is not None else None  # AMX: one pass
        return fused if fused is not None else super().linear_silu_and_mul(x, weight, bias, plan)

    def lora_add(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
        if not lora_kernels.lora_add(out, x, weights, segments):  # csrc/lora.c: fp32 and bf16
            super().lora_add(out, x, weights, segments)

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        if pool.format.quantized:  # quantized in C, the bytes of the pool's own (reference) store
            k_scale, v_scale = pool.k_scales[layer_id], pool.v_scales[layer_id]
            stored = kv_quant_kernels.store_kv(k_buf, v_buf, pool.format, k_scale, v_scale, loc, k, v)
        else:
            stored = cpu_kernels.store_kv(k_buf, v_buf, loc, k, v)
        if not stored:
            super().store_kv(pool, layer_id, loc, k, v)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        ids = cpu_kernels.argmax_rows(logits)
        return ids if ids is not None else super().argmax_rows(logits)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        import xgrammar  # the grammar engine's own CPU kernel (constrained requests only)

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows, backend="cpu")


def _readable(weight: torch.Tensor | KeptWeight) -> torch.Tensor | KeptWeight:
    """``weight`` for a product off its plan; an error where its values live only in the plan's copy
    (``LinearWeightLayer.release_values``: no plan should leave such a product to F.linear)."""
    if values_released(weight):
        raise RuntimeError(
            f"a {tuple(weight.shape)} weight's values are held only by its packed copy, which this product does not run on"
        )
    return weight


def _current(plan: WeightPlan | None, weight: torch.Tensor | KeptWeight) -> CpuWeightPlan | None:
    """``plan`` where it is a CPU plan for this very weight (a layer hands its own; a plan of another
    weight is never read), else None."""
    return plan if isinstance(plan, CpuWeightPlan) and plan.weight is weight else None


def _adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``q`` and ``k`` as one ``[T, Hq + Hkv, D]`` view when k's heads directly follow q's in
    every token row (the fused qkv output's layout), else None."""
    if q.dim() != 3 or k.dim() != 3 or q.dtype != k.dtype or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        return None
    if q.stride() != k.stride() or q.stride(1) != q.shape[2] or q.stride(2) != 1:
        return None
    if k.data_ptr() != q.data_ptr() + q.shape[1] * q.stride(1) * q.element_size():
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
