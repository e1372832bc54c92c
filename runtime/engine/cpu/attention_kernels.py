"""CPU attention kernels (``csrc/attention_bf16.c`` and ``csrc/pair_attention.c`` for bf16, ``csrc/attention_f32.c``
for fp32 through ``runtime.engine.cpu.attention_kernels_f32``; built by ``runtime.engine.cpu.kernel_library``; the C
signatures both dtypes share in ``runtime.engine.cpu.attention_abi``). Each entry point takes either dtype and
dispatches on it.

- ``decode_attention``: a decode step's attention over the decode-key mirror (below),
  storing the step's new keys and values into it first (``KeyAppend``);
- ``prefix_attention``: every decode query against a prompt prefix all requests share
  (cascade attention), on a pair-packed copy of the prefix (``pack_prefix``): AMX tile products
  where the CPU has them, else bf16-pair dot products (``csrc/pair_attention.c``); ``decode_attention``
  then continues each softmax over the request's own keys (``init``), so no merge is needed;
- ``causal_attention``: a prefill's causal self-attention over its new tokens, each
  (request, KV head) packed as a prefix is and its query rows reading only the keys up to
  their own position (the matmul path computes bf16 scores for the whole square, and
  torch's flash kernel is ~4x slower still);

Decode attention, why: a decode step has a handful of queries per (request, KV head) (the GQA group), so
torch's batched matmuls run GEMMs with M = 4 and the fp32 softmax between them makes
four more passes over the scores; the CPU flash kernel is slower still. This kernel
walks each request's keys once per KV head, keeps the group's scores and outputs in
registers (AVX-512 where the compiler targets it, plain C elsewhere) with an online
softmax, and parallelises over (request, KV head) with OpenMP (the process's libgomp,
which torch has already loaded). The mirror of a 64-request batch is ~10 MB per layer,
read once per step from DRAM: the kernel software-prefetches the next (request, KV head)'s
keys and values, a cache line per inner-loop step, while it computes the current one
(without it memory and compute did not overlap). It is faster than the matmul path and more
accurate (fp32 scores throughout); docs/benchmarks.md has the figures.

Layouts (the decode-key mirror, ``runtime.engine.cpu.decode_mirror``, keeps exactly these):
``q`` ``[n, Hkv, group, D]`` (rows of a request contiguous, requests ``q.stride(0)``
apart), ``k_t`` ``[n, Hkv, D, cap]`` and ``v`` ``[n, Hkv, cap, D]`` contiguous, key bias
fp32 ``[n, 1, 1, cap]`` (0 / -inf) or None; only keys ``[0, width)`` are read. (A shared
prompt prefix is not streamed through this kernel once per request: ``prefix_attention``
reads it once per 16 query rows of a KV head, and this kernel continues from its result
through ``init``.)

They apply to bf16 CPU tensors (``prefix_attention`` and ``causal_attention`` need an AVX-512 build:
``prefix_supported``) and to fp32 CPU tensors at the AVX2 and AVX-512 levels (all three paths: the
fp32 kernels are vectorised for both; ``attention_kernels_f32.applies``).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from runtime.engine.cpu import attention_kernels_f32 as attn_f32
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.attention_abi import declare_attention_kernels, decode_arguments
from runtime.engine.cpu.kernel_library import declare
from runtime.engine.cpu.kernels import available

MAX_GROUP = 16  # the kernels' bounds (csrc: MAX_G, MAX_D; bf16 also group * D <= 2048)
MAX_HEAD_DIM = 256
MAX_GROUP_X_DIM = 2048

declare_attention_kernels("bf16")
declare("prefix_attention_available", [], ctypes.c_int)


def supports(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``decode_attention`` takes these operands as they are (else use the torch path)."""
    n, hkv, group, d = q.shape
    if group > MAX_GROUP or d > MAX_HEAD_DIM or (q.dtype == torch.bfloat16 and group * d > MAX_GROUP_X_DIM):
        return False
    if q.device.type != "cpu" or q.stride()[1:] != (group * d, d, 1):
        return False  # requests may be strided rows; within one, heads and dims are packed
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False
    if not all(t.device.type == "cpu" and t.dtype == q.dtype and t.is_contiguous() for t in (k_t, v)):
        return False
    if q.dtype == torch.float32:
        return attn_f32.applies()
    return q.dtype == torch.bfloat16 and available()


@dataclass
class KeyAppend:
    """A decode step's new keys and values for the kernel to store into the mirror before it
    attends: ``k``/``v`` ``[n, Hkv, D]`` (request rows may be strided, heads packed) go to key
    index ``pos[b]`` (int64 ``[n]``) of request ``b``'s ``k_t``/``v``."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor


def append_supported(append: KeyAppend, k_t: torch.Tensor, rows: int | None = None) -> bool:
    """Whether ``decode_attention`` can store ``append`` into ``k_t`` (and its V) itself (``rows``:
    the query rows, when a ``kv_row`` map gives several of them one mirror row)."""
    _, hkv, d, _ = k_t.shape
    n = k_t.shape[0] if rows is None else rows
    return (
        all(
            t.dtype == k_t.dtype and t.device.type == "cpu" and t.shape == (n, hkv, d) and t.stride()[1:] == (d, 1)
            for t in (append.k, append.v)
        )
        and append.pos.dtype == torch.int64
        and append.pos.shape == (n,)
        and append.pos.is_contiguous()
    )


def decode_attention(
    q: torch.Tensor,
    k_t: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    width: int,
    with_lse: bool,
    append: KeyAppend | None = None,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_row: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [n, Hkv, group, D] in q's dtype, lse [n, Hkv, group] fp32 or None)``; see the module doc.

    ``append`` (checked with ``append_supported``): store these keys and values first.
    ``init``: ``(out, lse)`` of the same queries over earlier keys (``prefix_attention``):
    the softmax continues from it, so the result covers those keys too.
    ``kv_row`` (int64 ``[n]``): query row b reads row ``kv_row[b]`` of ``k_t``/``v`` (a verify
    step's tokens share their request's row, each with its own bias row and append position);
    None: row b. Call only when ``supports(...)`` is True.
    """
    lib = kernel_library.load()
    assert lib is not None
    n, hkv, group, d = q.shape
    cap = k_t.shape[-1]
    kv_n = k_t.shape[0]
    assert kv_row is None or (kv_row.dtype == torch.int64 and kv_row.shape == (n,) and kv_row.is_contiguous())
    assert kv_row is not None or kv_n == n
    assert k_t.shape == (kv_n, hkv, d, cap) and v.shape == (kv_n, hkv, cap, d) and 0 <= width <= cap
    assert append is None or append_supported(append, k_t, n)
    if init is not None:
        assert init[0].shape == (n, hkv, group, d) and init[1].shape == (n, hkv, group)
        assert all(t.dtype == torch.float32 and t.is_contiguous() for t in init)
    out = q.new_empty(n, hkv, group, d)
    lse = torch.empty(n, hkv, group, dtype=torch.float32) if with_lse else None
    new_k = new_v = pos = None
    stride_k = stride_v = 0
    if append is not None:
        new_k, new_v, pos = append.k.data_ptr(), append.v.data_ptr(), append.pos.data_ptr()
        stride_k, stride_v = append.k.stride(0), append.v.stride(0)
    entry = lib.decode_attention_f32 if q.dtype == torch.float32 else lib.decode_attention_bf16
    rc = entry(
        *decode_arguments(q, k_t, v, bias, scale, width, out, lse, new_k, stride_k, new_v, stride_v, pos, init, kv_row)
    )
    if rc != 0:
        raise ValueError(
            f"decode attention kernel rejected group={group}, head_dim={d} (or an append position or mirror row)"
        )
    return out, lse


PREFIX_KEY_ALIGN = 32  # csrc: the packed prefix is padded to a multiple of this many keys
PREFIX_KEY_BLOCK = 16  # csrc: keys per 64-byte line of the packed K (one AVX-512 register of pairs)


def prefix_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether ``prefix_attention`` (and ``causal_attention``) run for this dtype, device and head dim:
    bf16 needs AVX-512 (it uses the BF16 dot-product instruction where the CPU has it) and a head
    dim that is a multiple of 64; fp32 needs an AVX2 or AVX-512 build."""
    if device.type != "cpu" or head_dim > MAX_HEAD_DIM:
        return False
    if dtype == torch.float32:
        return attn_f32.applies()
    if dtype != torch.bfloat16 or head_dim % 64:
        return False
    lib = kernel_library.load()
    return lib is not None and bool(lib.prefix_attention_available())


@dataclass
class PackedPrefix:
    """A shared prefix's keys and values in the layouts ``prefix_attention`` reads. bf16 pairs:
    ``k`` ``[Hkv, P_pad / 16, D / 2, 16, 2]`` (two adjacent dims of a key; a 16-key block's
    lines contiguous), ``v`` ``[Hkv, P_pad / 2, D, 2]`` (two adjacent keys of a dim); keys
    ``length..P_pad-1`` are zeros. fp32: ``attention_kernels_f32.pack``'s layout."""

    k: torch.Tensor
    v: torch.Tensor
    length: int


def pack_prefix(k: torch.Tensor, v: torch.Tensor) -> PackedPrefix:
    """Pack ``k``/``v`` ``[P, Hkv, D]`` (bf16 or fp32) for ``prefix_attention``."""
    p, hkv, d = k.shape
    if k.dtype == torch.float32:
        return PackedPrefix(*attn_f32.pack(k, v), p)
    p_pad = -(-p // PREFIX_KEY_ALIGN) * PREFIX_KEY_ALIGN
    kz = k.new_zeros(p_pad, hkv, d)
    vz = v.new_zeros(p_pad, hkv, d)
    kz[:p], vz[:p] = k, v
    block = PREFIX_KEY_BLOCK
    packed_k = kz.view(p_pad // block, block, hkv, d // 2, 2).permute(2, 0, 3, 1, 4).contiguous()
    packed_v = vz.view(p_pad // 2, 2, hkv, d).permute(2, 0, 3, 1).contiguous()
    return PackedPrefix(packed_k, packed_v, p)


def prefix_attention(q: torch.Tensor, prefix: PackedPrefix, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[n, Hkv, group, D]`` (the prefix's dtype, request rows may be strided) against a
    packed shared prefix: ``(out [n, Hkv, group, D] fp32, lse [n, Hkv, group] fp32)``. Call only
    when ``prefix_supported`` holds for ``q``."""
    if q.dtype == torch.float32:
        return attn_f32.prefix(q, prefix.k, prefix.v, prefix.length, scale)
    lib = kernel_library.load()
    assert lib is not None
    n, hkv, group, d = q.shape
    assert q.stride()[1:] == (group * d, d, 1) and prefix.k.shape[0] == hkv and prefix.k.shape[2] == d // 2
    out = torch.empty(n, hkv, group, d, dtype=torch.float32)
    lse = torch.empty(n, hkv, group, dtype=torch.float32)
    rc = lib.prefix_attention_bf16(
        q.data_ptr(),
        q.stride(0),
        prefix.k.data_ptr(),
        prefix.v.data_ptr(),
        prefix.length,
        prefix.k.shape[1] * PREFIX_KEY_BLOCK,
        n,
        hkv,
        group,
        d,
        float(scale),
        out.data_ptr(),
        lse.data_ptr(),
    )
    if rc != 0:
        raise ValueError(f"prefix attention kernel rejected head_dim={d}, {prefix.length} keys")
    return out, lse


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Causal self-attention of ``n`` prompts of ``L`` new tokens each, with no cached keys:
    ``q`` ``[n, L, H, D]``, ``k``/``v`` ``[n, L, Hkv, D]`` (bf16 or fp32; token rows may be strided, as
    views of a fused qkv output are, but evenly across requests). Returns ``(out [n * L, H, D]
    in q's dtype, lse [n * L, H] fp32 or None)``, or None where the kernel does not apply (then use
    the matmul or SDPA path). Each (request, KV head) is packed once as ``pack_prefix`` packs a
    prefix and its query rows read only the keys up to their own position, a tile of rows (16 in
    bf16) per key load."""
    n, length, h, d = q.shape
    hkv = k.shape[2]
    if not prefix_supported(q.dtype, q.device, d) or hkv == 0 or h % hkv:
        return None
    token_strides = []
    for t, heads in ((q, h), (k, hkv), (v, hkv)):
        token_stride = t.stride(1) if length > 1 else t.stride(0)  # (a size-1 dim's stride is arbitrary)
        if (
            t.dtype != q.dtype
            or t.device.type != "cpu"
            or tuple(t.shape) != (n, length, heads, d)
            or t.stride()[2:] != (d, 1)
            or (n > 1 and t.stride(0) != length * token_stride)
        ):
            return None
        token_strides.append(token_stride)
    if q.dtype == torch.float32:
        return attn_f32.causal(q, k, v, token_strides, scale, with_lse)
    out = torch.empty(n * length, h, d, dtype=q.dtype)
    lse = torch.empty(n * length, h, dtype=torch.float32) if with_lse else None
    lib = kernel_library.load()
    assert lib is not None
    rc = lib.causal_attention_bf16(
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
        lse.data_ptr() if lse is not None else None,
    )
    return None if rc != 0 else (out, lse)
