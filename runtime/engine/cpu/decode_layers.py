"""A decode step's decoder layers in one C call (``csrc/decode_layers.c``).

Once its linears run on fast kernels, what a decode step spends between kernels weighs: each
layer's ten kernel calls go through their Python wrappers (shape checks, ``torch.empty``,
views, ctypes argument conversion) and the attention backend's per-layer plan, while the other
OpenMP threads wait for the next parallel region (docs/benchmarks.md has the figures).
``decode_layers_amx`` / ``_dp`` / ``_f32`` call the same kernels in the same order for every
layer from C: the results are the layer stack's bit for bit, the interpreter work per step is
one call.

It takes the steady state of serving, a decode step that appends to the attention backend's
decode-key mirror (``runtime.engine.cpu.decode_mirror``), of Llama-family layers that the kernels run
whole: no tensor parallelism, no per-head q/k norm, no windowed layers, and linears that the
layer stack too would run on one of our kernels for this many rows: bf16 with every weight in
the layout the AMX kernel reads (AMX on) or in oneDNN's AVX512-BF16 layout that
``dp_linear_bf16`` reads (CPUs without AMX), at most ``AMX_LINEAR_MAX_ROWS`` requests; fp32
(what AVX2 hosts serve) with every weight's panel copy and a row count in ``fp32_panel_rows()``, or
fp32 with every linear kept quantized (``--quantization``: ``quant_linear_f32``, any row count).
Anything else (``run`` returns None) goes through the layers one by one.
``TINYSERVE_CPU_DECODE_LAYERS=0`` (or ``use_decode_layers(False)``) turns it off.

Who picks it: the model runner asks its device ops for a layer stack once (``CpuOps.layer_stack``
gives a ``CpuLayerStack`` of the model) and hands it to every forward it runs eagerly; the
stack asks ``run`` on every forward and falls back to the model's own ``run_layers``. What the
C call needs of each layer comes from the model (``decode_weights``: ``DecoderLayerWeights``),
never from its attribute names; the packed copies of the weights come from ``prepacked``.

Ownership: the C call writes the KV pool's and the mirror's rows of the step's new tokens (as
the backend's ``forward`` would) and the residual stream (the embeddings' buffer, as the layer
stack does). Its scratch buffers between kernels belong to the ``CpuLayerStack`` and are reused
by every step (``StepScratch``: grown to the largest batch seen, never shrunk); the last layer's
output, which the caller keeps, is a fresh tensor each step.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from typing import Any, Iterator

import torch

from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_f32 as attn_f32
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.kernel_library import declare
from runtime.engine.cpu.layer_description import QUANT_SETS, StackDescription, _Layer, describe_layers, has_blocks
from runtime.engine.cpu.prepacked import (
    AMX_LINEAR_MAX_ROWS,
    fp32_panel_rows,
    packed_generation,
)
from runtime.engine.cpu.quant_kernels import BLOCK_ROWS_MAX
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.ops.layer_stack import DecoderStackModel
from runtime.engine.ops.rope import RopeInputs
from runtime.engine.ops.torch_ops import rope_cos_sin

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Step(ctypes.Structure):
    """csrc/decode_layers.c: DecodeStep."""

    _fields_ = (
        [
            (name, _i64)
            for name in (
                "n",
                "hidden",
                "q_heads",
                "kv_heads",
                "head_dim",
                "inter",
                "rot_dim",
                "cap",
                "width",
                "prefix_len",
                "prefix_pad",
                "pool_slots",
            )
        ]
        + [("eps", _f32), ("scale", _f32)]
        + [
            (name, _ptr)
            for name in (
                "residual",
                "hidden_out",
                "cos",
                "sin",
                "out_loc",
                "append_pos",
                "mask",
                "normed",
                "qkv",
                "attn",
                "o",
                "mid",
                "gate_up",
                "prefix_out",
                "prefix_lse",
                "kv_row",
            )
        ]
        + [("kv_rows", _i64)]
    )


_ENTRY_POINTS = {
    "amx": "decode_layers_amx",
    "dp": "decode_layers_dp",
    "f32": "decode_layers_f32",
    "qf32": "decode_layers_qf32",
    "qbf16": "decode_layers_qbf16",
}
for _name in _ENTRY_POINTS.values():
    declare(_name, [ctypes.POINTER(_Step), ctypes.POINTER(_Layer), _i64], ctypes.c_int)

_STAGES = (
    "",
    "qkv linear",
    "KV pool write",
    "prefix attention",
    "decode attention",
    "o linear",
    "gate/up + silu",
    "down linear",
)
_enabled: list[bool] = []  # use_decode_layers' stack of settings


@functools.lru_cache(maxsize=None)
def _enabled_by_env() -> bool:
    return os.environ.get("TINYSERVE_CPU_DECODE_LAYERS", "1") != "0"


def enabled() -> bool:
    return _enabled[-1] if _enabled else _enabled_by_env()


@contextlib.contextmanager
def use_decode_layers(on: bool) -> Iterator[None]:
    """Within the block, decode steps take the one-call path (``on``, where it applies) or not."""
    _enabled.append(on)
    try:
        yield
    finally:
        _enabled.pop()


class StepScratch:
    """The one-call path's buffers between kernels (``_call``), kept from step to step: a step's
    rows are the first ``n`` rows of each, so a buffer is re-made only when a batch outgrows it.
    Owned by one ``CpuLayerStack``; only the step running reads or writes them."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def rows(self, name: str, n: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous ``[n, cols]`` view of the buffer ``name`` (its contents are stale)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape[0] < n or buf.shape[1] != cols or buf.dtype != dtype:
            rows = max(n, buf.shape[0] if buf is not None and buf.shape[1] == cols and buf.dtype == dtype else 0)
            buf = self._buffers[name] = torch.empty(rows, cols, dtype=dtype)
        return buf[:n]


class CpuLayerStack:
    """A model's decoder layers on CPU (``CpuOps.layer_stack``): a decode step the C call runs whole
    goes through it, every other forward through the model's layers one by one.

    Owns the description of the model's layers for the call (re-made when a packed copy it read was
    made or dropped since; a model the call declined stays declined until then).
    """

    def __init__(self, model: DecoderStackModel) -> None:
        self.model = model
        self.described: StackDescription | None = None
        # a dual model's (--quantization gguf_dual) few-row steps: the kernels that read the blocks
        self.described_blocks: StackDescription | None = None
        self._generation = -1  # the packed_generation() self.described was made at (-1: never)
        self.scratch = StepScratch()

    def __call__(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(rope, hidden.dtype)
        whole = run(self, hidden, cos, sin, rope.cache.rotary_dim, batch, backend)
        return whole if whole is not None else self.model.run_layers(rope, hidden, batch, backend)

    def description(self, rows: int | None = None) -> StackDescription | None:
        """The cached ``describe_layers`` of the model's layers (one integer compare while current)
        for a step of ``rows`` rows: a dual model's blocks up to ``BLOCK_ROWS_MAX`` rows, as its
        layers' linears read them (``CpuOps.linear``), the dense values above (and for None)."""
        generation = packed_generation()
        if generation != self._generation:
            weights = self.model.decode_weights()
            self.described = describe_layers(weights) if weights else None
            self.described_blocks = describe_layers(weights, blocks=True) if weights and has_blocks(weights) else None
            self._generation = generation
        if rows is not None and rows <= BLOCK_ROWS_MAX and self.described_blocks is not None:
            return self.described_blocks
        return self.described


def _rows_taken(dtype: torch.dtype, n: int, kernels: str | None = None) -> bool:
    """Whether the step's linear kernel runs a batch of ``n`` rows (as the layer stack's would;
    ``kernels``: the set, once known)."""
    if kernels in QUANT_SETS:
        return n > 0  # (the quantized kernel takes any rows)
    if dtype == torch.bfloat16:
        return 0 < n <= AMX_LINEAR_MAX_ROWS
    return dtype == torch.float32 and n in fp32_panel_rows()


def _kernels_run(kernels: str, lib: Any) -> bool:
    """Whether the set's kernels run in this process as the layer stack would reach them (else the
    stack's linears or attention take another path: the call must not run)."""
    if kernels == "amx":
        return lib.tinyserve_amx(-1) == 1
    if kernels in ("dp", "qbf16"):
        # (dp_linear_bf16 declines in other builds, and the bf16 attention kernels are the layer
        # stack's path only in this one)
        return kernel_library.level() == "avx512bf16"
    return attn_f32.applies()  # (f32, qf32)


def run(
    layers: CpuLayerStack,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    batch: Any,
    backend: Any,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(hidden, residual)`` after every layer of ``layers`` for a decode batch's embeddings
    ``hidden [n, H]`` (which become the residual stream, as in the layer stack), with the rotary
    ``cos``/``sin`` ``[n, 1, rotary_dim // 2]``; None where the one-call path does not apply
    (nothing is touched then: run the layers)."""
    n, dtype = hidden.shape[0], hidden.dtype
    if not enabled() or not (_rows_taken(dtype, n) or (dtype == torch.float32 and n > 0)):
        return None
    claim = getattr(backend, "claim_decode_step", None)
    lib = kernel_library.load()
    if claim is None or lib is None or batch.forward_mode not in (ForwardMode.DECODE, ForwardMode.VERIFY):
        return None
    stack = layers.description(n)
    if stack is None or stack.dtype != dtype or hidden.shape != (n, stack.hidden) or not hidden.is_contiguous():
        return None
    if not _rows_taken(dtype, n, stack.kernels):
        return None
    if not _kernels_run(stack.kernels, lib):
        return None
    half = rotary_dim // 2
    if (
        rotary_dim % 2
        or rotary_dim > stack.head_dim
        or any(t.dtype != dtype or t.shape != (n, 1, half) or not t.is_contiguous() for t in (cos, sin))
    ):
        return None
    loc = batch.out_cache_loc
    pool = batch.token_to_kv_pool
    if loc.dtype != torch.int64 or loc.shape != (n,) or not loc.is_contiguous():
        return None
    num_layers = len(stack.layers)
    if getattr(pool, "dtype", None) != dtype or len(getattr(pool, "k_buffer", ())) != num_layers:
        return None
    mirror = claim(batch, num_layers)  # from here on the step is committed to this call
    if mirror is None:
        return None
    return _call(lib, stack, layers.scratch, mirror, hidden, cos, sin, rotary_dim, loc, pool)


def _padded_keys(prefix: attn_kernels.PackedPrefix, dtype: torch.dtype) -> int:
    """The packed prefix's key count with its zero padding (its K's key blocks times their width)."""
    return prefix.k.shape[1] * (attn_kernels.PREFIX_KEY_BLOCK if dtype == torch.bfloat16 else attn_f32.KEY_PACK)


def _call(
    lib: Any,
    stack: StackDescription,
    buffers: StepScratch,
    mirror: Any,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    loc: torch.Tensor,
    pool: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = hidden.shape
    q_cols, kv_cols = stack.q_heads * stack.head_dim, stack.kv_heads * stack.head_dim
    plan = mirror.plan
    kv_n, cap = mirror.k[0].shape[0], mirror.k[0].shape[-1]  # (a verify step's rows share their request's)
    # (every layer's copies are made alike in one rebuild: the first layer's stand for all)
    assert mirror.k[0].shape == (kv_n, stack.kv_heads, stack.head_dim, cap) and mirror.k[0].dtype == stack.dtype
    assert mirror.v[0].shape == (kv_n, stack.kv_heads, cap, stack.head_dim) and mirror.k[0].is_contiguous()
    assert plan.mask.dtype == torch.float32 and plan.mask.numel() == n * cap and plan.append_pos.shape == (n,)
    kv_row = plan.kv_row
    assert (kv_row is None and kv_n == n) or (kv_row is not None and kv_row.shape == (n,) and kv_row.is_contiguous())
    widths = {"normed": h, "qkv": q_cols + 2 * kv_cols, "attn": q_cols, "o": h, "mid": stack.inter}
    if stack.kernels != "amx":  # the gate/up linear's output, before silu*mul (the AMX kernel fuses them)
        widths["gate_up"] = 2 * stack.inter
    scratch = {name: buffers.rows(name, n, cols, stack.dtype) for name, cols in widths.items()}
    scratch["hidden_out"] = torch.empty(n, h, dtype=stack.dtype)  # returned: the caller's, not reused
    prefix_len = prefix_pad = 0
    if mirror.prefix is not None:
        prefix_len = mirror.prefix[0].length
        prefix_pad = _padded_keys(mirror.prefix[0], stack.dtype)
        scratch["prefix_out"] = buffers.rows("prefix_out", n, q_cols, torch.float32)
        scratch["prefix_lse"] = buffers.rows("prefix_lse", n, stack.q_heads, torch.float32)
    layers = stack.layers
    for i, entry in enumerate(layers):
        k_pool, v_pool = pool.get_kv_buffer(i)
        entry.k_pool, entry.v_pool = k_pool.data_ptr(), v_pool.data_ptr()
        entry.k_t, entry.v = mirror.k[i].data_ptr(), mirror.v[i].data_ptr()
        if mirror.prefix is not None:
            packed = mirror.prefix[i]
            if packed.length != prefix_len or _padded_keys(packed, stack.dtype) != prefix_pad:
                raise ValueError("the decode mirror's packed prefixes differ between layers")
            entry.prefix_k, entry.prefix_v = packed.k.data_ptr(), packed.v.data_ptr()
    step = _Step(
        n=n,
        hidden=h,
        q_heads=stack.q_heads,
        kv_heads=stack.kv_heads,
        head_dim=stack.head_dim,
        inter=stack.inter,
        rot_dim=rotary_dim,
        cap=cap,
        width=plan.width,
        prefix_len=prefix_len,
        prefix_pad=prefix_pad,
        pool_slots=k_pool.shape[0],
        eps=stack.eps,
        scale=stack.scale,
        residual=hidden.data_ptr(),
        cos=cos.data_ptr(),
        sin=sin.data_ptr(),
        out_loc=loc.data_ptr(),
        append_pos=plan.append_pos.data_ptr(),
        mask=plan.mask.data_ptr(),
        kv_row=kv_row.data_ptr() if kv_row is not None else None,
        kv_rows=kv_n,
        **{name: t.data_ptr() for name, t in scratch.items()},
    )
    rc = getattr(lib, _ENTRY_POINTS[stack.kernels])(ctypes.byref(step), layers, len(layers))
    if rc != 0:
        raise ValueError(
            f"decode layer {-rc // 16}: the {_STAGES[-rc % 16]} kernel refused its operands "
            "(a KV slot outside the pool, or a mirror position past its capacity)"
        )
    return scratch["hidden_out"], hidden
