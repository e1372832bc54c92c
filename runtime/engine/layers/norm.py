"""The norm layers: RMSNorm (and Gemma's unit-offset form) and LayerNorm (BERT's), with the
residual add fused into the same call.

The RMSNorm variance is computed in fp32 whatever the model dtype, and the result is cast back
before the weight multiply, exactly as transformers' Llama/Qwen RMSNorm does, so fp32
and bf16 outputs both match the reference implementation. The work is the device ops'
``rms_norm`` (one fused pass where the device has a kernel for it) or ``layer_norm``; the residual
sum is written into the residual stream's own buffer, which the decoder layers hand down and
nothing else reads.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.engine.layers.linear import check_shape
from runtime.engine.ops import DeviceOps, default_ops


class NormLayer(nn.Module):
    """What every norm form's layer is (``runtime.engine.layers.choices.NORM_LAYERS``): a ``weight``
    over ``hidden_size`` features, an ``eps``, and ``forward(x, residual=None)`` as ``RMSNorm``'s."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None, ops: DeviceOps | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        self.ops = ops or default_ops(params_dtype)


class RMSNorm(NormLayer):
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``.

        With ``residual`` the sum is accumulated into ``residual`` in place (the caller owns
        that buffer and gets it back as the new residual).
        """
        out = self.ops.rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, residual)


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + w)`` for the checkpoint's ``w``.

    The parameter holds ``1 + w``, made once when ``w`` is loaded (in fp32, then cast to the
    parameter's dtype), so a forward is the plain RMSNorm's one call. transformers multiplies by
    ``1.0 + w.float()`` in fp32; in fp32 the products are the same, bit for bit.
    """

    def __init__(
        self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None, ops: DeviceOps | None = None
    ) -> None:
        super().__init__(hidden_size, eps, params_dtype, ops)
        self.weight.weight_loader = self._load_with_unit_offset  # type: ignore[attr-defined]

    @staticmethod
    def _load_with_unit_offset(param: nn.Parameter, weight: Any, name: str, shard_id: object = None) -> None:
        """``param = 1 + weight`` (``weight``: a checkpoint tensor behind ``LazyWeight``)."""
        value = weight.load()
        check_shape(name, value.shape, param.shape)
        with torch.no_grad():
            param.copy_(value.float() + 1.0)


class LayerNorm(NormLayer):
    """torch's LayerNorm (BERT's): ``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim,
    through the device ops' ``layer_norm``."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-12,
        params_dtype: torch.dtype | None = None,
        ops: DeviceOps | None = None,
    ) -> None:
        super().__init__(hidden_size, eps, params_dtype, ops)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``(norm(x + residual), x + residual)``, the sum
        accumulated into ``residual`` in place (a post-norm layer's ``norm(sublayer(h) + h)``)."""
        if residual is None:
            return self.ops.layer_norm(x, self.weight, self.bias, self.eps)
        residual.add_(x)
        return self.ops.layer_norm(residual, self.weight, self.bias, self.eps), residual
