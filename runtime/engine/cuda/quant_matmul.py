"""A Triton dequantizing matmul for weights kept quantized (``runtime.engine.quant.weight``: the q8 and q4
layouts), ``TritonOps.linear``'s path for a weight kept quantized (one ``QuantizedWeight``, or its bands).

Why dequantize in the kernel rather than once at load: the weight stays in device memory at its
quantized size (a quarter to an eighth of bf16's), and each program expands only the tile it
multiplies, in registers; the products then run on the tensor cores in the activations' dtype with
fp32 accumulation, as a dense linear's do. Unlike the CPU kernels, the activations are not
quantized: a GPU is bound by the weight's bytes at decode batch sizes, not by the multiply.

A program computes a ``BLOCK_M x BLOCK_N`` tile of the output over the depth in steps of
``BLOCK_K`` (a multiple of the layouts' block of 32): it loads the tile's packed values, the
scale (q8: one per ``GROUP`` values, 16, 32 or the whole row, with groups of 32 maybe a min; q4: one per 32, and a min), forms
``scale * q (+ min)`` in fp32, rounds it to the activations' dtype (the reference rounds the fp32
dequantized weight the same way) and accumulates ``x @ w^T`` in fp32.

Under Triton's interpreter (CPU tests, ``TRITON_INTERPRET=1``) it runs in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.cuda.triton_common import cdiv, check_launch, dot_precision
from runtime.engine.quant.weight import KeptWeight, QuantizedWeight

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _quant_matmul_kernel(
    X,
    x_stride,
    QS,
    qs_stride,
    S,
    s_stride,
    MINS,
    Out,
    out_stride,
    Bias,
    M,
    N,
    K,
    GROUP: tl.constexpr,
    IS_Q4: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        depth = k0 + tl.arange(0, BLOCK_K)
        depth_ok = depth < K
        x = tl.load(
            X + rows[:, None].to(tl.int64) * x_stride + depth[None, :],
            mask=row_ok[:, None] & depth_ok[None, :],
            other=0.0,
        )
        w_mask = col_ok[:, None] & depth_ok[None, :]
        w_rows = cols[:, None].to(tl.int64)
        if IS_Q4:
            # byte j of a block of 32 holds value j (low nibble) and value j + 16 (high nibble)
            in_block = depth % 32
            byte = (depth // 32) * 16 + in_block % 16
            packed = tl.load(QS + w_rows * qs_stride + byte[None, :], mask=w_mask, other=0).to(tl.int32)
            q = ((packed >> ((in_block // 16) * 4)[None, :]) & 15).to(tl.float32)
            group = (depth // 32)[None, :]
            scale = tl.load(S + w_rows * s_stride + group, mask=w_mask, other=0.0)
            low = tl.load(MINS + w_rows * s_stride + group, mask=w_mask, other=0.0)
            w = q * scale + low
        else:
            q = tl.load(QS + w_rows * qs_stride + depth[None, :], mask=w_mask, other=0).to(tl.float32)
            scale = tl.load(S + w_rows * s_stride + (depth // GROUP)[None, :], mask=w_mask, other=0.0)
            w = q * scale
            if HAS_MINS:  # a q8 weight with a min per 32 (Q5_1, Q5_K; GROUP is 32 then)
                w += tl.load(MINS + w_rows * s_stride + (depth // 32)[None, :], mask=w_mask, other=0.0)
        acc += tl.dot(x, tl.trans(w.to(X.dtype.element_ty)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        Out + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
        acc.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def quant_matmul(
    x: torch.Tensor, weight: KeptWeight, bias: torch.Tensor | None, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x [..., in] @ dequantized weight.T (+ bias)`` in ``out_dtype`` (default: ``x``'s). A weight
    in bands (``QuantizedBands``: a merged layer whose parts' formats differ) launches once per band,
    each writing its columns of the one output (the kernel takes the output's row stride)."""
    out_features, in_features = weight.shape
    rows = x.reshape(-1, in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, out_features, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        for first, band in weight.bands():
            columns = slice(first, first + band.shape[0])
            _launch(rows, band, bias[columns] if bias is not None else None, out[:, columns])
    return out.reshape(*x.shape[:-1], out_features)


def _launch(rows: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """One weight's product of ``rows [m, in]`` into ``out [m, weight's rows]`` (rows ``out.stride(0)`` apart)."""
    m, (out_features, in_features) = rows.shape[0], weight.shape
    scales, mins = weight.scale_values()  # (fp32: a plain weight's own, see TritonOps.prepare_model)
    mins = mins if mins is not None else scales  # (not read without mins)
    tensors = [rows, weight.qs, scales, mins, out] + ([bias] if bias is not None else [])
    check_launch(_quant_matmul_kernel, *tensors)
    grid = (cdiv(m, BLOCK_M), cdiv(out_features, BLOCK_N))
    _quant_matmul_kernel[grid](
        rows,
        rows.stride(0),
        weight.qs,
        weight.qs.stride(0),
        scales,
        scales.stride(0),
        mins,
        out,
        out.stride(0),
        bias if bias is not None else out,
        m,
        out_features,
        in_features,
        GROUP=weight.group,
        IS_Q4=weight.kind == "q4",
        HAS_MINS=weight.kind == "q8" and weight.mins is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        PRECISION=dot_precision(rows.dtype),
    )
