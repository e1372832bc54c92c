"""fp32 CPU attention kernels (``csrc/attention_f32.c``): what ``runtime.engine.cpu.attention_kernels``
calls for fp32 operands. (The decode kernel takes the bf16 one's arguments, so
``attention_kernels.decode_attention`` calls either itself, through ``runtime.engine.cpu.attention_abi``, where
both dtypes' signatures are declared.)

Why: on hosts without AVX-512 BF16 the server runs in fp32 (bf16 matmuls are emulated there),
and without these kernels fp32 attention went through torch: a decode step as two batched
matmuls with a handful of query rows around a four-pass fp32 softmax, a prefill through the CPU
flash kernel. The kernels are the bf16 ones' designs in fp32: one online-softmax pass per
(request, KV head) over the decode-key mirror with the next item's keys prefetched; a shared
prefix read once per tile of query rows of a KV head; a causal prefill whose query rows read
only the keys up to their position. They are written over a vector of fp32 lanes, so each build
level has them: 16 lanes with AVX-512, 8 with AVX2 + FMA, plain C at ``baseline`` (where they
are not used: ``applies`` is False there and torch's own vectorised kernels run instead).

Layouts: the decode kernel reads the mirror as the bf16 one does (``q`` ``[n, Hkv, group, D]``
with request rows strided, ``k_t`` ``[n, Hkv, D, cap]``, ``v`` ``[n, Hkv, cap, D]``, fp32). A
packed prefix (``pack``) is K ``[Hkv, P_pad / 16, D, 16]`` (16 keys side by side per dim: one
64-byte line, a 16-key block contiguous, ``P_pad`` a multiple of 16, zeros past ``P``) and V
``[Hkv, P, D]`` as it is. Scores, softmax and accumulation are fp32; the exponential is the
kernels' polynomial (relative error ~1e-7).
"""

from __future__ import annotations

import ctypes

import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.attention_abi import data_ptr_or_none, declare_attention_kernels
from runtime.engine.cpu.kernel_library import declare

KEY_PACK = 16  # csrc: F32_PACK, keys per block of a packed K

declare("attention_f32_vectorised", [], ctypes.c_int)
declare_attention_kernels("f32")


def applies() -> bool:
    """Whether the fp32 kernels take fp32 attention at the current build level: vector builds
    (AVX2, AVX-512) only; in plain C torch's kernels are faster."""
    lib = kernel_library.load()
    return lib is not None and bool(lib.attention_f32_vectorised())


def pack(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``k``/``v`` ``[P, Hkv, D]`` fp32 -> (K ``[Hkv, P_pad / 16, D, 16]``, V ``[Hkv, P, D]``)."""
    p, hkv, d = k.shape
    p_pad = -(-p // KEY_PACK) * KEY_PACK
    kz = k.new_zeros(p_pad, hkv, d)
    kz[:p] = k
    packed_k = kz.view(p_pad // KEY_PACK, KEY_PACK, hkv, d).permute(2, 0, 3, 1).contiguous()
    return packed_k, v.transpose(0, 1).contiguous()


def prefix(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[n, Hkv, group, D]`` (request rows may be strided) against a prefix packed by ``pack``:
    ``(out [n, Hkv, group, D], lse [n, Hkv, group])`` fp32."""
    lib = kernel_library.load()
    assert lib is not None
    n, hkv, group, d = q.shape
    assert q.dtype == torch.float32 and q.stride()[1:] == (group * d, d, 1)
    assert k.shape == (hkv, k.shape[1], d, KEY_PACK) and v.shape == (hkv, length, d)
    out = torch.empty(n, hkv, group, d, dtype=torch.float32)
    lse = torch.empty(n, hkv, group, dtype=torch.float32)
    rc = lib.prefix_attention_f32(
        q.data_ptr(),
        q.stride(0),
        k.data_ptr(),
        v.data_ptr(),
        length,
        k.shape[1] * KEY_PACK,
        n,
        hkv,
        group,
        d,
        float(scale),
        out.data_ptr(),
        lse.data_ptr(),
    )
    if rc != 0:
        raise ValueError(f"fp32 prefix attention kernel rejected head_dim={d}, {length} keys")
    return out, lse


def causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, token_strides: list[int], scale: float, with_lse: bool
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """``causal_attention_f32`` on checked operands (``attention_kernels.causal_attention``), or None if it refuses."""
    lib = kernel_library.load()
    assert lib is not None
    n, length, h, d = q.shape
    hkv = k.shape[2]
    out = torch.empty(n * length, h, d, dtype=torch.float32)
    lse = torch.empty(n * length, h, dtype=torch.float32) if with_lse else None
    rc = lib.causal_attention_f32(
        q.data_ptr(),
        token_strides[0],
        k.data_ptr(),
        token_strides[1],
        v.data_ptr(),
        token_strides[2],
        n,
        length,
        hkv,
        h // hkv,
        d,
        float(scale),
        out.data_ptr(),
        data_ptr_or_none(lse),
    )
    return None if rc != 0 else (out, lse)
