"""The error bound of a quantized linear kernel against the dequantize-then-matmul reference.

The kernels (csrc/quant_linear.c, the Triton matmul) replace each activation block b (32 values)
by ``d_b * round(x / d_b)`` with ``d_b = max |x_b| / 127``, so each value moves by at most
``d_b / 2``; their products with the weight's integer part ``s * q`` (the min of a q4 block
multiplies the exact sum of x) are exact in int32, so a result differs from the reference by at
most ``sum_b d_b / 2 * sum_(i in b) |s_b q_i|``, plus fp32 rounding of the scales and of the sums
over blocks: at most ``(blocks + 16) * eps * sum |x_i| (|w_i| + |min_b|)`` (a few roundings per
term, one per term added).
"""

from __future__ import annotations

import torch

from runtime.engine.quant.weight import QuantizedWeight

EPS32 = float(torch.finfo(torch.float32).eps)


def quantized_linear_bound(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """``[rows, out]``: the bound above for ``x [rows, in]`` times ``weight``, in float64."""
    xd = x.double().reshape(-1, weight.shape[1])
    blocks = xd.reshape(xd.shape[0], -1, 32)
    half_step = blocks.abs().amax(-1) / 127 / 2  # [rows, blocks]
    fp32_scales, fp32_mins = weight.scale_values()  # (a K-quant's super-block codes decoded)
    scales = fp32_scales.double().cpu()
    values = weight.values().cpu().double().reshape(scales.shape[0], scales.shape[1], -1)
    scaled = (values * scales.unsqueeze(-1)).reshape(weight.shape[0], -1, 32).abs().sum(-1)  # [out, blocks]
    mins = fp32_mins.double().abs().cpu() if fp32_mins is not None else torch.zeros_like(scaled)
    magnitude = blocks.abs().sum(-1) @ mins.T + xd.abs() @ weight.dequantize().cpu().double().abs().T
    return half_step @ scaled.T + (weight.shape[1] // 32 + 16) * EPS32 * magnitude
