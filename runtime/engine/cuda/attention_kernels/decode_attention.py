"""Split-K decode attention over the paged KV pool (one new query token per request).

Why two stages: in decode each request has a single query token, so one program per
(request, head) leaves most of a GPU idle on small batches and serialises long
contexts. Stage 1 cuts request i's KV (``kv_indices[kv_indptr[i]:kv_indptr[i+1]]``)
into ``num_kv_splits[i]`` contiguous parts and runs an online softmax over each part
in its own program, writing the part's normalised output and its log-sum-exp. Stage 2
merges the parts of each (request, head) by log-sum-exp. Parts that come out empty
(sequences shorter than the number of splits) are skipped by both stages, which use
the same split arithmetic.

Two stage-1 variants: per head (one query head per program, fp32 vector math) and
grouped (all query heads that share one KV head in one program, so K/V are read once
per group and QK^T / PV run as tensor-core dots). The grouped one is picked for GQA.

Soft-capped logits (Gemma 2): ``logit_cap`` C > 0 makes stage 1 take ``C * tanh(score / C)`` of
each scaled score before the mask (``logit_cap.soft_cap``); stage 2 merges the capped parts as any.

A quantized cache (``memory.kv_format``: int8 rows with their scale, fp8 with per-layer scales)
is dequantized as each block is loaded (``runtime.engine.cuda.kv_quant``): the codes enter the dots
in the model's dtype, an int8 row's scale multiplies its key's score and softmax weight, the fp8
layer scales fold into the softmax scale and the output. A plain cache in another dtype than the
model's (bf16 under fp32) is cast to the model's dtype as it loads.

Memory: ``k_buffer``/``v_buffer`` are one layer of the MHATokenToKVPool (read only);
``attn_logits``/``attn_lse`` are scratch owned by the caller (the backend's per-forward
metadata); ``o`` is the caller's output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from memory.kv_format import KVCacheFormat
from runtime.engine.cuda.attention_kernels.logit_cap import soft_cap
from runtime.engine.cuda.kv_quant import INT8_MODE, int8_row_scales, kv_read, load_kv
from runtime.engine.cuda.triton_common import (
    cdiv,
    check_launch,
    device_core_count,
    dot_precision,
    interpreter_requested,
    next_power_of_2,
    use_fp32_math,
)

# Heads per grouped program: tl.dot needs M >= 16 on tensor cores.
_BLOCK_H = 16


def _stage1_configs(grouped: bool) -> list[triton.Config]:
    """Autotune space; decided when this module is imported (same moment Triton picks its mode)."""
    if interpreter_requested():
        return [triton.Config({"BLOCK_N": 16}, num_warps=1, num_stages=1)]
    if grouped:
        return [
            triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
            triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
            triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=3),
            triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
        ]
    return [
        triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 64}, num_warps=4, num_stages=2),
        triton.Config({"BLOCK_N": 128}, num_warps=8, num_stages=2),
    ]


def split_align() -> int:
    """Split lengths are rounded up to this many tokens (whole blocks on a GPU; 1 under the interpreter)."""
    return 1 if interpreter_requested() else 32


def min_tokens_per_split() -> int:
    """A split shorter than this costs more in merging than it gains in parallelism."""
    return 16 if interpreter_requested() else 128


@triton.autotune(configs=_stage1_configs(grouped=False), key=["Lk", "Lv", "kv_group_num", "KV_MODE"])
@triton.jit
def _decode_stage1_per_head(
    Q,  # [bs, H, Lk]
    K_Buf,  # [slots, Hkv, row]: row = Lk values (int8: Lk codes, then the fp32 scale's 4 bytes)
    V_Buf,  # [slots, Hkv, row]
    K_Scales,  # int8: fp32 views of K_Buf / V_Buf (the rows' scales); else unused
    V_Scales,
    sm_scale,  # the softmax scale times KVRead.k_factor
    v_factor,  # KVRead.v_factor: multiplies the output
    kv_indptr,  # [bs + 1]
    kv_indices,  # [total]
    num_kv_splits,  # [bs]
    Att_Out,  # [bs, H, max_kv_splits, Lv] fp32
    Att_Lse,  # [bs, H, max_kv_splits] fp32
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ab,
    stride_ah,
    stride_as,
    stride_lb,
    stride_lh,
    kv_group_num: tl.constexpr,
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    LOGIT_CAP: tl.constexpr,  # C > 0: scores become C * tanh(score / C); 0: plain scores
    KV_MODE: tl.constexpr,  # kv_quant: PLAIN, INT8, FP8_E4M3, FP8_E5M2
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    kv_h = h // kv_group_num

    kv_start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - kv_start
    n_splits = tl.maximum(tl.load(num_kv_splits + b), 1)
    per_split = (seq_len + n_splits - 1) // n_splits
    per_split = (per_split + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN
    s0 = split * per_split
    s1 = tl.minimum(s0 + per_split, seq_len)

    if s1 > s0:
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dk = offs_dk < Lk
        mask_dv = offs_dv < Lv
        q = tl.load(Q + b * stride_qb + h * stride_qh + offs_dk, mask=mask_dk, other=0.0).to(tl.float32)

        m_i = -1e30  # finite start: a masked column can never produce exp(-inf - -inf)
        l_i = 0.0
        acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
        for start in range(s0, s1, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < s1
            loc = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_rows = loc * stride_kt + kv_h * stride_kh
            k = load_kv(K_Buf + k_rows[:, None] + offs_dk[None, :], mask_n[:, None] & mask_dk[None, :], KV_MODE)
            qk = tl.sum(q[None, :] * k.to(tl.float32), 1) * sm_scale
            if KV_MODE == INT8_MODE:
                qk = qk * int8_row_scales(K_Scales, k_rows, Lk, mask_n)
            qk = tl.where(mask_n, soft_cap(qk, LOGIT_CAP), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new)
            v_rows = loc * stride_vt + kv_h * stride_vh
            v = load_kv(V_Buf + v_rows[:, None] + offs_dv[None, :], mask_n[:, None] & mask_dv[None, :], KV_MODE)
            pv = p
            if KV_MODE == INT8_MODE:
                pv = p * int8_row_scales(V_Scales, v_rows, Lv, mask_n)
            acc = acc * alpha + tl.sum(pv[:, None] * v.to(tl.float32), 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new

        base = Att_Out + b * stride_ab + h * stride_ah + split * stride_as
        tl.store(base + offs_dv, acc / l_i * v_factor, mask=mask_dv)
        tl.store(Att_Lse + b * stride_lb + h * stride_lh + split, m_i + tl.log(l_i))


@triton.autotune(configs=_stage1_configs(grouped=True), key=["Lk", "Lv", "kv_group_num", "KV_MODE"])
@triton.jit
def _decode_stage1_grouped(
    Q,
    K_Buf,
    V_Buf,
    K_Scales,
    V_Scales,
    sm_scale,
    v_factor,
    kv_indptr,
    kv_indices,
    num_kv_splits,
    Att_Out,
    Att_Lse,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ab,
    stride_ah,
    stride_as,
    stride_lb,
    stride_lh,
    kv_group_num: tl.constexpr,
    HEADS_PER_PROG: tl.constexpr,  # min(BLOCK_H, kv_group_num)
    PROGS_PER_KV: tl.constexpr,  # cdiv(kv_group_num, HEADS_PER_PROG)
    Lk: tl.constexpr,
    Lv: tl.constexpr,
    BLOCK_DK: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
    FP32_MATH: tl.constexpr,
    PRECISION: tl.constexpr,
    LOGIT_CAP: tl.constexpr,  # C > 0: scores become C * tanh(score / C); 0: plain scores
    KV_MODE: tl.constexpr,  # kv_quant: PLAIN, INT8, FP8_E4M3, FP8_E5M2
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    hp = tl.program_id(1)
    split = tl.program_id(2)
    kv_h = hp // PROGS_PER_KV
    first_head = kv_h * kv_group_num + (hp % PROGS_PER_KV) * HEADS_PER_PROG
    offs_h = tl.arange(0, BLOCK_H)
    heads = first_head + offs_h
    mask_h = (offs_h < HEADS_PER_PROG) & (heads < (kv_h + 1) * kv_group_num)

    kv_start = tl.load(kv_indptr + b)
    seq_len = tl.load(kv_indptr + b + 1) - kv_start
    n_splits = tl.maximum(tl.load(num_kv_splits + b), 1)
    per_split = (seq_len + n_splits - 1) // n_splits
    per_split = (per_split + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN
    s0 = split * per_split
    s1 = tl.minimum(s0 + per_split, seq_len)

    if s1 > s0:
        offs_dk = tl.arange(0, BLOCK_DK)
        offs_dv = tl.arange(0, BLOCK_DV)
        mask_dk = offs_dk < Lk
        mask_dv = offs_dv < Lv
        # Padded head rows load q = 0: their scores stay finite and their output is never stored.
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_dk[None, :],
            mask=mask_h[:, None] & mask_dk[None, :],
            other=0.0,
        )
        if FP32_MATH:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_H], -1e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
        for start in range(s0, s1, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            mask_n = offs_n < s1
            loc = tl.load(kv_indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k_rows = loc * stride_kt + kv_h * stride_kh
            # [BLOCK_DK, BLOCK_N]: K^T of this block, in q's dtype (a quantized cache's codes are exact there)
            k = load_kv(K_Buf + k_rows[None, :] + offs_dk[:, None], mask_n[None, :] & mask_dk[:, None], KV_MODE)
            k = k.to(q.dtype)
            qk = tl.dot(q, k, input_precision=PRECISION) * sm_scale
            if KV_MODE == INT8_MODE:
                qk = qk * int8_row_scales(K_Scales, k_rows, Lk, mask_n)[None, :]
            qk = tl.where(mask_n[None, :], soft_cap(qk, LOGIT_CAP), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            v_rows = loc * stride_vt + kv_h * stride_vh
            v = load_kv(V_Buf + v_rows[:, None] + offs_dv[None, :], mask_n[:, None] & mask_dv[None, :], KV_MODE)
            v = v.to(q.dtype)
            pv = p
            if KV_MODE == INT8_MODE:
                pv = p * int8_row_scales(V_Scales, v_rows, Lv, mask_n)[None, :]
            acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=PRECISION)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        base = Att_Out + b * stride_ab + heads[:, None] * stride_ah + split * stride_as + offs_dv[None, :]
        tl.store(base, acc / l_i[:, None] * v_factor, mask=mask_h[:, None] & mask_dv[None, :])
        tl.store(Att_Lse + b * stride_lb + heads * stride_lh + split, m_i + tl.log(l_i), mask=mask_h)


@triton.jit
def _decode_stage2(
    Att_Out,
    Att_Lse,
    O,  # noqa: E741 ([bs, H, Lv]: the kernel keeps the upstream parameter names)
    kv_indptr,
    num_kv_splits,
    stride_ab,
    stride_ah,
    stride_as,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    Lv: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(kv_indptr + b + 1) - tl.load(kv_indptr + b)
    n_splits = tl.maximum(tl.load(num_kv_splits + b), 1)
    per_split = (seq_len + n_splits - 1) // n_splits
    per_split = (per_split + SPLIT_ALIGN - 1) // SPLIT_ALIGN * SPLIT_ALIGN

    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < Lv
    m_i = -1e30
    l_i = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for split in range(0, MAX_KV_SPLITS):
        s0 = split * per_split
        s1 = tl.minimum(s0 + per_split, seq_len)
        if s1 > s0:  # the same test stage 1 used to decide whether it wrote this part
            part = tl.load(
                Att_Out + b * stride_ab + h * stride_ah + split * stride_as + offs_dv, mask=mask_dv, other=0.0
            )
            lse = tl.load(Att_Lse + b * stride_lb + h * stride_lh + split)
            m_new = tl.maximum(m_i, lse)
            alpha = tl.exp(m_i - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * alpha + w * part
            l_i = l_i * alpha + w
            m_i = m_new
    # l_i >= 1 whenever a part exists (the part holding the max has weight 1); an empty request writes 0.
    out = acc / tl.maximum(l_i, 1e-30)
    tl.store(O + b * stride_ob + h * stride_oh + offs_dv, out.to(O.dtype.element_ty), mask=mask_dv)


def get_num_kv_splits(
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    max_kv_splits: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Pick how many parts to split each request's KV into (int32 ``[bs]`` on ``seq_lens.device``).

    Enough programs to keep every SM busy (about two waves), spread in proportion to
    each request's length (a long request gets more parts than a short one in the same
    batch), never parts shorter than ``min_tokens_per_split()`` tokens, and at most
    ``max_kv_splits``. On cpu (the interpreter runs programs one at a time) this is 1
    for all but tiny batches. Computed with tensor ops: no device-to-host sync.
    """
    device = torch.device(device) if device is not None else seq_lens.device
    bs = int(seq_lens.shape[0])
    if bs == 0:
        return torch.zeros(0, dtype=torch.int32, device=seq_lens.device)
    group = max(num_heads // max(num_kv_heads, 1), 1)
    if group > 1:
        head_programs = num_kv_heads * cdiv(group, min(_BLOCK_H, group))
    else:
        head_programs = num_heads
    wanted = max(cdiv(2 * device_core_count(device), bs * head_programs), 1)
    lens = seq_lens.to(torch.int64).clamp(min=1)
    longest = lens.max()
    by_share = (wanted * lens + longest - 1) // longest
    by_length = (lens + min_tokens_per_split() - 1) // min_tokens_per_split()
    splits = torch.minimum(by_share, by_length).clamp(min=1, max=max_kv_splits)
    return splits.to(torch.int32)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    grouped: bool | None = None,
    logit_cap: float = 0.0,
    kv_format: KVCacheFormat | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention of ``q [bs, H, Dk]`` over each request's paged KV, written into ``o [bs, H, Dv]``.

    ``grouped`` selects the stage-1 variant: None picks grouped when ``H / Hkv > 1``.
    ``logit_cap`` C > 0: the scaled scores are soft-capped, ``C * tanh(score / C)`` (Gemma 2); 0: off.
    ``kv_format``: the pool's (None: its buffers hold values; quantized: dequantized as loaded, fp8
    with the layer scales ``k_scale``/``v_scale``).
    ``num_kv_splits[i]`` must lie in ``[1, max_kv_splits]``; ``attn_logits``/``attn_lse``
    need room for ``max_kv_splits`` parts per (request, head).
    """
    bs, num_heads, lk = q.shape
    num_kv_heads = k_buffer.shape[1]
    read = kv_read(kv_format, k_scale, v_scale)
    lv = read.head_dim(v_buffer)
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if read.head_dim(k_buffer) != lk or tuple(o.shape) != (bs, num_heads, lv):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k_buffer.shape)}, o {tuple(o.shape)}")
    if attn_logits.shape[2] < max_kv_splits or attn_lse.shape[2] < max_kv_splits:
        raise ValueError("attn_logits/attn_lse have fewer split slots than max_kv_splits")
    for t, name in ((q, "q"), (k_buffer, "k_buffer"), (v_buffer, "v_buffer"), (o, "o"), (attn_logits, "attn_logits")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    if logit_cap < 0:
        raise ValueError(f"logit_cap must be >= 0 (0: off), got {logit_cap}")
    if bs == 0:
        return
    group = num_heads // num_kv_heads
    if grouped is None:
        grouped = group > 1
    block_dk = max(16, next_power_of_2(lk))  # tl.dot needs K, N >= 16; padding is masked
    block_dv = max(16, next_power_of_2(lv))
    align = split_align()
    common = dict(
        stride_qb=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=k_buffer.stride(0),
        stride_kh=k_buffer.stride(1),
        stride_vt=v_buffer.stride(0),
        stride_vh=v_buffer.stride(1),
        stride_ab=attn_logits.stride(0),
        stride_ah=attn_logits.stride(1),
        stride_as=attn_logits.stride(2),
        stride_lb=attn_lse.stride(0),
        stride_lh=attn_lse.stride(1),
        kv_group_num=group,
        Lk=lk,
        Lv=lv,
        BLOCK_DK=block_dk,
        BLOCK_DV=block_dv,
        SPLIT_ALIGN=align,
        LOGIT_CAP=float(logit_cap),
        KV_MODE=read.mode,
    )
    args = (
        *(q, k_buffer, v_buffer, read.scales(k_buffer), read.scales(v_buffer)),
        *(sm_scale * read.k_factor, read.v_factor, kv_indptr, kv_indices, num_kv_splits, attn_logits, attn_lse),
    )
    if grouped:
        check_launch(_decode_stage1_grouped, q, k_buffer, v_buffer, kv_indices, attn_logits)
        heads_per_prog = min(_BLOCK_H, group)
        progs_per_kv = cdiv(group, heads_per_prog)
        _decode_stage1_grouped[(bs, num_kv_heads * progs_per_kv, max_kv_splits)](
            *args,
            **common,
            HEADS_PER_PROG=heads_per_prog,
            PROGS_PER_KV=progs_per_kv,
            BLOCK_H=_BLOCK_H,
            FP32_MATH=use_fp32_math(),
            PRECISION=dot_precision(q.dtype if not use_fp32_math() else torch.float32),
        )
    else:
        check_launch(_decode_stage1_per_head, q, k_buffer, v_buffer, kv_indices, attn_logits)
        _decode_stage1_per_head[(bs, num_heads, max_kv_splits)](*args, **common)

    _decode_stage2[(bs, num_heads)](
        attn_logits,
        attn_lse,
        o,
        kv_indptr,
        num_kv_splits,
        attn_logits.stride(0),
        attn_logits.stride(1),
        attn_logits.stride(2),
        attn_lse.stride(0),
        attn_lse.stride(1),
        o.stride(0),
        o.stride(1),
        Lv=lv,
        BLOCK_DV=block_dv,
        MAX_KV_SPLITS=max_kv_splits,
        SPLIT_ALIGN=align,
        num_warps=4 if block_dv >= 128 else 2,
    )
