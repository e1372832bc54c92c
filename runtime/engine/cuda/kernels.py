"""Triton kernels for the layers' non-matmul work on cuda: fused residual-add + RMSNorm,
in-place rotary on q and k, silu*mul and the KV pool store (quantizing
into an int8 / fp8 cache as it writes: ``runtime.engine.cuda.kv_quant``).

Each is one pass over memory where torch needs several ops and temporaries, and each rounds
where transformers' modules round (the residual sum and the normalised value to the model
dtype before the weight multiply; the cos/sin tables to the activations' dtype and every
product of the rotation; silu's output before the multiply), so results follow the plain
torch ops of ``runtime.engine.ops.torch_ops`` to within fp32 reassociation.

Every launch is one program per token row (per row and column block for silu*mul), reads
device tensors only (no host sync), and allocates at most its output: the kernels can run
inside a captured CUDA graph.

Under Triton's interpreter (CPU tests, ``TRITON_INTERPRET=1``) they are checked in fp32:
the interpreter's numpy backend has no bf16 (see ``runtime.engine.cuda.triton_common``).
The wrappers return None / False where a layout is outside what a kernel takes, and the
caller (``TritonOps``) then runs the torch op.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memory.kv_format import SCALE_BYTES, KVCacheFormat
from runtime.engine.cuda.kv_quant import BF16, INT8, fp32_reciprocal, store_mode, store_rows
from runtime.engine.cuda.triton_common import cdiv, check_launch, next_power_of_2

_SILU_BLOCK = 1024  # columns of silu*mul per program


def _num_warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_kernel(
    X, x_stride, R, r_stride, W, Out, out_stride, n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * r_stride + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + r).to(R.dtype.element_ty)  # the residual stream keeps the model dtype's sum
        tl.store(R + row * r_stride + cols, total, mask=mask)
        x = total.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    normed = (x * (1.0 / tl.sqrt(var + eps))).to(Out.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * out_stride + cols, (w * normed).to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None) -> torch.Tensor | None:
    """``DeviceOps.rms_norm`` of ``x [..., H]``; None where the layout is not one the kernel takes."""
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or not weight.is_contiguous() or x.numel() == 0:
        return None
    x2 = x.reshape(-1, hidden)  # a view for the usual row-major activations, else a copy
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        if residual.shape != x.shape:
            return None
        try:
            r2 = residual.view(-1, hidden)  # written in place: must be a view
        except RuntimeError:
            return None
        if r2.stride(1) != 1:
            return None
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    check_launch(_rms_norm_kernel, x2, weight, out2, *(() if r2 is None else (r2,)))
    block = next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        x2.stride(0),
        x2 if r2 is None else r2,
        0 if r2 is None else r2.stride(0),
        weight,
        out2,
        out2.stride(0),
        hidden,
        float(eps),
        HAS_RESIDUAL=r2 is not None,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


@triton.jit
def _rotate_heads(base, stride_h, num_heads, cos, sin, half, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    ptr = base + heads * stride_h + dims
    dtype = base.dtype.element_ty
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
    # Each product rounded, then each sum: transformers' q * cos + rotate_half(q) * sin.
    o1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    o2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(ptr, o1.to(dtype), mask=mask)
    tl.store(ptr + half, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    Q,
    q_stride_t,
    q_stride_h,
    K,
    k_stride_t,
    k_stride_h,
    Positions,
    Cos,
    Sin,
    cache_stride,
    num_q_heads,
    num_k_heads,
    half,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    in_half = dims < half
    dtype = Q.dtype.element_ty
    # The fp32 tables rounded to the activations' dtype first, as transformers casts them.
    cos = tl.load(Cos + pos * cache_stride + dims, mask=in_half, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(Sin + pos * cache_stride + dims, mask=in_half, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(Q + t * q_stride_t, q_stride_h, num_q_heads, cos, sin, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K + t * k_stride_t, k_stride_h, num_k_heads, cos, sin, half, BLOCK_HK, BLOCK_HALF)


def rotary_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    rotary_dim: int,
) -> bool:
    """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place by the fp32 tables'
    ``[max_position, rotary_dim // 2]`` rows at ``positions``; False (nothing touched) where
    the layout is not one the kernel takes (dims must be unit-stride)."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.dtype != k.dtype or rotary_dim % 2:
        return False
    if q.stride(2) != 1 or k.stride(2) != 1 or rotary_dim > q.shape[2] or rotary_dim > k.shape[2]:
        return False
    half = rotary_dim // 2
    if cos_cache.shape[-1] != half or cos_cache.stride() != sin_cache.stride() or cos_cache.stride(1) != 1:
        return False
    t = q.shape[0]
    if t == 0:
        return True
    check_launch(_rotary_kernel, q, k, positions, cos_cache, sin_cache)
    block_half = next_power_of_2(half)
    _rotary_kernel[(t,)](
        q,
        q.stride(0),
        q.stride(1),
        k,
        k.stride(0),
        k.stride(1),
        positions,
        cos_cache,
        sin_cache,
        cos_cache.stride(0),
        q.shape[1],
        k.shape[1],
        half,
        BLOCK_HQ=next_power_of_2(q.shape[1]),
        BLOCK_HK=next_power_of_2(k.shape[1]),
        BLOCK_HALF=block_half,
        num_warps=_num_warps(next_power_of_2(q.shape[1]) * block_half),
    )
    return True


@triton.jit
def _silu_and_mul_kernel(X, x_stride, Out, out_stride, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(X + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = Out.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # silu's output rounds first, as in torch
    tl.store(Out + row * out_stride + cols, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``x [..., 2 * I]`` as a new ``[..., I]`` tensor; None for an odd width."""
    if x.shape[-1] % 2:
        return None
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    x2 = x.reshape(-1, 2 * inter)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] == 0 or inter == 0:
        return out
    out2 = out.view(-1, inter)
    check_launch(_silu_and_mul_kernel, x2, out2)
    block = min(_SILU_BLOCK, next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], cdiv(inter, block))](
        x2,
        x2.stride(0),
        out2,
        out2.stride(0),
        inter,
        BLOCK=block,
        num_warps=_num_warps(block),
    )
    return out


@triton.jit
def _store_kv_kernel(
    K,
    k_stride_t,
    k_stride_h,
    V,
    v_stride_t,
    v_stride_h,
    Loc,
    KBuf,
    VBuf,
    KScales,  # int8: the fp32 views of KBuf / VBuf (each row's scale); else unused
    VScales,
    buf_stride_slot,
    buf_stride_h,
    num_heads,
    head_dim,
    k_scale,  # fp8: the layer's K / V scales and their fp32 reciprocals
    v_scale,
    k_inv,
    v_inv,
    STORE_MODE: tl.constexpr,  # kv_quant: PLAIN (a cast), BF16, INT8, FP8_E4M3, FP8_E5M2
    RECIPROCAL: tl.constexpr,  # divide by a layer scale as torch does on CUDA (times the reciprocal)
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + i).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (dims < head_dim)
    row = slot * buf_stride_slot + heads * buf_stride_h
    scale_at = tl.reshape((row + head_dim) // 4, [BLOCK_H])  # int8: the fp32 after the row's codes
    row_mask = tl.arange(0, BLOCK_H) < num_heads
    k = tl.load(K + i * k_stride_t + heads * k_stride_h + dims, mask=mask, other=0.0)
    store_rows(k, KBuf, row + dims, KScales, scale_at, mask, row_mask, k_scale, k_inv, STORE_MODE, RECIPROCAL)
    v = tl.load(V + i * v_stride_t + heads * v_stride_h + dims, mask=mask, other=0.0)
    store_rows(v, VBuf, row + dims, VScales, scale_at, mask, row_mask, v_scale, v_inv, STORE_MODE, RECIPROCAL)


def store_kv(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_format: KVCacheFormat | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    reciprocal: bool | None = None,
) -> bool:
    """Write ``k``/``v`` ``[n, Hkv, D]`` (token rows and heads may be strided) at slots ``loc``
    (``[n]``) of ``k_buf``/``v_buf`` ``[slots, Hkv, row_width]``, in the pool's ``kv_format`` (None:
    the buffers' own dtype; quantized with the fp8 layer scales ``k_scale``/``v_scale``): the bytes of
    ``KVCacheFormat.quantize`` on the same device (``reciprocal``: divide by a scale as torch does on
    CUDA, times its fp32 reciprocal; None: when the tensors are on CUDA). False where the layout
    does not fit.
    Slots are not range-checked (that would need a host sync): the allocator hands out valid ones."""
    n = loc.shape[0] if loc.dim() == 1 else -1
    if k_buf.dim() != 3 or v_buf.shape != k_buf.shape or v_buf.stride() != k_buf.stride() or k_buf.stride(2) != 1:
        return False
    mode = store_mode(kv_format, k_buf.dtype, k.dtype)
    heads = k_buf.shape[1]
    dim = k_buf.shape[2] - (SCALE_BYTES if mode == INT8 else 0)
    if any(tuple(t.shape) != (n, heads, dim) or t.stride(2) != 1 for t in (k, v)):
        return False
    if mode == INT8 and (dim % SCALE_BYTES or k_buf.stride(0) % SCALE_BYTES or k_buf.stride(1) % SCALE_BYTES):
        return False  # (the scales are written through the fp32 view)
    if n == 0:
        return True
    check_launch(_store_kv_kernel, k_buf, v_buf, loc, k, v)
    bufs = (k_buf, v_buf) if mode != BF16 else (k_buf.view(torch.int16), v_buf.view(torch.int16))
    scales = (k_buf.view(torch.float32), v_buf.view(torch.float32)) if mode == INT8 else bufs
    _store_kv_kernel[(n,)](
        k,
        k.stride(0),
        k.stride(1),
        v,
        v.stride(0),
        v.stride(1),
        loc,
        *bufs,
        *scales,
        k_buf.stride(0),
        k_buf.stride(1),
        heads,
        dim,
        k_scale,
        v_scale,
        fp32_reciprocal(k_scale),
        fp32_reciprocal(v_scale),
        STORE_MODE=mode,
        RECIPROCAL=k.device.type == "cuda" if reciprocal is None else reciprocal,
        BLOCK_H=next_power_of_2(heads),
        BLOCK_D=next_power_of_2(dim),
    )
    return True
