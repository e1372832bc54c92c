"""bf16 CPU kernels for the model's non-matmul work, in a small C library compiled on first use.

torch's CPU elementwise ops are the other half of a CPU forward here: on the bench model
(2 cores) its exp runs at ~1.4 G elements/s, so ``silu`` on a prefill's ``[8192, 2816]``
gate takes ~21 ms per layer, and each op is its own pass over memory. These kernels
(``csrc/cpu_kernels.c``) do each job in one pass, in fp32 registers, rounding to bf16
where torch's bf16 ops round:

- ``decode_attention``: a decode step's attention over the decode-key mirror (below),
  storing the step's new keys and values into it first (``KeyAppend``);
- ``softmax_rows``: an in-place row softmax of bf16 scores (optionally causal, optionally
  returning each row's log-sum-exp), for the prefill paths that compute scores with
  bf16 matmuls (one pass where torch needs a float copy, a scale, a mask add, a softmax
  and a cast back);
- ``silu_and_mul``: the gated MLP activation;
- ``store_kv``: a forward's new K/V rows into their KV pool slots (torch's indexed
  assignment costs ~200 ns per row);
- ``rms_norm``: RMSNorm, with the residual add fused;
- ``rotary_``: rotary embedding in place on the fused qkv output's q and k heads (torch
  needs four ops and a new tensor: ~7 ms per layer on an 8192-token prefill);
- ``argmax_rows``: greedy sampling's argmax over fp32 logits rows (torch's takes ~0.65 ms
  for a decode step's ``[64, 32000]``);
- ``prefix_attention``: every decode query against a prompt prefix all requests share
  (cascade attention), with bf16-pair dot products (AVX512-BF16) on a pair-packed copy of the prefix
  (``pack_prefix``); ``decode_attention`` then continues each softmax over the request's own
  keys (``init``), so no merge is needed;
- ``causal_attention``: a prefill's causal self-attention over its new tokens, each
  (request, KV head) packed as a prefix is and its query rows reading only the keys up to
  their own position (the matmul path computes bf16 scores for the whole square, and
  torch's flash kernel is ~4x slower still);
- ``merge_attention``: two partial attentions (a shared prefix's and each request's own
  keys, cascade attention) combined by their log-sum-exp, reading both through their
  strides (torch's strided fp32 elementwise ops took ~30 ms per layer on the
  shared-prefix prefill's ``[2016, 16, 64]`` outputs).

They apply to bf16 CPU tensors only: fp32 keeps torch's ops, the path the fp32
equivalence tests compare with transformers.

Decode attention, why: a decode step has a handful of queries per (request, KV head) (the GQA group), so
torch's batched matmuls run GEMMs with M = 4 and the fp32 softmax between them makes
four more passes over the scores; the CPU flash kernel is slower still. This kernel
walks each request's keys once per KV head, keeps the group's scores and outputs in
registers (AVX-512 where the compiler targets it, plain C elsewhere) with an online
softmax, and parallelises over (request, KV head) with OpenMP (the process's libgomp,
which torch has already loaded). The mirror of a 64-request batch is ~10 MB per layer,
read once per step from DRAM: the kernel software-prefetches the next (request, KV head)'s
keys and values, a cache line per inner-loop step, while it computes the current one
(without it memory and compute did not overlap: 0.8 vs 0.37 ms per layer, the latter
~28 GB/s of a measured ~35 GB/s streaming read). On the bench model's decode (64
requests, 4 KV heads x 4 queries, head dim 64, 160 keys, 2 cores) that is ~0.4-0.46 ms per
layer where the matmul path takes ~0.9-1.1 ms, and it is more accurate (fp32 scores
throughout).

Layouts (the decode-key mirror, ``runtime.cpu.decode_mirror``, keeps exactly these):
``q`` ``[n, Hkv, group, D]`` (rows of a request contiguous, requests ``q.stride(0)``
apart), ``k_t`` ``[n, Hkv, D, cap]`` and ``v`` ``[n, Hkv, cap, D]`` contiguous, key bias
fp32 ``[n, 1, 1, cap]`` (0 / -inf) or None; only keys ``[0, width)`` are read. (A shared
prompt prefix is not streamed through this kernel once per request (~0.9 ms per layer for
512 keys x 64 requests): ``prefix_attention`` reads it once per 16 query rows of a KV head,
and this kernel continues from its result through ``init``.)

Building: ``$CC`` (default ``gcc``) with ``-O3 -march=native -fopenmp`` into
``<cache_root>/kernels/`` under a name keyed by the source, the flags and this CPU's
model and flags, written atomically, so each machine compiles once (~1 s). Without a
compiler, or with ``TINYSERVE_CPU_KERNELS=0``, ``available()`` is False and callers keep
the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.c"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-fno-trapping-math",
          "-fassociative-math", "-fno-signed-zeros")
MAX_GROUP = 16  # the kernel's bounds (csrc: MAX_G, MAX_D, group * D <= 2048)
MAX_HEAD_DIM = 256
MAX_GROUP_X_DIM = 2048
MAX_SOFTMAX_COLS = 8192  # csrc: MAX_COLS
MAX_NORM_HIDDEN = 8192  # csrc: rmsnorm_bf16's row buffer


def _cpu_identity() -> str:
    """Model name and flags of this CPU (``-march=native`` code is only valid on a CPU like it)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    keep = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(keep))


def _build(compiler: str, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        subprocess.run([compiler, *CFLAGS, "-o", str(tmp_out), str(SOURCE)], check=True, capture_output=True,
                       text=True, timeout=120)
        os.replace(tmp_out, out)  # atomic: a concurrent builder sees the old file or the whole new one


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("TINYSERVE_CPU_KERNELS", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        logger.info("no C compiler found: the CPU kernels' work runs as torch ops")
        return None
    from runtime.tiny_model import cache_root

    key = hashlib.sha256("\0".join([SOURCE.read_text(), *CFLAGS, compiler, _cpu_identity()]).encode()).hexdigest()
    path = cache_root() / "kernels" / f"cpu_kernels-{key[:16]}.so"
    try:
        if not path.exists():
            _build(compiler, path)
            logger.info("compiled the CPU kernels into %s", path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("CPU kernels unavailable (%s): using torch ops", detail)
        return None
    fn = lib.decode_attention_bf16
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, ctypes.c_float,
                   ptr, i64, ptr, i64, ptr, ptr, ptr]
    fn.restype = ctypes.c_int
    fn = lib.softmax_rows_bf16
    fn.argtypes = [ptr, i64, i64, ctypes.c_float, i64, i64, i64, ptr]
    fn.restype = ctypes.c_int
    lib.store_kv_rows.argtypes = [ptr, i64, ptr, i64, ptr, i64, i64, ptr, ptr, i64]
    lib.store_kv_rows.restype = ctypes.c_int
    lib.silu_mul_bf16.argtypes = [ptr, i64, i64, ptr]
    lib.silu_mul_bf16.restype = None
    lib.rmsnorm_bf16.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ptr]
    lib.rmsnorm_bf16.restype = None
    lib.merge_attn_bf16.argtypes = [i64] * 4 + ([ptr] + [i64] * 3) * 4 + [ptr]
    lib.merge_attn_bf16.restype = None
    lib.rotary_bf16.argtypes = [ptr] + [i64] * 5 + [ptr, ptr]
    lib.rotary_bf16.restype = None
    lib.argmax_rows_f32.argtypes = [ptr, i64, i64, i64, ptr]
    lib.argmax_rows_f32.restype = None
    lib.prefix_attention_available.argtypes = []
    lib.prefix_attention_available.restype = ctypes.c_int
    lib.prefix_attention_bf16.argtypes = [ptr, i64, ptr, ptr] + [i64] * 6 + [ctypes.c_float, ptr, ptr]
    lib.prefix_attention_bf16.restype = ctypes.c_int
    lib.causal_attention_bf16.argtypes = [ptr, i64, ptr, i64, ptr, i64] + [i64] * 5 + [ctypes.c_float, ptr, ptr]
    lib.causal_attention_bf16.restype = ctypes.c_int
    return lib


def available() -> bool:
    """True when the kernel is built (or builds now) and loads."""
    return _library() is not None


def _bf16_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def supports(q: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``decode_attention`` takes these operands as they are (else use the torch path)."""
    n, hkv, group, d = q.shape
    if group > MAX_GROUP or d > MAX_HEAD_DIM or group * d > MAX_GROUP_X_DIM:
        return False
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or q.stride()[1:] != (group * d, d, 1):
        return False  # requests may be strided rows; within one, heads and dims are packed
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return False
    return _bf16_cpu(k_t, v) and available()


@dataclass
class KeyAppend:
    """A decode step's new keys and values for the kernel to store into the mirror before it
    attends: ``k``/``v`` ``[n, Hkv, D]`` (request rows may be strided, heads packed) go to key
    index ``pos[b]`` (int64 ``[n]``) of request ``b``'s ``k_t``/``v``."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor


def append_supported(append: KeyAppend, k_t: torch.Tensor) -> bool:
    """Whether ``decode_attention`` can store ``append`` into ``k_t`` (and its V) itself."""
    n, hkv, d, _ = k_t.shape
    return all(
        t.dtype == k_t.dtype and t.device.type == "cpu" and t.shape == (n, hkv, d) and t.stride()[1:] == (d, 1)
        for t in (append.k, append.v)
    ) and append.pos.dtype == torch.int64 and append.pos.shape == (n,) and append.pos.is_contiguous()


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [n, Hkv, group, D] bf16, lse [n, Hkv, group] fp32 or None)``; see the module doc.

    ``append`` (checked with ``append_supported``): store these keys and values first.
    ``init``: ``(out, lse)`` of the same queries over earlier keys (``prefix_attention``):
    the softmax continues from it, so the result covers those keys too.
    Call only when ``supports(...)`` is True.
    """
    lib = _library()
    assert lib is not None
    n, hkv, group, d = q.shape
    cap = k_t.shape[-1]
    assert k_t.shape == (n, hkv, d, cap) and v.shape == (n, hkv, cap, d) and 0 <= width <= cap
    assert append is None or append_supported(append, k_t)
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
    rc = lib.decode_attention_bf16(
        q.data_ptr(), q.stride(0), k_t.data_ptr(), v.data_ptr(), bias.data_ptr() if bias is not None else None, cap, width,
        out.data_ptr(), lse.data_ptr() if lse is not None else None, n, hkv, group, d, float(scale),
        new_k, stride_k, new_v, stride_v, pos,
        init[0].data_ptr() if init is not None else None, init[1].data_ptr() if init is not None else None,
    )
    if rc != 0:
        raise ValueError(f"decode attention kernel rejected group={group}, head_dim={d} (or an append position)")
    return out, lse


def softmax_supported(scores: torch.Tensor) -> bool:
    """Whether ``softmax_rows`` takes this tensor (else use torch)."""
    return _bf16_cpu(scores) and softmax_applies(scores.device, scores.dtype, scores.shape[-1])


def softmax_applies(device: torch.device, dtype: torch.dtype, cols: int) -> bool:
    """Whether contiguous scores of this device, dtype and row length would go to ``softmax_rows``."""
    return device.type == "cpu" and dtype == torch.bfloat16 and 0 < cols <= MAX_SOFTMAX_COLS and available()


def softmax_rows(scores: torch.Tensor, scale: float, causal_period: int = 0, rows_per_position: int = 1,
                 first_position: int = 0, with_lse: bool = False) -> torch.Tensor | None:
    """``scores`` (bf16, contiguous, rows along the last dim) becomes ``softmax(scale * scores)`` in place.

    ``causal_period > 0``: the rows come in blocks of ``causal_period`` (one request's
    queries, or a run of them), and row ``i`` of a block is the query at position
    ``first_position + i // rows_per_position`` (``rows_per_position``: the GQA group, when
    a KV head's query heads are folded position-major); it sees keys ``j <=`` that position
    and the rest of its row becomes 0. Returns the rows' fp32 log-sum-exp (shape
    ``scores.shape[:-1]``) when ``with_lse``. Call only when ``softmax_supported(scores)``.
    """
    lib = _library()
    assert lib is not None
    cols = scores.shape[-1]
    rows = scores.numel() // cols
    lse = torch.empty(scores.shape[:-1], dtype=torch.float32) if with_lse else None
    rc = lib.softmax_rows_bf16(scores.data_ptr(), rows, cols, float(scale), causal_period, rows_per_position,
                               first_position, lse.data_ptr() if lse is not None else None)
    if rc != 0:
        raise ValueError(f"softmax kernel rejected {cols} columns")
    return lse


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Write ``k``/``v`` ``[n, Hkv, D]`` (token rows may be strided, as views of a fused qkv
    output are) at pool slots ``loc`` (int64 ``[n]``) of ``k_buf``/``v_buf`` ``[slots, Hkv, D]``;
    False, writing nothing, where the kernel does not apply (then use the pool's own write).
    Slots outside the pool are refused here too, so that write raises its usual error."""
    n = loc.shape[0] if loc.dim() == 1 else -1
    if not (available() and loc.dtype == torch.int64 and loc.device.type == "cpu" and loc.is_contiguous()
            and k_buf.dtype == v_buf.dtype and k_buf.device.type == "cpu" and k_buf.is_contiguous()
            and v_buf.is_contiguous() and v_buf.shape == k_buf.shape):
        return False
    row = k_buf.shape[1:]
    inner = (row[1], 1) if len(row) == 2 else None
    for t in (k, v):
        if t.dtype != k_buf.dtype or t.device.type != "cpu" or tuple(t.shape) != (n, *row) or t.stride()[1:] != inner:
            return False
    row_bytes = k_buf[0].numel() * k_buf.element_size()
    lib = _library()
    assert lib is not None
    return lib.store_kv_rows(k.data_ptr(), k.stride(0) * k.element_size(), v.data_ptr(), v.stride(0) * v.element_size(),
                             loc.data_ptr(), n, row_bytes, k_buf.data_ptr(), v_buf.data_ptr(), k_buf.shape[0]) == 0


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """``silu(gate) * up`` of ``gate_up [..., 2 * I]`` (gate first) as a new ``[..., I]``
    tensor, or None where the kernel does not apply (then use torch)."""
    if not (_bf16_cpu(gate_up) and gate_up.shape[-1] % 2 == 0 and available()):
        return None
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inter)
    lib = _library()
    assert lib is not None
    lib.silu_mul_bf16(gate_up.data_ptr(), gate_up.numel() // (2 * inter), inter, out.data_ptr())
    return out


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of ``x [..., H]`` (of ``residual + x`` when ``residual`` is given, which then
    holds that sum, in place) as a new tensor, or None where the kernel does not apply."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    hidden = x.shape[-1]
    if not (_bf16_cpu(*tensors) and hidden <= MAX_NORM_HIDDEN and weight.shape == (hidden,) and available()):
        return None
    if residual is not None and residual.shape != x.shape:
        return None
    out = torch.empty_like(x)
    lib = _library()
    assert lib is not None
    lib.rmsnorm_bf16(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                     x.numel() // hidden, hidden, float(eps), out.data_ptr())
    return out


def merge_attention(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor | None:
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
    lib = _library()
    assert lib is not None
    lib.merge_attn_bf16(*o_a.shape, o_a.data_ptr(), *o_a.stride()[:3], lse_a.data_ptr(), *lse_a.stride(),
                        o_b.data_ptr(), *o_b.stride()[:3], lse_b.data_ptr(), *lse_b.stride(), out.data_ptr())
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> bool:
    """Rotate ``x [T, heads, D]`` in place (neox halves of the first ``rotary_dim`` dims) by
    ``cos``/``sin`` ``[T, 1, rotary_dim // 2]``; rows may be strided, heads must be packed.
    Returns False, touching nothing, where the kernel does not apply (then use torch)."""
    if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2] or rotary_dim % 2 or rotary_dim > x.shape[2]:
        return False
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or not _bf16_cpu(cos, sin):
        return False
    if cos.shape != (x.shape[0], 1, rotary_dim // 2) or sin.shape != cos.shape or not available():
        return False
    lib = _library()
    assert lib is not None
    lib.rotary_bf16(x.data_ptr(), x.shape[0], x.stride(0), x.shape[1], x.shape[2], rotary_dim, cos.data_ptr(),
                    sin.data_ptr())
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
    lib = _library()
    assert lib is not None
    lib.argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
    return out


PREFIX_KEY_ALIGN = 32  # csrc: the packed prefix is padded to a multiple of this many keys
PREFIX_KEY_BLOCK = 16  # csrc: keys per 64-byte line of the packed K (one AVX-512 register of pairs)


def prefix_supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether ``prefix_attention`` runs for this dtype, device and head dim (it needs AVX-512; it
    uses the BF16 dot-product instruction where the CPU has it)."""
    if dtype != torch.bfloat16 or device.type != "cpu" or head_dim % 64 or head_dim > MAX_HEAD_DIM:
        return False
    lib = _library()
    return lib is not None and bool(lib.prefix_attention_available())


@dataclass
class PackedPrefix:
    """A shared prefix's keys and values in the bf16-pair layouts ``prefix_attention`` reads:
    ``k`` ``[Hkv, P_pad / 16, D / 2, 16, 2]`` (two adjacent dims of a key; a 16-key block's
    lines contiguous), ``v`` ``[Hkv, P_pad / 2, D, 2]`` (two adjacent keys of a dim); keys
    ``length..P_pad-1`` are zeros."""

    k: torch.Tensor
    v: torch.Tensor
    length: int


def pack_prefix(k: torch.Tensor, v: torch.Tensor) -> PackedPrefix:
    """Pack ``k``/``v`` ``[P, Hkv, D]`` (bf16) for ``prefix_attention``."""
    p, hkv, d = k.shape
    p_pad = -(-p // PREFIX_KEY_ALIGN) * PREFIX_KEY_ALIGN
    kz = k.new_zeros(p_pad, hkv, d)
    vz = v.new_zeros(p_pad, hkv, d)
    kz[:p], vz[:p] = k, v
    block = PREFIX_KEY_BLOCK
    packed_k = kz.view(p_pad // block, block, hkv, d // 2, 2).permute(2, 0, 3, 1, 4).contiguous()
    packed_v = vz.view(p_pad // 2, 2, hkv, d).permute(2, 0, 3, 1).contiguous()
    return PackedPrefix(packed_k, packed_v, p)


def prefix_attention(q: torch.Tensor, prefix: PackedPrefix, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries ``[n, Hkv, group, D]`` (bf16, request rows may be strided) against a packed shared
    prefix: ``(out [n, Hkv, group, D] fp32, lse [n, Hkv, group] fp32)``. Call only when
    ``prefix_supported`` holds for ``q``."""
    lib = _library()
    assert lib is not None
    n, hkv, group, d = q.shape
    assert q.stride()[1:] == (group * d, d, 1) and prefix.k.shape[0] == hkv and prefix.k.shape[2] == d // 2
    out = torch.empty(n, hkv, group, d, dtype=torch.float32)
    lse = torch.empty(n, hkv, group, dtype=torch.float32)
    rc = lib.prefix_attention_bf16(q.data_ptr(), q.stride(0), prefix.k.data_ptr(), prefix.v.data_ptr(),
                                   prefix.length, prefix.k.shape[1] * PREFIX_KEY_BLOCK, n, hkv, group, d, float(scale),
                                   out.data_ptr(), lse.data_ptr())
    if rc != 0:
        raise ValueError(f"prefix attention kernel rejected head_dim={d}, {prefix.length} keys")
    return out, lse


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Causal self-attention of ``n`` prompts of ``L`` new tokens each, with no cached keys:
    ``q`` ``[n, L, H, D]``, ``k``/``v`` ``[n, L, Hkv, D]`` (bf16; token rows may be strided, as
    views of a fused qkv output are, but evenly across requests). Returns ``(out [n * L, H, D]
    bf16, lse [n * L, H] fp32 or None)``, or None where the kernel does not apply (then use the
    matmul path). Each (request, KV head) is packed once as ``pack_prefix`` packs a prefix and its
    query rows read only the keys up to their own position, 16 rows per key load."""
    n, length, h, d = q.shape
    hkv = k.shape[2]
    if not prefix_supported(q.dtype, q.device, d) or hkv == 0 or h % hkv:
        return None
    token_strides = []
    for t, heads in ((q, h), (k, hkv), (v, hkv)):
        token_stride = t.stride(1) if length > 1 else t.stride(0)  # (a size-1 dim's stride is arbitrary)
        if (t.dtype != q.dtype or t.device.type != "cpu" or tuple(t.shape) != (n, length, heads, d)
                or t.stride()[2:] != (d, 1) or (n > 1 and t.stride(0) != length * token_stride)):
            return None
        token_strides.append(token_stride)
    out = torch.empty(n * length, h, d, dtype=q.dtype)
    lse = torch.empty(n * length, h, dtype=torch.float32) if with_lse else None
    lib = _library()
    assert lib is not None
    rc = lib.causal_attention_bf16(q.data_ptr(), token_strides[0], k.data_ptr(), token_strides[1], v.data_ptr(),
                                   token_strides[2], n, length, hkv, h // hkv, d, float(scale), out.data_ptr(),
                                   lse.data_ptr() if lse is not None else None)
    return None if rc != 0 else (out, lse)
