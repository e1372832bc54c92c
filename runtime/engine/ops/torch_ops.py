"""The plain torch implementation of the device ops: what every other implementation must
equal (up to rounding), and what runs where no faster one applies.

The roundings follow transformers' Llama/Qwen modules op for op, so fp32 results are
bit-identical to them: RMSNorm computes its statistics in fp32 and casts back before the
weight multiply; rotary rounds each product, then each sum; silu*mul rounds silu's output
before the multiply. An encoder's LayerNorm and exact GELU are the very torch functions that
transformers' ``nn.LayerNorm`` and ``ACT2FN["gelu"]`` call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from memory.kv_format import KVCacheFormat
from runtime.engine.cpu.host_memory import CPU_PLATFORM
from runtime.engine.cuda.memory import CUDA_PLATFORM
from runtime.engine.ops.experts import ExpertLayer, ExpertRouting, route_experts
from runtime.engine.ops.layer_stack import DecoderStackModel, LayerStack
from runtime.engine.ops.linear_weights import WeightPlan
from runtime.engine.ops.lora import LoraSegments, LoraWeights, reference_lora_add
from runtime.engine.ops.rope import RopeCache, RopeInputs
from runtime.engine.platform import ServingPlatform
from runtime.engine.quant.weight import KEPT_WEIGHTS, KeptWeight, embedding_rows, reference_linear


class TorchOps:
    """``DeviceOps`` in plain torch ops; the CPU and Triton implementations subclass it and
    fall back to it where their kernels do not apply."""

    name = "torch"

    def prepare_process(self) -> None:
        return None

    def platform(self, device: torch.device) -> ServingPlatform:
        # the plain ops (and the Triton ones, interpreted in tests) run on either device
        return CPU_PLATFORM if device.type == "cpu" else CUDA_PLATFORM

    def prepare_model(self, model: nn.Module) -> None:
        return None

    def prepared_bytes(self, model: nn.Module) -> int:
        return 0  # (nothing laid out beside the weights)

    def graph_safe(self, model: nn.Module) -> bool:
        # the expert loop reads each layer's routing on the host
        return not any(isinstance(m, ExpertLayer) for m in model.modules())

    def layer_stack(self, model: DecoderStackModel) -> LayerStack | None:
        return None  # the model runs its layers one by one

    def kernel_report(
        self, model: nn.Module, stack: LayerStack | None, kv_format: KVCacheFormat | None = None
    ) -> dict[str, Any]:
        return {"ops": self.name, "summary": f"{self.name} ops: plain torch"}

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        if isinstance(weight, KEPT_WEIGHTS):
            return reference_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def lora_add(self, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
        reference_lora_add(out, x, weights, segments)

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | KeptWeight, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(weight, KEPT_WEIGHTS):
            return embedding_rows(ids, weight, dtype)
        return F.embedding(ids, weight)

    def float_linear(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None = None
    ) -> torch.Tensor:
        return self.linear(x, weight, None, plan).float()

    def linear_silu_and_mul(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        bias: torch.Tensor | None,
        plan: WeightPlan | None = None,
    ) -> torch.Tensor:
        return self.silu_and_mul(self.linear(x, weight, bias, plan))

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        if residual is not None:
            residual.add_(x)
            x = residual  # read below, never written: the caller keeps it as the residual stream
        if x.dtype == torch.float32:
            # x.float() would alias x: stay out of place.
            return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
        xf = x.float()  # a private copy: scaled in place (the same products as transformers)
        xf.mul_(torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
        return weight * xf.to(x.dtype)

    def layer_norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)  # (torch's, as transformers' nn.LayerNorm)

    def rope(self, cache: RopeCache, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        cos, sin = cache.cos_sin(positions, dtype)
        return RopeInputs(positions, cache, cos, sin)

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
        cos, sin = rope_cos_sin(rope, q.dtype)
        for x in (q, k):
            rotate_half_(x, cos, sin, rope.cache.rotary_dim)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # silu's fresh output takes the product: one temporary

    def gelu_tanh_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)  # as transformers' GELUTanh, then the product

    def gelu(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)  # as transformers' ACT2FN["gelu"]

    def moe_route(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | KeptWeight,
        plan: WeightPlan | None,
        top_k: int,
        renormalize: bool,
        in_model_dtype: bool,
    ) -> ExpertRouting:
        return route_experts(self.linear(x, weight, None, plan), top_k, renormalize, in_model_dtype)

    def moe_shared_gate(
        self, x: torch.Tensor, weight: torch.Tensor | KeptWeight, plan: WeightPlan | None
    ) -> torch.Tensor:
        return torch.sigmoid(self.linear(x, weight, None, plan))

    def moe_experts(self, x: torch.Tensor, routing: ExpertRouting, experts: ExpertLayer) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_token_experts(x, routing, experts)
        # the (token, choice) pairs sorted by expert once; then one product per routed expert over its tokens
        top_k = routing.ids.shape[1]
        order = torch.argsort(routing.ids.reshape(-1), stable=True)
        counts = torch.bincount(routing.ids.reshape(-1), minlength=experts.num_experts).tolist()
        flat_weights = routing.weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            pairs, start = order[start : start + count], start + count
            if count == 0 or expert not in experts.local_experts:
                continue
            gate_up, down = experts.expert_weights(expert)
            gate_up_plan, down_plan = experts.expert_plans(expert)
            tokens = pairs // top_k
            hidden = experts.act_and_mul(self, x.index_select(0, tokens), gate_up, None, gate_up_plan)
            weighted = self.linear(hidden, down, None, down_plan) * flat_weights.index_select(0, pairs).unsqueeze(1)
            out.index_add_(0, tokens, weighted.to(x.dtype))
        return out

    def _one_token_experts(self, x: torch.Tensor, routing: ExpertRouting, experts: ExpertLayer) -> torch.Tensor:
        """``moe_experts`` of one token (a decode step of one request): no grouping, no scatter; the
        same products and the same additions in the same (ascending expert) order."""
        ids = routing.ids[0].tolist()
        weights = routing.weights.reshape(-1, 1)
        out = torch.zeros_like(x)
        for choice in sorted(range(len(ids)), key=ids.__getitem__):
            if ids[choice] not in experts.local_experts:
                continue
            gate_up, down = experts.expert_weights(ids[choice])
            gate_up_plan, down_plan = experts.expert_plans(ids[choice])
            hidden = experts.act_and_mul(self, x, gate_up, None, gate_up_plan)
            out.add_((self.linear(hidden, down, None, down_plan) * weights[choice]).to(x.dtype))
        return out

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool.set_kv_buffer(layer_id, loc, k, v)

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1).to(torch.int64)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        index = (
            torch.arange(logits.shape[0], device=logits.device)
            if rows is None
            else torch.tensor(rows, dtype=torch.int64, device=logits.device)
        )
        cols = logits.shape[1]
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        words = bitmask.index_select(0, index)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :cols].bool()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def rope_cos_sin(rope: RopeInputs, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's ``cos``/``sin`` rows ``[T, 1, rotary_dim // 2]`` in ``dtype``: those ``rope``
    carries where its ops gathered them up front, else gathered now."""
    if rope.cos is not None and rope.sin is not None:
        return rope.cos, rope.sin
    return rope.cache.cos_sin(rope.positions, dtype)


def rotate_half_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
    """``x [T, heads, D]`` (any strides) rotated in place by ``cos``/``sin`` ``[T, 1, rotary_dim // 2]``.

    ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``: each product rounded, then the sum, the
    same operations as transformers' ``q * cos + rotate_half(q) * sin``, so fp32 results are
    bit-identical to it. The new first half is built aside while the second half is rotated
    in place (it still reads the old first half), then copied in.
    """
    half = rotary_dim // 2
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    new_x1 = x1 * cos
    new_x1.sub_(x2 * sin)
    x2.mul_(cos).add_(x1 * sin)
    x1.copy_(new_x1)
