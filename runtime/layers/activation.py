"""The gated activation of Llama-family MLPs: ``silu(gate) * up`` over a merged gate/up tensor."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gate_up [..., 2*I]`` (gate first, as MergedColumnParallelLinear stores it) -> ``[..., I]``.

        The product is written into silu's fresh output (one temporary instead of two).
        """
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)
