"""CPU kernels for the model's elementwise work, in a small C library compiled on first use.

torch's CPU elementwise ops are the other half of a CPU forward here: on the bench model
(2 cores) its exp runs at ~1.4 G elements/s, so ``silu`` on a prefill's ``[8192, 2816]``
gate takes ~21 ms per layer, and each op is its own pass over memory. These kernels
(``csrc/cpu_kernels.c``) do each job in one pass, in fp32 registers, rounding to bf16
where torch's bf16 ops round:

- ``softmax_rows``: an in-place row softmax of bf16 scores (optionally causal, optionally
  returning each row's log-sum-exp), for the prefill paths that compute scores with
  bf16 matmuls (one pass where torch needs a float copy, a scale, a mask add, a softmax
  and a cast back);
- ``silu_and_mul``, ``gelu_tanh_and_mul``: the gated MLP activations (Gemma's: gelu's tanh form
  as ``x * sigmoid(z)``, one exp);
- ``store_kv``: a forward's new K/V rows into their KV pool slots (torch's indexed
  assignment costs ~200 ns per row);
- ``mirror_gather``: the decode mirror's rebuild, pool rows straight into its transposed K and
  its V (torch needs a gather and a permuted copy);
- ``rms_norm``: RMSNorm, with the residual add fused;
- ``rotary_``: rotary embedding in place on the fused qkv output's q and k heads (torch
  needs four ops and a new tensor: ~7 ms per layer on an 8192-token prefill);
- ``argmax_rows``: greedy sampling's argmax over fp32 logits rows (torch's takes ~0.65 ms
  for a decode step's ``[64, 32000]``);
- ``merge_attention``: two partial attentions (a shared prefix's and each request's own
  keys, cascade attention) combined by their log-sum-exp, reading both through their
  strides (torch's strided fp32 elementwise ops took ~30 ms per layer on the
  shared-prefix prefill's ``[2016, 16, 64]`` outputs).

The attention kernels (decode, shared prefix, causal prefill) are in ``runtime.engine.cpu.attention_kernels``.

They apply to bf16 CPU tensors, except four that also take fp32: ``silu_and_mul``,
``gelu_tanh_and_mul``, ``rms_norm`` and ``rotary_`` (``csrc/elementwise_f32.c``). fp32 is what a host without
native bf16 (AVX2 only: torch emulates bf16 there) serves in, and what the equivalence tests
compare with transformers, so the fp32 kernels compute torch's fp32 formulas: rotary and
RMSNorm bit-identical (each product rounded, no FMA contraction, RMSNorm's sum of squares in
the order of torch's vector reduction), silu's ``x / (1 + exp(-x))`` with a vectorised exp
within ~2 ulp of torch's.

Building: ``runtime.engine.cpu.kernel_library`` compiles ``csrc/*.c`` once per instruction-set
level (AVX-512 with BF16, AVX-512, AVX2, plain C) and loads the best one this CPU runs. The
bf16 kernels take AVX-512 paths where the build has them and plain C elsewhere (the fp32
elementwise ones: 16 lanes of AVX-512, 8 of AVX2, or plain C); the pair-packed prefix and
prefill attention need AVX-512 (``prefix_supported``). Without a
compiler, or with ``TINYSERVE_CPU_KERNELS=0``, ``available()`` is False and callers keep the
torch path.
"""

from __future__ import annotations

import ctypes
from typing import Literal, overload

import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.kernel_library import declare

MAX_SOFTMAX_COLS = 8192  # csrc: MAX_COLS
MAX_NORM_HIDDEN = 8192  # csrc: rmsnorm_bf16's row buffer

_i64, _ptr, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
declare("softmax_rows_bf16", [_ptr, _i64, _i64, _f32, _i64, _i64, _i64, _ptr], _int)
declare("store_kv_rows", [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64], _int)
declare("mirror_gather", [_ptr, _ptr, _i64, _ptr] + [_i64] * 6 + [_ptr, _ptr], _int)
declare("silu_mul_bf16", [_ptr, _i64, _i64, _ptr], None)
declare("gelu_tanh_mul_bf16", [_ptr, _i64, _i64, _ptr], None)
declare("rmsnorm_bf16", [_ptr, _ptr, _ptr, _i64, _i64, _f32, _ptr], None)
declare("merge_attn_bf16", [_i64] * 4 + ([_ptr] + [_i64] * 3) * 4 + [_ptr], None)
declare("rotary_bf16", [_ptr] + [_i64] * 5 + [_ptr, _ptr], None)
declare("argmax_rows_f32", [_ptr, _i64, _i64, _i64, _ptr], None)
declare("silu_mul_f32", [_ptr, _i64, _i64, _ptr], None)
declare("gelu_tanh_mul_f32", [_ptr, _i64, _i64, _ptr], None)
declare("rmsnorm_f32", [_ptr, _ptr, _ptr, _i64, _i64, _f32, _ptr], None)
declare("rotary_f32", [_ptr] + [_i64] * 5 + [_ptr, _ptr], None)
declare("moe_route", [_ptr, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr], None)
declare("moe_sigmoid", [_ptr, _i64, _i64, _ptr], None)
for _suffix in ("bf16", "f32"):
    declare(f"moe_router_{_suffix}", [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr], _int)
for _suffix in ("bf16", "f32"):
    declare(f"rmsnorm_heads_{_suffix}", [_ptr, _i64, _i64, _i64, _i64, _ptr, _f32, _ptr, _i64], None)

# dtype -> the suffix of its elementwise kernels (silu_mul_*, rmsnorm_*, rotary_*)
_ELEMENTWISE = {torch.bfloat16: "bf16", torch.float32: "f32"}


def available() -> bool:
    """True when the kernel is built (or builds now) and loads."""
    return kernel_library.load() is not None


def _bf16_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def _elementwise_suffix(first: torch.Tensor, *rest: torch.Tensor) -> str | None:
    """``"bf16"``/``"f32"`` when every tensor is a contiguous CPU tensor of that one dtype, else None."""
    suffix = _ELEMENTWISE.get(first.dtype)
    if suffix is None or not all(
        t.device.type == "cpu" and t.dtype == first.dtype and t.is_contiguous() for t in (first, *rest)
    ):
        return None
    return suffix


def softmax_supported(scores: torch.Tensor) -> bool:
    """Whether ``softmax_rows`` takes this tensor (else use torch)."""
    return _bf16_cpu(scores) and softmax_applies(scores.device, scores.dtype, scores.shape[-1])


def softmax_applies(device: torch.device, dtype: torch.dtype, cols: int) -> bool:
    """Whether contiguous scores of this device, dtype and row length would go to ``softmax_rows``."""
    return device.type == "cpu" and dtype == torch.bfloat16 and 0 < cols <= MAX_SOFTMAX_COLS and available()


@overload
def softmax_rows(
    scores: torch.Tensor,
    scale: float,
    causal_period: int = ...,
    rows_per_position: int = ...,
    first_position: int = ...,
    *,
    with_lse: Literal[True],
) -> torch.Tensor: ...


@overload
def softmax_rows(
    scores: torch.Tensor,
    scale: float,
    causal_period: int = ...,
    rows_per_position: int = ...,
    first_position: int = ...,
    with_lse: bool = ...,
) -> torch.Tensor | None: ...


def softmax_rows(
    scores: torch.Tensor,
    scale: float,
    causal_period: int = 0,
    rows_per_position: int = 1,
    first_position: int = 0,
    with_lse: bool = False,
) -> torch.Tensor | None:
    """``scores`` (bf16, contiguous, rows along the last dim) becomes ``softmax(scale * scores)`` in place.

    ``causal_period > 0``: the rows come in blocks of ``causal_period`` (one request's
    queries, or a run of them), and row ``i`` of a block is the query at position
    ``first_position + i // rows_per_position`` (``rows_per_position``: the GQA group, when
    a KV head's query heads are folded position-major); it sees keys ``j <=`` that position
    and the rest of its row becomes 0. Returns the rows' fp32 log-sum-exp (shape
    ``scores.shape[:-1]``) when ``with_lse``. Call only when ``softmax_supported(scores)``.
    """
    lib = kernel_library.load()
    assert lib is not None
    cols = scores.shape[-1]
    rows = scores.numel() // cols
    lse = torch.empty(scores.shape[:-1], dtype=torch.float32) if with_lse else None
    rc = lib.softmax_rows_bf16(
        scores.data_ptr(),
        rows,
        cols,
        float(scale),
        causal_period,
        rows_per_position,
        first_position,
        lse.data_ptr() if lse is not None else None,
    )
    if rc != 0:
        raise ValueError(f"softmax kernel rejected {cols} columns")
    return lse


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Write ``k``/``v`` ``[n, Hkv, D]`` (token rows may be strided, as views of a fused qkv
    output are) at pool slots ``loc`` (int64 ``[n]``) of ``k_buf``/``v_buf`` ``[slots, Hkv, D]``;
    False, writing nothing, where the kernel does not apply (then use the pool's own write).
    Slots outside the pool are refused here too, so that write raises its usual error."""
    n = loc.shape[0] if loc.dim() == 1 else -1
    if not (
        available()
        and loc.dtype == torch.int64
        and loc.device.type == "cpu"
        and loc.is_contiguous()
        and k_buf.dtype == v_buf.dtype
        and k_buf.device.type == "cpu"
        and k_buf.is_contiguous()
        and v_buf.is_contiguous()
        and v_buf.shape == k_buf.shape
    ):
        return False
    row = k_buf.shape[1:]
    inner = (row[1], 1) if len(row) == 2 else None
    for t in (k, v):
        if t.dtype != k_buf.dtype or t.device.type != "cpu" or tuple(t.shape) != (n, *row) or t.stride()[1:] != inner:
            return False
    row_bytes = k_buf[0].numel() * k_buf.element_size()
    lib = kernel_library.load()
    assert lib is not None
    return (
        lib.store_kv_rows(
            k.data_ptr(),
            k.stride(0) * k.element_size(),
            v.data_ptr(),
            v.stride(0) * v.element_size(),
            loc.data_ptr(),
            n,
            row_bytes,
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.shape[0],
        )
        == 0
    )


def mirror_gather(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    loc: torch.Tensor,
    width: int,
    dense_k: torch.Tensor,
    dense_v: torch.Tensor,
) -> bool:
    """Keys ``[0, width)`` of the decode mirror's copies (``runtime.engine.cpu.decode_mirror``): the pool rows
    at ``loc`` (int64 ``[n * width]``, request by request) of ``k_buf``/``v_buf`` ``[slots, Hkv, D]``
    into ``dense_k [n, Hkv, D, cap]`` (transposed) and ``dense_v [n, Hkv, cap, D]``, any dtype of 2
    or 4 bytes. False, writing nothing, where the kernel does not apply (then use torch's gather);
    slots outside the pool are refused here too, so that gather raises its usual error."""
    n, hkv, d, cap = dense_k.shape
    tensors = (k_buf, v_buf, dense_k, dense_v)
    if not (
        available()
        and loc.dtype == torch.int64
        and loc.device.type == "cpu"
        and loc.is_contiguous()
        and loc.numel() == n * width
        and 0 <= width <= cap
        and k_buf.element_size() in (2, 4)
    ):
        return False
    if not all(t.device.type == "cpu" and t.dtype == k_buf.dtype and t.is_contiguous() for t in tensors):
        return False
    if k_buf.shape != v_buf.shape or tuple(k_buf.shape[1:]) != (hkv, d) or tuple(dense_v.shape) != (n, hkv, cap, d):
        return False
    lib = kernel_library.load()
    assert lib is not None
    return (
        lib.mirror_gather(
            k_buf.data_ptr(),
            v_buf.data_ptr(),
            k_buf.shape[0],
            loc.data_ptr(),
            n,
            width,
            hkv,
            d,
            cap,
            k_buf.element_size(),
            dense_k.data_ptr(),
            dense_v.data_ptr(),
        )
        == 0
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up [..., 2 * I]`` (gate first; bf16 or fp32, contiguous) as a
    new ``[..., I]`` tensor, or None where the kernel does not apply (then use torch)."""
    return _gated("silu_mul", gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``gelu(gate, approximate="tanh") * up`` of ``gate_up [..., 2 * I]`` (Gemma's MLP) as
    ``silu_and_mul``: the kernel the one-call decode stack runs too, so both give the same bits."""
    return _gated("gelu_tanh_mul", gate_up)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    """The gated activation ``kernel`` (``silu_mul``, ``gelu_tanh_mul``) of ``gate_up``, or None."""
    suffix = _elementwise_suffix(gate_up)
    if not (suffix and gate_up.shape[-1] % 2 == 0 and available()):
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    if out.numel() == 0:
        return out
    lib = kernel_library.load()
    assert lib is not None
    getattr(lib, f"{kernel}_{suffix}")(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of ``x [..., H]`` (of ``residual + x`` when ``residual`` is given, which then
    holds that sum, in place) as a new tensor, or None where the kernel does not apply: every
    operand contiguous, one dtype (bf16 with ``H <= MAX_NORM_HIDDEN``, or fp32); or, without a
    residual, ``x [T, heads, D]`` with packed heads in strided rows (a per-head q/k norm)."""
    if residual is None and not x.is_contiguous():
        if x.dim() == 2:  # strided rows (a q or k part of a fused qkv output, normed whole: OLMoE)
            rows = _rms_norm_heads(x.unsqueeze(1), weight, eps)
            return rows.view(x.shape) if rows is not None else None
        return _rms_norm_heads(x, weight, eps)
    tensors = (x, weight) if residual is None else (x, weight, residual)
    hidden = x.shape[-1]
    suffix = _elementwise_suffix(*tensors)
    if not (suffix and 0 < hidden and weight.shape == (hidden,) and available()):
        return None
    if (residual is not None and residual.shape != x.shape) or (suffix == "bf16" and hidden > MAX_NORM_HIDDEN):
        return None
    out = torch.empty_like(x)
    lib = kernel_library.load()
    assert lib is not None
    getattr(lib, f"rmsnorm_{suffix}")(
        x.data_ptr(),
        residual.data_ptr() if residual is not None else None,
        weight.data_ptr(),
        x.numel() // hidden,
        hidden,
        float(eps),
        out.data_ptr(),
    )
    return out


def _rms_norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of each head of ``x [T, heads, D]`` whose heads are packed within a row and whose rows
    may be strided (the q or k part of a fused qkv output: a per-head q/k norm) as a new contiguous
    tensor, or None where the kernel does not apply. The kernel the one-call decode stack runs on its
    qkv buffer (csrc/head_norm.c), so both paths give the same bits."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or x.device.type != "cpu":
        return None
    t, heads, d = x.shape
    suffix = _elementwise_suffix(weight)
    if suffix is None or x.dtype != weight.dtype or weight.shape != (d,) or not available():
        return None
    if suffix == "bf16" and d > MAX_NORM_HIDDEN:
        return None
    out = torch.empty(t, heads, d, dtype=x.dtype)
    lib = kernel_library.load()
    assert lib is not None
    getattr(lib, f"rmsnorm_heads_{suffix}")(
        x.data_ptr(), t, x.stride(0), heads, d, weight.data_ptr(), float(eps), out.data_ptr(), heads * d
    )
    return out


def moe_route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each row's ``top_k`` experts from router ``logits [T, E]`` (bf16 or fp32, contiguous) as
    ``(ids int64 [T, k], fp32 weights [T, k])``: the softmax's fp32 probabilities' largest (the lower
    id first among equals), divided by their sum where ``renormalize`` (csrc/moe_mlp.c: the routing
    the one-call decode stack runs, so both paths route alike); None where the kernel does not apply."""
    if logits.dim() != 2 or _elementwise_suffix(logits) is None or not 0 < top_k <= logits.shape[1]:
        return None
    lib = kernel_library.load()
    if lib is None:
        return None
    t, e = logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int64)
    weights = torch.empty(t, top_k, dtype=torch.float32)
    lib.moe_route(
        logits.data_ptr(), logits.element_size(), t, e, top_k, int(renormalize), ids.data_ptr(), weights.data_ptr()
    )
    return ids, weights


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x [T, H] @ weight [E, H]^T`` as fp32 dot products rounded to the dtype (csrc/moe_mlp.c: the
    router product the one-call decode stack runs where no kernel set reads the router's weight),
    or None where the kernel does not apply (both contiguous, one dtype: bf16 or fp32)."""
    suffix = _elementwise_suffix(x, weight)
    if suffix is None or x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        return None
    lib = kernel_library.load()
    if lib is None:
        return None
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    getattr(lib, f"moe_router_{suffix}")(
        x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), weight.shape[0], x.shape[1], None, out.data_ptr()
    )
    return out


def sigmoid(x: torch.Tensor) -> torch.Tensor | None:
    """``sigmoid(x)`` of a contiguous bf16 or fp32 tensor in its dtype, computed in fp32 (csrc/moe_mlp.c:
    moe_sigmoid, the shared expert's gate as the one-call decode stack computes it), or None where the
    kernel does not apply."""
    if x.dtype not in (torch.bfloat16, torch.float32) or not x.is_contiguous() or x.device.type != "cpu":
        return None
    lib = kernel_library.load()
    if lib is None:
        return None
    out = torch.empty_like(x)
    lib.moe_sigmoid(x.data_ptr(), x.element_size(), x.numel(), out.data_ptr())
    return out


def merge_attention(
    o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor | None:
    """Softmax over the union of two key sets from each set's output ``[T, A, B, D]`` (bf16,
    any strides with unit stride along D) and log-sum-exp ``[T, A, B]`` (fp32, any strides):
    a new contiguous ``[T, A, B, D]`` bf16 tensor, or None where the kernel does not apply."""
    if not (o_a.dim() == 4 and o_a.shape == o_b.shape and lse_a.shape == lse_b.shape == o_a.shape[:3]):
        return None
    if not all(t.device.type == "cpu" for t in (o_a, o_b, lse_a, lse_b)) or not available():
        return None
    if o_a.dtype != torch.bfloat16 or o_b.dtype != torch.bfloat16 or o_a.stride(-1) != 1 or o_b.stride(-1) != 1:
        return None
    if lse_a.dtype != torch.float32 or lse_b.dtype != torch.float32:
        return None
    out = torch.empty(o_a.shape, dtype=o_a.dtype)
    lib = kernel_library.load()
    assert lib is not None
    lib.merge_attn_bf16(
        *o_a.shape,
        o_a.data_ptr(),
        *o_a.stride()[:3],
        lse_a.data_ptr(),
        *lse_a.stride(),
        o_b.data_ptr(),
        *o_b.stride()[:3],
        lse_b.data_ptr(),
        *lse_b.stride(),
        out.data_ptr(),
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> bool:
    """Rotate ``x [T, heads, D]`` in place (neox halves of the first ``rotary_dim`` dims) by
    ``cos``/``sin`` ``[T, 1, rotary_dim // 2]`` (contiguous, x's dtype: bf16 or fp32); rows may be
    strided, heads must be packed.
    Returns False, touching nothing, where the kernel does not apply (then use torch)."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or rotary_dim % 2 or rotary_dim > x.shape[2]:
        return False
    suffix = _elementwise_suffix(cos, sin)
    if suffix is None or x.dtype != cos.dtype or x.device.type != "cpu":
        return False
    if cos.shape != (x.shape[0], 1, rotary_dim // 2) or sin.shape != cos.shape or not available():
        return False
    lib = kernel_library.load()
    assert lib is not None
    getattr(lib, f"rotary_{suffix}")(
        x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], rotary_dim, cos.data_ptr(), sin.data_ptr()
    )
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` (int64) of fp32 CPU rows ``[rows, cols]`` (unit column stride; the
    first maximum on ties, the first NaN where there is one), or None where the kernel does
    not apply (then use torch)."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    if not available():
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib = kernel_library.load()
    assert lib is not None
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out
