"""RMSNorm, with the residual add fused into the same call.

The variance is computed in fp32 whatever the model dtype, and the result is cast back
before the weight multiply, exactly as transformers' Llama/Qwen RMSNorm does, so fp32
and bf16 outputs both match the reference implementation. The work is the device ops'
``rms_norm`` (one fused pass where the device has a kernel for it); the residual sum is
written into the residual stream's own buffer, which the decoder layers hand down and
nothing else reads.
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.ops import DeviceOps, default_ops


class RMSNorm(nn.Module):
    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None, ops: DeviceOps | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.ops = ops or default_ops(params_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        With ``residual`` the sum is accumulated into ``residual`` in place (the caller owns
        that buffer and gets it back as the new residual).
        """
        out = self.ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)
