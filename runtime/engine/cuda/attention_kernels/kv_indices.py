"""Flatten each request's row of ``req_to_token`` into one packed ``kv_indices`` array.

Attention kernels read a request's KV through ``kv_indices[kv_indptr[i] : kv_indptr[i+1]]``
(its KV-pool slots in token order). Building that array on the device with one program per
request avoids a host round trip and a Python loop per request in every forward.

Memory: ``req_to_token`` belongs to the ReqToTokenPool (read only here); ``kv_indptr`` and
``kv_indices`` are allocated by the caller (the attention backend's per-forward metadata).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.engine.cuda.triton_common import check_launch, interpreter_requested


@triton.jit
def _create_kv_indices_kernel(
    req_to_token,  # [num_req_slots, max_context_len] int32
    req_pool_indices,  # [bs]
    page_kernel_lens,  # [bs]: tokens to copy per request
    kv_indptr,  # [bs + 1]: where each request's run starts in kv_indices
    kv_start_idx,  # [bs] or a dummy when HAS_START is False
    kv_indices,  # [kv_indptr[bs]] output
    stride_req: tl.constexpr,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    req = tl.load(req_pool_indices + pid).to(tl.int64)
    out_start = tl.load(kv_indptr + pid).to(tl.int64)
    num = tl.load(page_kernel_lens + pid).to(tl.int32)
    src_start = 0
    if HAS_START:
        src_start = tl.load(kv_start_idx + pid).to(tl.int64)
    row = req_to_token + req * stride_req + src_start
    for off in range(0, num, BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < num
        slots = tl.load(row + offs, mask=mask, other=0)
        tl.store(kv_indices + out_start + offs, slots.to(kv_indices.dtype.element_ty), mask=mask)


def create_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    page_kernel_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_start_idx: torch.Tensor | None,
    kv_indices: torch.Tensor,
) -> None:
    """Write ``req_to_token[req_pool_indices[i], s_i : s_i + page_kernel_lens[i]]`` at ``kv_indptr[i]``.

    ``s_i`` is ``kv_start_idx[i]`` or 0. ``kv_indptr`` must already hold the exclusive
    prefix sum of ``page_kernel_lens`` and ``kv_indices`` must have room for its total.
    """
    bs = int(req_pool_indices.shape[0])
    if bs == 0:
        return
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token rows must be contiguous")
    check_launch(_create_kv_indices_kernel, req_to_token, req_pool_indices, kv_indptr, kv_indices)
    has_start = kv_start_idx is not None
    _create_kv_indices_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        page_kernel_lens,
        kv_indptr,
        kv_start_idx if has_start else page_kernel_lens,
        kv_indices,
        stride_req=req_to_token.stride(0),
        HAS_START=has_start,
        BLOCK=64 if interpreter_requested() else 512,
    )
