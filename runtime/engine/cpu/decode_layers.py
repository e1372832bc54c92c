"""A decode step's decoder layers in one C call (``csrc/decode_layers.c``).

Once its linears run on fast kernels, what a decode step spends between kernels weighs: each
layer's ten kernel calls go through their Python wrappers (shape checks, ``torch.empty``,
views, ctypes argument conversion) and the attention backend's per-layer plan, while the other
OpenMP threads wait for the next parallel region (docs/benchmarks.md has the figures).
``decode_layers_amx`` / ``_dp`` / ``_f32`` call the same kernels in the same order for every
layer from C: the results are the layer stack's bit for bit, the interpreter work per step is
one call.

It takes the steady state of serving, a decode step that appends to the attention backend's
decode-key mirror (``runtime.engine.cpu.decode_mirror``), over a pool of the step's dtype or a
quantized one (``--kv-cache-dtype int8|fp8_*``: the call then quantizes the new K/V into the pool,
``csrc/kv_quant.c``, and attends over the quantized mirror, ``csrc/attention_q8.c``), of layers whose own class declares what
they are and whose every declared choice the C layer implements (``stack_description.c_layer_declines``:
RMSNorm before attention and MLP or Gemma's sandwich of four, a dense silu- or gelu_tanh-gated MLP or routed
experts (``csrc/moe_mlp.c``), neox rotary (each layer with its model's rotary table: ``rope_tables``), q/k
norms per head or over the projection or none, full attention or a window (its keys gathered from the
windowed layers' pool each step, as the backend does), no soft-cap), with
no tensor parallelism, and whose linears' plans (``runtime.engine.cpu.weight_plan``) give this many
rows one kernel set: bf16 on the AMX tile kernel or the AVX512-BF16 dot-product one (up to
``AMX_LINEAR_MAX_ROWS`` requests), fp32 on the panel kernel (``fp32_panel_rows()``), or either
dtype on weights kept quantized, or on a dual weight's blocks for up to ``BLOCK_ROWS_MAX`` rows
(``quant_linear_f32``). Anything else (``run`` returns None) goes through the layers one by one.
``TINYSERVE_CPU_DECODE_LAYERS=0`` (or ``use_decode_layers(False)``) turns it off.

Who picks it: the model runner asks its device ops for a layer stack once (``CpuOps.layer_stack``
gives a ``CpuLayerStack`` of the model) and hands it to every forward it runs eagerly; the
stack asks ``run`` on every forward and falls back to the model's own ``run_layers``. What the
C call needs of each layer comes from the layer (``describe`` and ``decode_weights``:
``DecoderLayerWeights``), never from its attribute names; which kernel reads which copy of each
weight, from the weight's plan, the same record the layers' own products read.

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
import operator
import os
from typing import Any, Iterator

import torch

from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_f32 as attn_f32
from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.decode_mirror import WindowStep
from runtime.engine.cpu.kernel_library import declare
from runtime.engine.cpu.kv_quant_kernels import format_code
from runtime.engine.cpu.stack_description import CLayer, StackDescription, c_layer_declines, describe_layers
from runtime.engine.cpu.weight_plan import layer_plan, stack_kernels, stack_runs
from runtime.engine.forward_batch import ForwardMode
from runtime.engine.ops.layer_stack import DecoderLayerWeights, DecoderStackModel, declared_description
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
        + [("kv_rows", _i64), ("lora", _ptr), ("kv_format", _i64), ("activation", _i64)]
        + [("cos_local", _ptr), ("sin_local", _ptr), ("win_out_loc", _ptr), ("win_slots", _ptr)]
        + [("win_len", _i64), ("win_pool_slots", _i64), ("win_mask", _ptr), ("win_k", _ptr), ("win_v", _ptr)]
    )


class _LoraRuns(ctypes.Structure):
    """csrc/decode_layers.c: LoraRuns (a step's ``runtime.engine.ops.lora.LoraSegments``)."""

    _fields_ = [("slots", _i64), ("rank", _i64), ("n", _i64), ("starts", _ptr), ("run_slots", _ptr)]


_ENTRY_POINTS = {
    "amx": "decode_layers_amx",
    "dp": "decode_layers_dp",
    "f32": "decode_layers_f32",
    "qf32": "decode_layers_qf32",
    "qbf16": "decode_layers_qbf16",
}
for _name in _ENTRY_POINTS.values():
    declare(_name, [ctypes.POINTER(_Step), ctypes.POINTER(CLayer), _i64], ctypes.c_int)

_STAGES = (
    "",
    "qkv linear",
    "KV pool write",
    "prefix attention",
    "decode attention",
    "o linear",
    "gate/up + silu",
    "down linear",
    "adapter (LoRA) product",
)
_enabled: list[bool] = []  # use_decode_layers' stack of settings
_PLAN_OF = operator.attrgetter("plan")  # a linear layer's current plan (one C-level read per layer a step)


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

    Owns the descriptions of the model's layers for the call, one per kernel set a step's rows take
    (a dual model's few-row steps read the blocks, larger ones the dense copies), each made from the
    layers' plans and made again when any of those plans was replaced (a reload, a repack): the
    plans are compared by identity, once per step.
    """

    def __init__(self, model: DecoderStackModel) -> None:
        self.model = model
        self.scratch = StepScratch()
        self.declined: str | None = None  # why the C layer does not take the model's layers (None: it does)
        # the layers' records (None: the model's layers are not taken; ``declined`` says why)
        self._records: list[DecoderLayerWeights] | None = self._layer_records()
        self._linears = [linear for record in self._records or () for linear in record.linears]
        self._plans: list[Any] = []  # every linear's plan the descriptions were made from
        self._described: dict[str, StackDescription | None] = {}  # by kernel set
        self._by_step: dict[tuple[int, torch.dtype], StackDescription | None] = {}  # by (rows, dtype)
        # whether some layer rotates with the model's second table (Gemma 3's windowed layers)
        self.second_table = any(record.rope_table for record in self._records or ())

    def __call__(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope_cos_sin(rope, hidden.dtype)
        local = None
        if self.second_table and batch.forward_mode in (ForwardMode.DECODE, ForwardMode.VERIFY):
            tables = self.model.rope_tables(rope, hidden.dtype)
            if len(tables) == 2 and tables[1].cache.rotary_dim == rope.cache.rotary_dim:
                local = rope_cos_sin(tables[1], hidden.dtype)
        whole = run(self, hidden, cos, sin, rope.cache.rotary_dim, batch, backend, local)
        return whole if whole is not None else self.model.run_layers(rope, hidden, batch, backend)

    def lora_segments(self) -> Any:
        """The forward's adapter runs where some row uses an adapter (a LoRA server's linears share one
        context: ``runtime.engine.ops.lora``), else None."""
        lora = getattr(self._linears[0], "lora", None) if self._linears else None
        return lora.active() if lora is not None else None

    def _layer_records(self) -> list[DecoderLayerWeights] | None:
        """Every decoder layer's record where each layer's own class declares what it is and the C
        layer implements all of it (``c_layer_declines``), else None (and ``declined`` says why)."""
        layers = list(self.model.decoder_layers())
        if not layers:
            self.declined = "the model declares no decoder layers"
            return None
        for index, layer in enumerate(layers):
            description = declared_description(layer)
            reason = "its class declares no description" if description is None else c_layer_declines(description)
            if reason is not None:
                self.declined = f"layer {index} ({type(layer).__name__}): {reason}"
                return None
        return [layer.decode_weights() for layer in layers]

    def description(self, rows: int = 1, dtype: torch.dtype | None = None) -> StackDescription | None:
        """The stack's description for a step of ``rows`` rows of ``dtype`` activations (default: the
        layers' own dtype): the kernel set that every layer's plans give those rows, described once
        per set while the plans stay the same; None where the call does not take such a step."""
        records = self._records
        if records is None:
            return None
        plans = list(map(_PLAN_OF, self._linears))
        if plans != self._plans:  # (identity: a plan is replaced, never changed)
            self._plans, self._described, self._by_step = plans, {}, {}
        dtype = dtype or records[0].input_norm.dtype
        key = (rows, dtype)
        if key not in self._by_step:
            self._by_step[key] = self._describe(records, rows, dtype)
        return self._by_step[key]

    def _describe(self, records: list[DecoderLayerWeights], rows: int, dtype: torch.dtype) -> StackDescription | None:
        first = layer_plan(records[0].qkv)
        kernels = stack_kernels(first.band(rows, dtype) if first is not None else None, dtype)
        if kernels is None:
            return None
        if kernels not in self._described:
            self._described[kernels] = describe_layers(records, kernels)
        stack = self._described[kernels]
        return stack if stack is not None and rows in stack.rows else None


def run(
    layers: CpuLayerStack,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
    batch: Any,
    backend: Any,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(hidden, residual)`` after every layer of ``layers`` for a decode batch's embeddings
    ``hidden [n, H]`` (which become the residual stream, as in the layer stack), with the rotary
    ``cos``/``sin`` ``[n, 1, rotary_dim // 2]`` (``local``: the second table's, where some layer
    rotates with it); None where the one-call path does not apply (nothing is touched then: run
    the layers)."""
    n, dtype = hidden.shape[0], hidden.dtype
    if n == 0 or not enabled() or batch.forward_mode not in (ForwardMode.DECODE, ForwardMode.VERIFY):
        return None
    if layers.second_table and local is None:
        return None  # (some layer rotates with a table the model did not give)
    lib = kernel_library.load()
    if lib is None:
        return None
    stack = layers.description(n, dtype)
    if stack is None or hidden.shape != (n, stack.hidden) or not hidden.is_contiguous():
        return None
    if not stack_runs(stack.kernels, lib):
        return None
    half = rotary_dim // 2
    if (
        rotary_dim % 2
        or rotary_dim > stack.head_dim
        or any(t.dtype != dtype or t.shape != (n, 1, half) or not t.is_contiguous() for t in (cos, sin, *(local or ())))
    ):
        return None
    loc = batch.out_cache_loc
    pool = batch.token_to_kv_pool
    if loc.dtype != torch.int64 or loc.shape != (n,) or not loc.is_contiguous():
        return None
    num_layers = len(stack.layers)
    kv_code = _kv_format_code(pool, dtype)
    if kv_code is None or len(getattr(pool, "k_buffer", ())) != num_layers or (stack.window and kv_code):
        return None  # (windowed layers: a plain pool only)
    takes, runs = _lora_runs(layers, stack, n)
    if not takes:
        return None
    mirror = backend.claim_decode_step(batch, num_layers)  # from here on the step is committed to this call
    if mirror is None:
        return None
    if (mirror.window is None) != (stack.window is None):
        raise ValueError("the backend's windowed layers are not the stack's")
    return _call(lib, stack, layers.scratch, mirror, hidden, cos, sin, rotary_dim, loc, pool, runs, local)


def _kv_format_code(pool: Any, dtype: torch.dtype) -> int | None:
    """The C call's code of the pool's format for a step of ``dtype`` activations (csrc/kv_codes.h;
    0: the step's own dtype), or None where the call cannot write and read it."""
    kv_format = getattr(pool, "format", None)
    if kv_format is not None and kv_format.quantized:
        return format_code(kv_format) if kv_format.compute == dtype else None
    return 0 if getattr(pool, "dtype", None) == dtype else None


def _lora_runs(layers: CpuLayerStack, stack: StackDescription, n: int) -> tuple[bool, _LoraRuns | None]:
    """Whether the C call takes the step, and its adapter runs (None: no row uses an adapter); not
    where rows use adapters and the description has no slots the C layer can read (the layers then
    run one by one)."""
    segments = layers.lora_segments()
    if segments is None:
        return True, None
    if stack.lora_shape is None or segments.starts_cpu[-1] != n:
        return False, None
    slots, rank = stack.lora_shape
    runs = _LoraRuns(slots, rank, len(segments.slots_cpu), segments.starts.data_ptr(), segments.slots.data_ptr())
    return True, runs


def _window_fields(
    window: WindowStep | None, buffers: StepScratch, n: int, stack: StackDescription, pool: Any
) -> dict[str, Any]:
    """The step's ``win_*`` fields (csrc/decode_layers.c: DecodeStep) for the windowed layers' keys
    (none: no windowed layer); the gathered K^T and V are scratch reused by every windowed layer."""
    if window is None:
        return {}
    length, d, hkv = window.length, stack.head_dim, stack.kv_heads
    assert window.slots.dtype == torch.int64 and window.slots.shape == (n * length,) and window.slots.is_contiguous()
    assert window.out_loc.dtype == torch.int64 and window.out_loc.shape == (n,) and window.out_loc.is_contiguous()
    mask = window.mask
    assert mask is None or (mask.dtype == torch.float32 and mask.numel() == n * length and mask.is_contiguous())
    assert stack.first_windowed is not None  # (a windowed plan comes with windowed layers: run checks)
    return {
        "win_out_loc": window.out_loc.data_ptr(),
        "win_slots": window.slots.data_ptr(),
        "win_len": length,
        "win_pool_slots": pool.get_kv_buffer(stack.first_windowed)[0].shape[0],
        "win_mask": mask.data_ptr() if mask is not None else None,
        "win_k": buffers.rows("win_k", n, hkv * d * length, stack.dtype).data_ptr(),
        "win_v": buffers.rows("win_v", n, hkv * length * d, stack.dtype).data_ptr(),
    }


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
    lora: _LoraRuns | None = None,
    local: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, h = hidden.shape
    q_cols, kv_cols = stack.q_heads * stack.head_dim, stack.kv_heads * stack.head_dim
    plan = mirror.plan
    # (every mirrored layer's copies are made alike in one rebuild: the first one's stand for all)
    first_k, first_v = next((k, v) for k, v in zip(mirror.k, mirror.v) if k is not None and v is not None)
    kv_n, cap = first_k.shape[0], first_k.shape[-1]  # (a verify step's rows share their request's)
    kv_code = _kv_format_code(pool, stack.dtype)
    assert kv_code is not None and (mirror.kv_format is None) == (kv_code == 0)
    copies = mirror.kv_format.storage if mirror.kv_format is not None else stack.dtype
    assert first_k.shape == (kv_n, stack.kv_heads, stack.head_dim, cap) and first_k.dtype == copies
    assert first_v.shape == (kv_n, stack.kv_heads, cap, stack.head_dim) and first_k.is_contiguous()
    assert plan.mask.dtype == torch.float32 and plan.mask.numel() == n * cap and plan.append_pos.shape == (n,)
    kv_row = plan.kv_row
    assert (kv_row is None and kv_n == n) or (kv_row is not None and kv_row.shape == (n,) and kv_row.is_contiguous())
    widths = {"normed": h, "qkv": q_cols + 2 * kv_cols, "attn": q_cols, "o": h, "mid": stack.inter}
    if stack.kernels != "amx" or lora is not None or stack.activation:  # the gate/up linear's output, before
        widths["gate_up"] = 2 * stack.inter  # the activation (the AMX kernel fuses silu's, not with an adapter's)
    scratch = {name: buffers.rows(name, n, cols, stack.dtype) for name, cols in widths.items()}
    scratch["hidden_out"] = torch.empty(n, h, dtype=stack.dtype)  # returned: the caller's, not reused
    prefix_len = prefix_pad = 0
    if mirror.prefix is not None:
        first_prefix = next(packed for packed in mirror.prefix if packed is not None)  # (a mirrored layer's)
        prefix_len = first_prefix.length
        prefix_pad = _padded_keys(first_prefix, stack.dtype)
        scratch["prefix_out"] = buffers.rows("prefix_out", n, q_cols, torch.float32)
        scratch["prefix_lse"] = buffers.rows("prefix_lse", n, stack.q_heads, torch.float32)
    window = _window_fields(mirror.window, buffers, n, stack, pool)
    layers = stack.layers
    pool_slots = 0
    for i, entry in enumerate(layers):
        k_pool, v_pool = pool.get_kv_buffer(i)
        entry.k_pool, entry.v_pool = k_pool.data_ptr(), v_pool.data_ptr()
        k_t, v_t = mirror.k[i], mirror.v[i]
        if (k_t is None) != bool(entry.windowed) or (v_t is None) != bool(entry.windowed):
            raise ValueError(f"layer {i}: the mirror's windowed layers are not the stack's")
        entry.k_t = k_t.data_ptr() if k_t is not None else None
        entry.v = v_t.data_ptr() if v_t is not None else None
        if k_t is None:
            continue  # (a windowed layer: no shared prefix, no quantized pool)
        pool_slots = k_pool.shape[0]
        if kv_code:
            entry.k_scale, entry.v_scale = pool.k_scales[i], pool.v_scales[i]
            scales = mirror.k_scales is not None and mirror.v_scales is not None
            entry.k_scales = mirror.k_scales[i].data_ptr() if scales else None
            entry.v_scales = mirror.v_scales[i].data_ptr() if scales else None
        if mirror.prefix is not None:
            packed = mirror.prefix[i]
            assert packed is not None
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
        pool_slots=pool_slots,
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
        lora=ctypes.addressof(lora) if lora is not None else None,
        kv_format=kv_code,
        activation=stack.activation,
        cos_local=local[0].data_ptr() if local is not None else None,
        sin_local=local[1].data_ptr() if local is not None else None,
        **window,
        **{name: t.data_ptr() for name, t in scratch.items()},
    )
    rc = getattr(lib, _ENTRY_POINTS[stack.kernels])(ctypes.byref(step), layers, len(layers))
    if rc != 0:
        raise ValueError(
            f"decode layer {-rc // 16}: the {_STAGES[-rc % 16]} kernel refused its operands "
            "(a KV slot outside the pool, or a mirror position past its capacity)"
        )
    return scratch["hidden_out"], hidden
