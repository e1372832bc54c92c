"""The gated activation of Llama-family MLPs: ``silu(gate) * up`` over a merged gate/up tensor."""

from __future__ import annotations

import torch
from torch import nn

from runtime.ops import DeviceOps, default_ops


class SiluAndMul(nn.Module):
    def __init__(self, ops: DeviceOps | None = None) -> None:
        super().__init__()
        self.ops = ops or default_ops()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [..., 2*I]`` (gate first, as MergedColumnParallelLinear stores it) -> ``[..., I]``
        (one fused pass where the device ops have a kernel for it)."""
        return self.ops.silu_and_mul(gate_up)

    def of_linear(self, x: torch.Tensor, gate_up_proj: nn.Module) -> torch.Tensor:
        """The activation of ``gate_up_proj(x)`` (a MergedColumnParallelLinear), in one pass with
        the projection where the device ops fuse them."""
        return self.ops.linear_silu_and_mul(x, gate_up_proj.weight, gate_up_proj.bias, gate_up_proj.packed_weight)
