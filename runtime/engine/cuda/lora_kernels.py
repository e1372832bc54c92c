"""Multi-LoRA on cuda: ``DeviceOps.lora_add`` as two segmented Triton kernels, ``lora_add``.

The base GEMM has already run for every token; what is left is, per run of tokens sharing an
adapter slot, ``out[run] += (x[run] A_s^T) B_s^T`` part by part (``runtime.engine.ops.lora``).
A per-run loop of torch matmuls would launch two GEMMs per run and per part, each tiny in decode
(one token a run); here each product is one launch over every run at once (S-LoRA / Punica's
"shrink" and "expand", as in SGLang's segmented kernels):

1. shrink: ``h[t, :] = x[t] @ a[slot]^T`` (``[T, P * R]``, fp32) for every token of a run with a
   slot. One shrink serves all ``P`` parts of a merged linear (q/k/v, gate/up read the same ``x``).
2. expand: ``out[t, n] = round(out[t, n] + h[t, p(n) R : (p(n) + 1) R] . b[slot, n, :])``, where
   ``p(n)`` is the part holding output row ``n`` (``part_rows``): one rounding to ``out``'s dtype.

Both grids are ``(run, block of BLOCK_M tokens in the run, block of columns)``: the run count and
the longest adapter run (``LoraSegments.max_len``) come from the segments' host copies; each
program reads its run's start, end and slot on the device, returns at once for a base run (slot
-1) or a token block past its run's end, and masks the rest. Nothing reads a device value on the
host, so a CUDA graph can capture a call (its grid then fixes the run count and longest run).
``h``'s rows of base tokens are never written nor read.

Where it rounds: the shrink accumulates in fp32 over ``x`` and ``a`` in the model dtype (tensor
cores for bf16/fp16) and keeps ``h`` in fp32; the expand multiplies ``h`` by ``b`` widened to fp32
and accumulates in fp32, adds ``out`` in fp32 and rounds once, as ``reference_lora_add`` does. Its
products are exact (``ieee``) for fp32 and fp16 models; for a bf16 one they run as tf32 (tensor
cores, ~2^-11 relative error per product: far below the final rounding to bf16's 8 bits; an
``ieee`` expand runs on the CUDA cores, an estimated tenth or more of a prefill's base GEMM time
at rank 64, not measured).

Parts: the expand kernel takes up to ``MAX_PARTS`` part boundaries as scalars and loops over the
parts (a constexpr count) with a dot for each part that overlaps its column block (one, unless a
boundary falls inside the block); a linear of more parts gets one launch per ``MAX_PARTS`` parts.

Block sizes are a host-side function of the shapes (no autotuning: nothing is benchmarked while a
CUDA graph is captured); the GPU ones are reasonable defaults, not tuned per device. The shrink
does not split K: a decode batch of few runs and a small ``P * R`` gives few programs each walking
all of ``K``.

Under Triton's interpreter (CPU tests, ``TRITON_INTERPRET=1``) the products are taken in fp32 with
small blocks: the interpreter's numpy backend has no bf16 (``runtime.engine.cuda.triton_common``),
and its fp32 -> bf16 cast truncates where the GPU rounds to nearest (a bf16 ``out`` there is within
one bf16 step of the reference, not within half of one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from runtime.engine.cuda.triton_common import (
    cdiv,
    check_launch,
    dot_precision,
    interpreter_requested,
    next_power_of_2,
    use_fp32_math,
)
from runtime.engine.ops.lora import LoraSegments, LoraWeights

MAX_PARTS = 4  # part boundaries one expand launch takes as scalars (q/k/v is 3)


@dataclass(frozen=True)
class LoraBlocks:
    """One ``lora_add`` call's tiles: token rows per block (shared by both kernels), the shrink's
    ``P * R`` columns and depth step, the expand's output columns and rank step."""

    block_m: int
    shrink_n: int
    shrink_k: int
    expand_n: int
    block_r: int


def lora_blocks(max_len: int, shrink_cols: int, depth: int, out_cols: int, rank: int, dtype: torch.dtype) -> LoraBlocks:
    """Blocks for runs of at most ``max_len`` tokens. ``BLOCK_M`` follows the longest run: 16 rows
    (the least a tensor-core dot takes) in decode, where a run is a token or a few; 32 or 64 in
    prefill, where a wider tile reuses each weight tile over more tokens."""
    if interpreter_requested():  # few, small programs: the interpreter pays per op, not per element
        return LoraBlocks(16, 32, 32, 32, 16)
    block_m = 16 if max_len <= 16 else 32 if max_len <= 64 else 64
    # fp32 tiles take twice the shared memory per stage: a shorter step keeps the stages resident
    shrink_k = min(32 if dtype == torch.float32 else 64, max(16, next_power_of_2(depth)))
    return LoraBlocks(
        block_m=block_m,
        shrink_n=min(64, max(16, next_power_of_2(shrink_cols))),
        shrink_k=shrink_k,
        expand_n=min(128 if block_m >= 64 else 64, max(16, next_power_of_2(out_cols))),
        block_r=min(64, max(16, next_power_of_2(rank))),
    )


@triton.jit
def _shrink_kernel(
    X,  # [T, K], rows x_stride apart
    x_stride,
    A,  # [S, P * R, K]
    a_stride_s,
    a_stride_r,
    a_stride_k,
    H,  # [T, P * R] fp32
    h_stride,
    Starts,  # int32 [runs + 1]
    Slots,  # int32 [runs]
    K,
    cols_total,  # P * R
    EVEN_K: tl.constexpr,
    FP32_MATH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    run = tl.program_id(0)
    slot = tl.load(Slots + run)
    if slot < 0:  # the base model: nothing to add
        return
    end = tl.load(Starts + run + 1)
    first = tl.load(Starts + run) + tl.program_id(1) * BLOCK_M
    if first >= end:  # the grid covers the longest run: this block lies past its own run
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < cols_total
    x_rows = X + rows.to(tl.int64)[:, None] * x_stride
    a_cols = A + slot.to(tl.int64) * a_stride_s + cols.to(tl.int64)[None, :] * a_stride_r
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        depth = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + depth[None, :], mask=row_ok[:, None], other=0.0)
            a = tl.load(a_cols + depth.to(tl.int64)[:, None] * a_stride_k, mask=col_ok[None, :], other=0.0)
        else:
            depth_ok = depth < K
            x = tl.load(x_rows + depth[None, :], mask=row_ok[:, None] & depth_ok[None, :], other=0.0)
            a = tl.load(
                a_cols + depth.to(tl.int64)[:, None] * a_stride_k,
                mask=depth_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
        if FP32_MATH:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, a, input_precision=PRECISION)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(H + rows.to(tl.int64)[:, None] * h_stride + cols[None, :], acc, mask=mask)


@triton.jit
def _expand_kernel(
    H,  # [T, P * R] fp32: the shrink's output, part p's columns at p * R
    h_stride,
    B,  # [S, N, R]
    b_stride_s,
    b_stride_n,
    b_stride_r,
    Out,  # [T, N], rows out_stride apart
    out_stride,
    Starts,
    Slots,
    rank,
    Bound0,  # the parts' output-row boundaries: part p is rows Bound_p : Bound_{p+1}
    Bound1,
    Bound2,
    Bound3,
    Bound4,
    PARTS: tl.constexpr,  # 1 .. MAX_PARTS; the boundaries past PARTS are not read
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    run = tl.program_id(0)
    slot = tl.load(Slots + run)
    if slot < 0:
        return
    end = tl.load(Starts + run + 1)
    first = tl.load(Starts + run) + tl.program_id(1) * BLOCK_M
    if first >= end:
        return
    rows = first + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    h_rows = H + rows.to(tl.int64)[:, None] * h_stride
    block_lo = Bound0 + tl.program_id(2) * BLOCK_N
    cols = block_lo + tl.arange(0, BLOCK_N)
    b_slot = B + slot.to(tl.int64) * b_stride_s
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for p in tl.static_range(PARTS):
        if p == 0:
            lo, hi = Bound0, Bound1
        elif p == 1:
            lo, hi = Bound1, Bound2
        elif p == 2:
            lo, hi = Bound2, Bound3
        else:
            lo, hi = Bound3, Bound4
        if (lo < block_lo + BLOCK_N) & (hi > block_lo):  # this part has rows in the block
            in_part = (cols >= lo) & (cols < hi)
            b_cols = b_slot + cols.to(tl.int64)[None, :] * b_stride_n
            for r0 in range(0, rank, BLOCK_R):
                ranks = r0 + tl.arange(0, BLOCK_R)
                rank_ok = ranks < rank
                h = tl.load(h_rows + p * rank + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
                b = tl.load(
                    b_cols + ranks.to(tl.int64)[:, None] * b_stride_r,
                    mask=rank_ok[:, None] & in_part[None, :],
                    other=0.0,
                )
                acc += tl.dot(h, b.to(tl.float32), input_precision=PRECISION)
    mask = row_ok[:, None] & (cols < Bound4)[None, :]
    out_ptr = Out + rows.to(tl.int64)[:, None] * out_stride + cols[None, :]
    base = tl.load(out_ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr, (base + acc).to(Out.dtype.element_ty), mask=mask)


def _check_inputs(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
    """Shapes, dtypes and layouts only (no device value is read: that would sync)."""
    a, b, bounds = weights.a, weights.b, weights.part_rows
    if out.dim() != 2 or x.dim() != 2 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            f"lora_add takes out [T, N], x [T, K], a [S, P*R, K], b [S, N, R]; got "
            f"{tuple(out.shape)}, {tuple(x.shape)}, {tuple(a.shape)}, {tuple(b.shape)}"
        )
    (tokens, rows), (slots, rank) = out.shape, (b.shape[0], b.shape[2])
    parts = len(bounds) - 1
    if x.shape[0] != tokens or a.shape != (slots, parts * rank, x.shape[1]) or b.shape[1] != rows:
        raise ValueError(
            f"LoRA weights do not fit: out {tuple(out.shape)}, x {tuple(x.shape)}, a {tuple(a.shape)}, "
            f"b {tuple(b.shape)}, {parts} part(s)"
        )
    if parts < 1 or bounds[0] != 0 or bounds[-1] != rows or any(lo > hi for lo, hi in zip(bounds, bounds[1:])):
        raise ValueError(f"part_rows must rise from 0 to the output's {rows} rows; got {bounds}")
    if not x.dtype == out.dtype == a.dtype == b.dtype:
        raise ValueError(
            f"out, x and the LoRA weights must share a dtype; got {out.dtype}, {x.dtype}, {a.dtype}, {b.dtype}"
        )
    if out.stride(1) != 1:
        raise ValueError("lora_add writes out in place: its rows must be contiguous")
    runs = len(segments.slots_cpu)
    if len(segments.starts_cpu) != runs + 1 or segments.starts_cpu[-1] > tokens:
        raise ValueError(f"segments of {runs} runs over {segments.starts_cpu[-1:]} tokens do not fit {tokens} tokens")
    if segments.slots.shape[0] < runs or segments.starts.shape[0] < runs + 1:
        raise ValueError("the segments' device tensors hold fewer runs than their host copies")
    if segments.slots.dtype != torch.int32 or segments.starts.dtype != torch.int32:
        raise ValueError("segment starts and slots must be int32")


def lora_add(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
    """``DeviceOps.lora_add`` (``runtime.engine.ops.lora.reference_lora_add``'s meaning) in two
    launches (see the module docstring); ``h`` (``[T, P * R]`` fp32) is this call's only allocation.
    ``x`` may have a row stride other than ``K``; a column stride other than 1 costs a copy."""
    _check_inputs(out, x, weights, segments)
    max_len = segments.max_len
    tokens, rows = out.shape
    depth = x.shape[1]
    rank, bounds = weights.rank, weights.part_rows
    if max_len == 0 or tokens == 0 or rows == 0 or rank == 0:
        return
    if x.stride(1) != 1:
        x = x.contiguous()
    a, b = weights.a, weights.b
    runs = len(segments.slots_cpu)
    shrink_cols = a.shape[1]
    blocks = lora_blocks(max_len, shrink_cols, depth, rows, rank, out.dtype)
    token_blocks = cdiv(max_len, blocks.block_m)
    precision = dot_precision(out.dtype)
    expand_precision = "tf32" if out.dtype == torch.bfloat16 else "ieee"  # see the module docstring

    h = torch.empty(tokens, shrink_cols, dtype=torch.float32, device=out.device)
    check_launch(_shrink_kernel, out, x, a, b, h, segments.starts, segments.slots)
    if depth == 0:
        h.zero_()
    else:
        _shrink_kernel[(runs, token_blocks, cdiv(shrink_cols, blocks.shrink_n))](
            x,
            x.stride(0),
            a,
            a.stride(0),
            a.stride(1),
            a.stride(2),
            h,
            h.stride(0),
            segments.starts,
            segments.slots,
            depth,
            shrink_cols,
            EVEN_K=depth % blocks.shrink_k == 0,
            FP32_MATH=use_fp32_math(),
            PRECISION=precision,
            BLOCK_M=blocks.block_m,
            BLOCK_N=blocks.shrink_n,
            BLOCK_K=blocks.shrink_k,
            num_warps=4,
            num_stages=3,
        )

    for first in range(0, len(bounds) - 1, MAX_PARTS):
        group = bounds[first : first + MAX_PARTS + 1]  # this launch's parts' boundaries
        lo, hi = group[0], group[-1]
        if hi == lo:
            continue
        padded = list(group) + [hi] * (MAX_PARTS + 1 - len(group))
        _expand_kernel[(runs, token_blocks, cdiv(hi - lo, blocks.expand_n))](
            h[:, first * rank :],
            h.stride(0),
            b,
            b.stride(0),
            b.stride(1),
            b.stride(2),
            out,
            out.stride(0),
            segments.starts,
            segments.slots,
            rank,
            *padded,
            PARTS=len(group) - 1,
            PRECISION=expand_precision,
            BLOCK_M=blocks.block_m,
            BLOCK_N=blocks.expand_n,
            BLOCK_R=blocks.block_r,
            num_warps=4,
            num_stages=2,
        )
