"""RMSNorm, with the residual add fused into the same call.

The variance is computed in fp32 whatever the model dtype, and the result is cast back
before the weight multiply, exactly as transformers' Llama/Qwen RMSNorm does, so fp32
and bf16 outputs both match the reference implementation.

Cheap on CPU: in half precision the fp32 copy is private, so it is scaled in place (the
same products as HF, without a second fp32 temporary); the residual sum is written into
the residual stream's own buffer, which the decoder layers hand down and nothing else reads.
bf16 on CPU goes through ``cpu_kernels.rms_norm`` (the same roundings, one pass).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.cpu import kernels as cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:
            # x.float() would alias x: stay out of place (the caller may still need x).
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = x.float()  # a private copy
        xf.mul_(torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return self.weight * xf.to(dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        With ``residual`` the sum is accumulated into ``residual`` in place (the caller owns
        that buffer and gets it back as the new residual).
        """
        fused = cpu_kernels.rms_norm(x, residual, self.weight, self.eps)  # bf16 on CPU: one pass
        if fused is not None:
            return fused if residual is None else (fused, residual)
        if residual is None:
            return self._norm(x)
        residual.add_(x)
        return self._norm(residual), residual
