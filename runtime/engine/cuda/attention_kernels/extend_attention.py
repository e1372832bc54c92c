"""Extend (prefill) attention: new tokens attend to their cached prefix and causally to each other.

One program per (request, query head, block of BLOCK_M new tokens) keeps one online-softmax
state across two loops:

* stage 1 walks the request's cached prefix through ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``
  (paged slots in token order; every prefix token precedes every new token, so no mask);
* stage 2 walks the request's new tokens, read straight from the packed ``k_extend``/``v_extend``
  (``qo_indptr`` gives each request's range), under the causal mask, and stops at the last
  key any row of the block can see.

Reading the new tokens from the packed tensors (instead of from the pool after the write)
keeps stage 2's loads contiguous.

Sliding window (``sliding_window = W > 0``): a query sees only keys less than W positions
behind it. The caller passes as the prefix only the keys the first new token can see (the
last ``W - 1`` cached ones at most), so the prefix ends where the new tokens start and a key's
distance to a query is its offset from that end plus the query's offset; the kernel masks
by that distance and starts stage 2 at the first block any row of the block can see.

Soft-capped logits (Gemma 2): ``logit_cap`` C > 0 makes both stages take ``C * tanh(score / C)``
of each scaled score before the causal and window masks (``logit_cap.soft_cap``).

A quantized cache (``memory.kv_format``) is dequantized as stage 1 loads each block of the prefix,
as in the decode kernels (``runtime.engine.cuda.kv_quant``): codes in the model's dtype, an int8
row's scale on its key's score and softmax weight, the fp8 layer scales on the prefix's scores and
values. Stage 2 reads the new tokens' K/V of this forward as the caller hands them: the backend
gives them as the pool stores them (``MHATokenToKVPool.stored_values``), so that a prompt reads the
same values whether its keys were computed now, in an earlier chunk or came from a cached prefix.

Memory: ``k_buffer``/``v_buffer`` are one layer of the MHATokenToKVPool (read only);
``q_extend``/``k_extend``/``v_extend`` are the layer's activations; ``o_extend`` is the caller's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memory.kv_format import KVCacheFormat
from runtime.engine.cuda.attention_kernels.logit_cap import soft_cap
from runtime.engine.cuda.kv_quant import INT8_MODE, int8_row_scales, kv_read, load_kv
from runtime.engine.cuda.triton_common import (
    check_launch,
    dot_precision,
    interpreter_requested,
    next_power_of_2,
    use_fp32_math,
)


def _extend_configs() -> list[triton.Config]:
    """Autotune space; decided when this module is imported (same moment Triton picks its mode)."""
    if interpreter_requested():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    return [
        triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, num_warps=4, num_stages=1),
    ]


@triton.jit
def _online_softmax_step(acc, m_i, l_i, qk, v, v_weight, PRECISION: tl.constexpr):
    """Fold one block of scores ``qk [M, N]`` (masked entries -inf) and values ``v [N, Dv]`` into the
    state; ``v_weight`` multiplies each key's softmax weight in the sum over ``v`` (an int8 row's
    scale ``[1, N]``, else 1.0)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(qk - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot((p * v_weight).to(v.dtype), v, input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.autotune(configs=_extend_configs(), key=["Lk", "Lv", "kv_group_num", "KV_MODE"])
@triton.jit
def _extend_kernel(
    Q_Ext,  # [T, H, Lk]
    K_Ext,  # [T, Hkv, Lk]
    V_Ext,  # [T, Hkv, Lv]
    O_Ext,  # [T, H, Lv]
    K_Buf,  # [slots, Hkv, row]: row = Lk values (int8: Lk codes, then the fp32 scale's 4 bytes)
    V_Buf,  # [slots, Hkv, row]
    K_Scales,  # int8: fp32 views of K_Buf / V_Buf (the rows' scales); else unused
    V_Scales,
    qo_indptr,  # [bs + 1]
    kv_indptr,  # [bs + 1]: prefix only
    kv_indices,
    sm_scale,
    k_factor,  # KVRead's: multiply the prefix's scores / values (fp8's layer scales), else 1.0
    v_factor,
    window,  # W > 0: keys less than W positions behind each query only (USE_WINDOW)
    stride_qt,
    stride_qh,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    stride_ot,
    stride_oh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    kv_group_num: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    FP32_MATH: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    LOGIT_CAP: tl.constexpr,  # C > 0: scores become C * tanh(score / C); 0: plain scores
    KV_MODE: tl.constexpr,  # the pool's (kv_quant: PLAIN, INT8, FP8_E4M3, FP8_E5M2)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    m_begin = tl.program_id(2) * BLOCK_M
    kv_h = h // kv_group_num

    q_start = tl.load(qo_indptr + b)
    ext_len = tl.load(qo_indptr + b + 1) - q_start
    pre_start = tl.load(kv_indptr + b)
    pre_len = tl.load(kv_indptr + b + 1) - pre_start

    if m_begin < ext_len:
        offs_m = m_begin + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dk = offs_dk < Lk
        mask_dv = offs_dv < Lv
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            Q_Ext + rows[:, None] * stride_qt + h * stride_qh + offs_dk[None, :],
            mask=mask_m[:, None] & mask_dk[None, :],
            other=0.0,
        )
        if FP32_MATH:
            q = q.to(tl.float32)

        # Every row sees at least key 0 in its first block, so with a finite start no row
        # ever computes exp(-inf - -inf); padded rows (mask_m false) are never stored.
        m_i = tl.full([BLOCK_M], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

        # Stage 1: the cached prefix, through the paged indices.
        for start in range(0, pre_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < pre_len
            loc = tl.load(kv_indices + pre_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_rows = loc * stride_kt + kv_h * stride_kh
            v_rows = loc * stride_vt + kv_h * stride_vh
            # [BLOCK_DK, BLOCK_N] and [BLOCK_N, BLOCK_DV], in q's dtype (a quantized cache's codes are exact there)
            k = load_kv(K_Buf + k_rows[None, :] + offs_dk[:, None], mask_n[None, :] & mask_dk[:, None], KV_MODE)
            v = load_kv(V_Buf + v_rows[:, None] + offs_dv[None, :], mask_n[:, None] & mask_dv[None, :], KV_MODE)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
            qk = tl.dot(q, k, input_precision=PRECISION) * (sm_scale * k_factor)
            v_weight = v_factor
            if KV_MODE == INT8_MODE:
                qk = qk * int8_row_scales(K_Scales, k_rows, Lk, mask_n)[None, :]
                v_weight = int8_row_scales(V_Scales, v_rows, Lv, mask_n)[None, :]
            qk = soft_cap(qk, LOGIT_CAP)
            visible = mask_n[None, :]
            if USE_WINDOW:
                visible = visible & ((pre_len + offs_m[:, None] - offs_n[None, :]) < window)
            qk = tl.where(visible, qk, float("-inf"))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, qk, v, v_weight, PRECISION)

        # Stage 2: the new tokens themselves, causal; no row of this block sees past its last row
        # (nor, windowed, before the first row's window).
        end = tl.minimum(ext_len, m_begin + BLOCK_M)
        first = 0
        if USE_WINDOW:
            first = tl.maximum(m_begin - window + 1, 0) // BLOCK_N * BLOCK_N
        for start in range(first, end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            cols = (q_start + offs_n).to(tl.int64)
            k = tl.load(
                K_Ext + cols[None, :] * stride_ket + kv_h * stride_keh + offs_dk[:, None],
                mask=mask_n[None, :] & mask_dk[:, None],
                other=0.0,
            )
            v = tl.load(
                V_Ext + cols[:, None] * stride_vet + kv_h * stride_veh + offs_dv[None, :],
                mask=mask_n[:, None] & mask_dv[None, :],
                other=0.0,
            )
            if FP32_MATH:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            qk = soft_cap(tl.dot(q.to(k.dtype), k, input_precision=PRECISION) * sm_scale, LOGIT_CAP)
            causal = mask_n[None, :] & (offs_m[:, None] >= offs_n[None, :])
            if USE_WINDOW:
                causal = causal & ((offs_m[:, None] - offs_n[None, :]) < window)
            qk = tl.where(causal, qk, float("-inf"))
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, qk, v, 1.0, PRECISION)

        # (a padded row past the last query may see no key at all under a window: l_i = 0, never stored)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            O_Ext + rows[:, None] * stride_ot + h * stride_oh + offs_dv[None, :],
            out.to(O_Ext.dtype.element_ty),
            mask=mask_m[:, None] & mask_dv[None, :],
        )


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_cap: float = 0.0,
    kv_format: KVCacheFormat | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of the packed new tokens ``q_extend [T, H, Dk]`` into ``o_extend [T, H, Dv]``.

    Request i owns new tokens ``qo_indptr[i]:qo_indptr[i+1]`` of q/k/v_extend and a cached
    prefix at ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``. ``max_len_extend`` bounds the
    number of new tokens of any request (it sizes the grid; a host-side int, no sync).
    ``sliding_window`` W: each query sees keys less than W positions behind it; the prefix
    must then be the cached tokens right before the new ones (at most the last W - 1).
    ``logit_cap`` C > 0: the scaled scores are soft-capped, ``C * tanh(score / C)`` (Gemma 2); 0: off.
    ``kv_format``: the pool's (None: its buffers hold values; quantized: the prefix is dequantized as
    loaded, fp8 with the layer scales ``k_scale``/``v_scale``).
    """
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be > 0, got {sliding_window}")
    if logit_cap < 0:
        raise ValueError(f"logit_cap must be >= 0 (0: off), got {logit_cap}")
    num_tokens, num_heads, lk = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    lv = v_extend.shape[-1]
    bs = int(qo_indptr.shape[0]) - 1
    read = kv_read(kv_format, k_scale, v_scale)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_buffer.shape[1] != num_kv_heads or read.head_dim(k_buffer) != lk or read.head_dim(v_buffer) != lv:
        raise ValueError(f"pool shape {tuple(k_buffer.shape)} does not match k_extend {tuple(k_extend.shape)}")
    if tuple(o_extend.shape) != (num_tokens, num_heads, lv):
        raise ValueError(f"o_extend has shape {tuple(o_extend.shape)}, expected {(num_tokens, num_heads, lv)}")
    for t, name in ((q_extend, "q"), (k_extend, "k"), (v_extend, "v"), (o_extend, "o"), (k_buffer, "k_buffer")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if bs <= 0 or num_tokens == 0 or max_len_extend <= 0:
        return
    check_launch(_extend_kernel, q_extend, k_extend, k_buffer, kv_indices, o_extend)
    fp32_math = use_fp32_math()

    def grid(meta: dict) -> tuple[int, int, int]:
        return (bs, num_heads, triton.cdiv(max_len_extend, meta["BLOCK_M"]))

    _extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        read.scales(k_buffer),
        read.scales(v_buffer),
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale,
        read.k_factor,
        read.v_factor,
        sliding_window or 0,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o_extend.stride(0),
        o_extend.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        kv_group_num=num_heads // num_kv_heads,
        Lk=lk,
        Lv=lv,
        BLOCK_DK=max(16, next_power_of_2(lk)),  # tl.dot needs K, N >= 16; padding is masked
        BLOCK_DV=max(16, next_power_of_2(lv)),
        FP32_MATH=fp32_math,
        PRECISION=dot_precision(torch.float32 if fp32_math else q_extend.dtype),
        USE_WINDOW=sliding_window is not None,
        LOGIT_CAP=float(logit_cap),
        KV_MODE=read.mode,
    )
