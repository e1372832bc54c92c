"""``TritonOps``: the device-ops seam on cuda, through the Triton kernels of
``runtime.engine.cuda.kernels`` (falling back to the torch op where a kernel does not take a
layout). Linears stay cuBLAS (``F.linear``), except weights kept quantized (``--quantization``:
the dequantizing matmul of ``runtime.engine.cuda.quant_matmul``), and greedy argmax, an encoder's
LayerNorm and its GELU stay torch's.
A mixture of experts' routed experts run in the fused kernel (``runtime.engine.cuda.moe_kernels``)
on their weights stacked once at ``prepare_model`` (each expert's parameters then view its rows of
the stack: one copy in memory); experts kept quantized run the plain expert loop, eagerly.
Multi-LoRA's adapter products run in the segmented shrink and expand kernels of
``runtime.engine.cuda.lora_kernels``.

The kernel module is imported on first use, after ``prepare_triton_for_device``: on a CPU
(tests, under Triton's interpreter) that is what switches the interpreter on.
"""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from runtime.engine.cuda.triton_common import prepare_triton_for_device
from runtime.engine.ops.experts import ExpertLayer, ExpertRouting
from runtime.engine.ops.linear_weights import WeightPlan
from runtime.engine.ops.lora import LoraSegments, LoraWeights
from runtime.engine.ops.rope import RopeCache, RopeInputs
from runtime.engine.ops.torch_ops import TorchOps
from runtime.engine.quant.weight import KEPT_WEIGHTS, KeptWeight, QuantizedWeight


class StackedExperts(NamedTuple):
    """A sparse MLP layer's local experts as the fused kernel reads them."""

    w13: torch.Tensor  # [E_local, 2 * I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor  # [E_local, H, I]
    expert_map: torch.Tensor | None  # int32 [E]: global id -> local index, -1 elsewhere; None: all local


class TritonOps(TorchOps):
    name = "triton"

    def __init__(self) -> None:
        self._module: ModuleType | None = None
        # each expert layer's stacked weights (made by prepare_model; gone with the layer)
        self._stacked: weakref.WeakKeyDictionary[ExpertLayer, StackedExperts] = weakref.WeakKeyDictionary()

    def prepare_model(self, model: nn.Module) -> None:
        for module in model.modules():
            # The Triton kernel reads fp32 scales: a K-quant's super-block form is expanded once, here
            # (a reload refills the plain tensors: runtime.engine.quant.loading).
            if isinstance(module, QuantizedWeight):
                module.expand_scales_()
            # A layer stacked already keeps its stack: a reload wrote through its experts' views into
            # it, and captured CUDA graphs read that stack.
            if isinstance(module, ExpertLayer) and module not in self._stacked:
                stacked = stack_experts(module)
                if stacked is not None:
                    self._stacked[module] = stacked

    def graph_safe(self, model: nn.Module) -> bool:
        return all(m in self._stacked for m in model.modules() if isinstance(m, ExpertLayer))

    def moe_experts(self, x: torch.Tensor, routing: ExpertRouting, experts: ExpertLayer) -> torch.Tensor:
        stacked = self._stacked.get(experts)
        if stacked is None or stacked.w13.dtype != x.dtype:
            return super().moe_experts(x, routing, experts)
        self._kernels(x.device)  # (switches the interpreter on for CPU tensors first)
        from runtime.engine.cuda.moe_kernels import fused_experts

        return fused_experts(
            x, stacked.w13, stacked.w2, routing.weights, routing.ids, experts.activation, stacked.expert_map
        )

    def _kernels(self, device: torch.device) -> ModuleType:
        if self._module is None:
            prepare_triton_for_device(device)
            from runtime.engine.cuda import kernels

            self._module = kernels
        return self._module

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        if isinstance(weight, KEPT_WEIGHTS):
            self._kernels(x.device)  # (switches the interpreter on for CPU tensors first)
            from runtime.engine.cuda.quant_matmul import quant_matmul

            return quant_matmul(x, weight, bias)
        return super().linear(x, weight, bias, plan)

    def float_linear(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None = None
    ) -> torch.Tensor:
        if isinstance(weight, KEPT_WEIGHTS):
            self._kernels(x.device)
            from runtime.engine.cuda.quant_matmul import quant_matmul

            return quant_matmul(x, weight, None, out_dtype=torch.float32)
        return super().float_linear(x, weight, plan)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self._kernels(x.device).rms_norm(x, weight, eps, residual)
        return out if out is not None else super().rms_norm(x, weight, eps, residual)

    def rope(self, cache: RopeCache, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        return RopeInputs(positions, cache)  # the kernel reads the fp32 tables at the positions itself

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
        cache = rope.cache
        if not self._kernels(q.device).rotary_(
            q, k, rope.positions, cache.cos_cache, cache.sin_cache, cache.rotary_dim
        ):
            super().rotary_(q, k, rope)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = self._kernels(x.device).silu_and_mul(x)
        return out if out is not None else super().silu_and_mul(x)

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        k_scale, v_scale = pool.k_scales[layer_id], pool.v_scales[layer_id]
        if not self._kernels(k.device).store_kv(k_buf, v_buf, loc, k, v, pool.format, k_scale, v_scale):
            super().store_kv(pool, layer_id, loc, k, v)

    def lora_add(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
        self._kernels(x.device)  # (switches the interpreter on for CPU tensors first)
        from runtime.engine.cuda import lora_kernels

        lora_kernels.lora_add(out, x, weights, segments)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        import xgrammar  # the grammar engine's own Triton kernel (constrained requests only)

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows, backend="triton")


def stack_experts(layer: ExpertLayer) -> StackedExperts | None:
    """``layer``'s local experts stacked for the fused kernel, their parameters re-pointed at the
    stack's rows (a later load writes through them into it); None when any expert is kept quantized."""
    pairs = [layer.expert_weights(e) for e in layer.local_experts]
    dense = [(g, d) for g, d in pairs if not isinstance(g, KEPT_WEIGHTS) and not isinstance(d, KEPT_WEIGHTS)]
    if not dense or len(dense) != len(pairs):
        return None
    w13 = torch.stack([g.detach() for g, _ in dense])
    w2 = torch.stack([d.detach() for _, d in dense])
    for i, (gate_up, down) in enumerate(dense):
        gate_up.data, down.data = w13[i], w2[i]
    expert_map = None
    if len(layer.local_experts) != layer.num_experts:
        expert_map = torch.full((layer.num_experts,), -1, dtype=torch.int32, device=w13.device)
        first = layer.local_experts.start
        expert_map[first : first + len(layer.local_experts)] = torch.arange(
            len(layer.local_experts), dtype=torch.int32, device=w13.device
        )
    return StackedExperts(w13, w2, expert_map)
