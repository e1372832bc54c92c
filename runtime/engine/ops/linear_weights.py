"""A linear layer's weight as the device-ops seam sees it: ``LinearWeightLayer`` (the layers whose
weight multiplies activations) and ``WeightPlan`` (a device's decision of how that weight runs).

Why a plan: a device may run one weight on several kernels (a packed copy for a decode batch's
rows, the library's kernel for a prefill, a weight's quantized blocks for a few rows). That choice is
made once, when the device prepares the loaded model (``DeviceOps.prepare_model``), and kept in one
typed record that the layer owns (``LinearWeightLayer.plan``) and hands to every product
(``DeviceOps.linear(..., plan)``); a device's whole-layer kernels read the same records. When a
weight's values are written again its layer drops the plan (``drop_plan``), so a stale copy is never
read, and ``prepare_model`` makes a new one. A device without such choices makes no plans (None).

Why a layer may give its values up (``release_values``): where a device's plan runs every product of
the weight on a copy of its own (the CPU's oneDNN copy of a bf16 weight), the layer's tensor is never
read again, and holding it doubles the weight's memory (Qwen2.5-Coder-1.5B with ``gguf_dual``: 2.9 GB).
The tensor keeps its shape, dtype and device over one element of storage (every stride 0:
``values_released``; a product that would read it raises rather than answer wrong), and ``drop_plan``
gives them back (read from the plan's copy, bit for bit) when the plan goes.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.quant.weight import KeptWeight


class WeightPlan:
    """A device's plan for one linear weight (what its subclass holds is the device's: the CPU's is
    ``runtime.engine.cpu.weight_plan.CpuWeightPlan``). Made by ``DeviceOps.prepare_model``, owned by
    the layer, handed back to the device with every product."""

    __slots__ = ()

    def weight_values(self) -> torch.Tensor | None:
        """The dense weight as the plan's own copy holds it (None: it holds none it can give back), for a
        layer that released its values (``LinearWeightLayer.release_values``)."""
        return None


class LinearWeightLayer(nn.Module):
    """A layer whose ``weight`` multiplies activations through ``DeviceOps.linear`` /
    ``float_linear`` (the linear layers and the LM head): the weights a device may plan for
    (``prepare_model``). A base the device finds them by without importing the layers (which import
    the device ops)."""

    weight: nn.Parameter | KeptWeight  # (kept quantized: see runtime.engine.quant.loading)
    bias: nn.Parameter | None  # (declared here for the type checker; the linear layers set it, the LM head has none)
    plan: WeightPlan | None = None  # the device's plan for ``weight`` (None: none made, or dropped)

    def release_values(self) -> None:
        """Let the plan's copy hold the weight's only values (see the module doc): the device calls it
        for a weight whose every product its plan runs on that copy, and which that copy can give back."""
        weight = self.weight
        if isinstance(weight, nn.Parameter) and not values_released(weight):
            weight.data = weight.data.new_empty(1).expand(weight.shape)

    def weight_values(self) -> torch.Tensor | KeptWeight:
        """The weight's values: its own, or where released, its plan's copy's (a copy, as a new tensor)."""
        if values_released(self.weight) and self.plan is not None:
            values = self.plan.weight_values()
            if values is not None:
                return values
        return self.weight

    def drop_plan(self) -> None:
        """Forget the device's plan: the weight's values are being written again (a load, a reload,
        a swap for its quantized form). ``DeviceOps.prepare_model`` makes a new one. Released values
        come back first, read from the plan's copy (a writer may fill only part of a merged weight)."""
        plan, self.plan = self.plan, None
        weight = self.weight
        if isinstance(weight, nn.Parameter) and values_released(weight):
            values = plan.weight_values() if plan is not None else None
            if values is None:  # (release_values is called only for a plan that gives them back)
                raise RuntimeError(f"a {tuple(weight.shape)} weight's released values have no copy to come back from")
            weight.data = values


def values_released(weight: torch.Tensor | KeptWeight) -> bool:
    """Whether a dense weight's values were given up to its plan's copy (``release_values``)."""
    return isinstance(weight, torch.Tensor) and weight.dim() > 0 and weight.numel() > 1 and not any(weight.stride())


def resident_tensor_bytes(model: nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers, each storage once, less released values (held
    by a device's copy instead: ``DeviceOps.prepared_bytes`` counts those)."""
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        if not values_released(t) and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total
