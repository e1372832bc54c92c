"""A linear layer's weight as the device-ops seam sees it: ``LinearWeightLayer`` (the layers whose
weight multiplies activations) and ``WeightPlan`` (a device's decision of how that weight runs).

Why a plan: a device may run one weight on several kernels (a packed copy for a decode batch's
rows, the library's kernel for a prefill, a weight's quantized blocks for a few rows). That choice is
made once, when the device prepares the loaded model (``DeviceOps.prepare_model``), and kept in one
typed record that the layer owns (``LinearWeightLayer.plan``) and hands to every product
(``DeviceOps.linear(..., plan)``); a device's whole-layer kernels read the same records. When a
weight's values are written again its layer drops the plan (``drop_plan``), so a stale copy is never
read, and ``prepare_model`` makes a new one. A device without such choices makes no plans (None).
"""

from __future__ import annotations

from torch import nn

from runtime.engine.quant.weight import KeptWeight


class WeightPlan:
    """A device's plan for one linear weight (what its subclass holds is the device's: the CPU's is
    ``runtime.engine.cpu.weight_plan.CpuWeightPlan``). Made by ``DeviceOps.prepare_model``, owned by
    the layer, handed back to the device with every product."""

    __slots__ = ()


class LinearWeightLayer(nn.Module):
    """A layer whose ``weight`` multiplies activations through ``DeviceOps.linear`` /
    ``float_linear`` (the linear layers and the LM head): the weights a device may plan for
    (``prepare_model``). A base the device finds them by without importing the layers (which import
    the device ops)."""

    weight: nn.Parameter | KeptWeight  # (kept quantized: see runtime.engine.quant.loading)
    bias: nn.Parameter | None  # (declared here for the type checker; the linear layers set it, the LM head has none)
    plan: WeightPlan | None = None  # the device's plan for ``weight`` (None: none made, or dropped)

    def drop_plan(self) -> None:
        """Forget the device's plan: the weight's values are being written again (a load, a reload,
        a swap for its quantized form). ``DeviceOps.prepare_model`` makes a new one."""
        self.plan = None
