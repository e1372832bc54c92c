"""What a device's expert kernels read of a mixture-of-experts layer: ``ExpertLayer`` and
``ExpertRouting``, handed across the device-ops seam by ``DeviceOps.moe_experts``.

A sparse MLP layer routes each token to ``top_k`` of its experts; the device then runs every
routed expert this rank holds over the tokens routed to it and sums their weighted outputs. The
layer (``runtime.engine.layers.moe``) owns the experts' weights and names them here per expert,
so that a device never reads the layer's attribute names: the plain ops run each expert's
projections through ``DeviceOps.linear`` (a CPU's prepacked or kept-quantized weights included),
a GPU's fused kernel reads them stacked (``runtime.engine.cuda``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from runtime.engine.ops.linear_weights import WeightPlan
from runtime.engine.quant.weight import KeptWeight

ExpertWeight = torch.Tensor | KeptWeight
# ``act(gate) * up`` of ``linear(x, weight, bias, plan)`` through the given device ops (the first argument,
# a ``DeviceOps``): a gated MLP's activation choice (``runtime.engine.layers.choices``)
ExpertActivation = Callable[[Any, torch.Tensor, ExpertWeight, "torch.Tensor | None", "WeightPlan | None"], torch.Tensor]


@dataclass(frozen=True)
class ExpertRouting:
    """Each token's chosen experts and their weights, as the router made them."""

    ids: torch.Tensor  # int64 [T, top_k]: global expert ids, in the router's (top-k) order
    weights: torch.Tensor  # [T, top_k]: fp32, or the model's dtype (Family.MoeKeys.weights_in_model_dtype)


def route_experts(logits: torch.Tensor, top_k: int, renormalize: bool, in_model_dtype: bool) -> ExpertRouting:
    """Each token's ``top_k`` experts from its router ``logits [T, E]`` (the model's dtype), as
    transformers' routers choose them: softmax in fp32, ``torch.topk`` (ties broken as it breaks them),
    renormalised to sum to 1 if asked, rounded to ``logits``' dtype if ``in_model_dtype``: the plain
    meaning of ``DeviceOps.moe_route``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    if in_model_dtype:
        weights = weights.to(logits.dtype)
    return ExpertRouting(ids=ids, weights=weights)


class ExpertLayer(nn.Module):
    """A sparse MLP layer's routed experts on this rank (a marker base, so that a device finds them
    without importing the layers): ``num_experts`` in the whole model, of which this rank holds
    ``local_experts`` whole (all of them unless the experts are split over ranks, ``--ep-size``),
    each a gated MLP whose intermediate dimension may be split over TP ranks like a dense MLP's."""

    num_experts: int
    local_experts: range
    activation: str  # the experts' gated activation's name (a layer choice: runtime.engine.layers.choices)
    act_and_mul: ExpertActivation  # ... and its work, which a device's expert loop calls

    def expert_weights(self, expert: int) -> tuple[ExpertWeight, ExpertWeight]:
        """``(gate_up, down)`` of local expert ``expert`` (a global id): ``[2 * I, H]`` with the gate
        rows first, and ``[H, I]``; dense or kept quantized, read at call time (loading may swap them)."""
        raise NotImplementedError

    def expert_plans(self, expert: int) -> tuple[WeightPlan | None, WeightPlan | None]:
        """The device's plans for ``expert_weights(expert)`` (``DeviceOps.prepare_model`` made them on
        the experts' linear layers), to hand back with each product."""
        raise NotImplementedError
