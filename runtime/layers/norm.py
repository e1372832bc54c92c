"""RMSNorm, with the residual add fused into the same call.

The variance is computed in fp32 whatever the model dtype, and the result is cast back
before the weight multiply, exactly as transformers' Llama/Qwen RMSNorm does, so fp32
and bf16 outputs both match the reference implementation.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``."""
        if residual is None:
            return self._norm(x)
        summed = x + residual
        return self._norm(summed), summed
