"""The gated activation of Llama-family MLPs: ``silu(gate) * up`` over a merged gate/up tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from runtime.cpu import kernels as cpu_kernels


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [..., 2*I]`` (gate first, as MergedColumnParallelLinear stores it) -> ``[..., I]``.

        The product is written into silu's fresh output (one temporary instead of two);
        bf16 on CPU takes one pass through ``cpu_kernels.silu_and_mul`` instead.
        """
        fused = cpu_kernels.silu_and_mul(gate_up)
        if fused is not None:
            return fused
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
