"""The C interface the bf16 and fp32 attention kernels share: one signature per entry point.

Each attention entry point exists once per dtype (``decode_attention_bf16`` / ``_f32``,
``prefix_attention_*``, ``causal_attention_*``; ``csrc/entry_points.h`` and the sources) with the
same arguments in the same order, only the element type behind the pointers differing, which ctypes
sees as ``void*`` either way. So each argument list is written here once and declared for both
dtypes (``declare_attention_kernels``), and the decode kernel's 23 positional arguments are put in
that order here once (``decode_arguments``) for the call ``attention_kernels.decode_attention``
makes with either dtype. A change to a kernel's C signature is then one edit here, not two that
must agree.

Why a module of its own: ``attention_kernels`` (bf16, and the entry points that dispatch on dtype)
imports ``attention_kernels_f32``; the signatures belong to neither dtype, and both declare theirs
from here.
"""

from __future__ import annotations

import ctypes

import torch

from runtime.engine.cpu.kernel_library import declare

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int

# decode_attention_<dtype>: one decode step over the decode-key mirror (attention_bf16.c, attention_f32.c)
DECODE_ATTENTION_ARGTYPES = (
    (_ptr, _i64)  # q, q_stride
    + (_ptr, _ptr, _ptr, _i64, _i64)  # kt, v, bias, cap, width
    + (_ptr, _ptr, _i64, _i64, _i64, _i64, _f32)  # out, lse, n, hkv, group, d, scale
    + (_ptr, _i64, _ptr, _i64, _ptr)  # k_new, k_new_stride, v_new, v_new_stride, pos
    + (_ptr, _ptr, _ptr, _i64)  # init_o, init_lse, kv_row, kv_rows
)
# prefix_attention_<dtype>: every decode query against a packed shared prefix
PREFIX_ATTENTION_ARGTYPES = (
    (_ptr, _i64, _ptr, _ptr)  # q, q_stride, packed k, packed v
    + (_i64, _i64, _i64, _i64, _i64, _i64, _f32)  # p, p_pad, n, hkv, group, d, scale
    + (_ptr, _ptr)  # out, lse
)
# causal_attention_<dtype>: a prefill's causal self-attention over its new tokens
CAUSAL_ATTENTION_ARGTYPES = (
    (_ptr, _i64, _ptr, _i64, _ptr, _i64)  # q, q token stride, k, k token stride, v, v token stride
    + (_i64, _i64, _i64, _i64, _i64, _f32)  # n, length, hkv, group, d, scale
    + (_ptr, _ptr)  # out, lse
)


def declare_attention_kernels(dtype_suffix: str) -> None:
    """Declare the decode, prefix and causal attention entry points of one dtype (``"bf16"``,
    ``"f32"``): the same argument lists, the names differing by the suffix."""
    declare(f"decode_attention_{dtype_suffix}", DECODE_ATTENTION_ARGTYPES, _int)
    declare(f"prefix_attention_{dtype_suffix}", PREFIX_ATTENTION_ARGTYPES, _int)
    declare(f"causal_attention_{dtype_suffix}", CAUSAL_ATTENTION_ARGTYPES, _int)


def data_ptr_or_none(t: torch.Tensor | None) -> int | None:
    """``t``'s data pointer, or None (a NULL ``void*``) for an absent optional operand."""
    return t.data_ptr() if t is not None else None


def decode_arguments(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    width: int,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    new_k: int | None,
    stride_k: int,
    new_v: int | None,
    stride_v: int,
    pos: int | None,
    init: tuple[torch.Tensor, torch.Tensor] | None,
    kv_row: torch.Tensor | None,
) -> tuple[int | float | None, ...]:
    """The arguments of ``decode_attention_<dtype>`` in ``DECODE_ATTENTION_ARGTYPES`` order, from
    operands ``attention_kernels.decode_attention`` has checked (its doc says what each is; ``new_k``,
    ``new_v`` and ``pos`` are its ``KeyAppend``'s pointers, None without one)."""
    n, hkv, group, d = q.shape
    return (
        q.data_ptr(),
        q.stride(0),
        k_t.data_ptr(),
        v.data_ptr(),
        data_ptr_or_none(bias),
        k_t.shape[-1],
        width,
        out.data_ptr(),
        data_ptr_or_none(lse),
        n,
        hkv,
        group,
        d,
        float(scale),
        new_k,
        stride_k,
        new_v,
        stride_v,
        pos,
        data_ptr_or_none(init[0] if init is not None else None),
        data_ptr_or_none(init[1] if init is not None else None),
        data_ptr_or_none(kv_row),
        k_t.shape[0],
    )
