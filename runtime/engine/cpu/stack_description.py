"""A model's decoder layers as the one-call decode stack's C code reads them (``describe_layers``),
and what that C layer implements (``c_layer_declines``: the one place that decides it).

The description is per model and kernel set, not per step: the set of kernels that runs the call
(and so its dtype), the shapes, every layer's weight addresses as the layers' plans hold them
(``runtime.engine.cpu.weight_plan``), made once from the layers' ``DecoderLayerWeights`` and again only
when a plan it read was replaced. A layer whose declared description
(``runtime.engine.ops.layer_stack.LayerDescription``) asks for a choice the C layer does not implement,
or whose linears' plans do not all run on the set's kernels, gets None, and the model's steps run
the layers one by one. ``decode_layers.py`` runs the steps.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu.quant_kernels import kind_code
from runtime.engine.cpu.weight_plan import (
    DOT_ROUTER_ROWS,
    QUANT_SETS,
    STACK_DTYPES,
    CpuWeightPlan,
    KernelBand,
    dot_router,
    layer_plan,
    stack_kernels,
)
from runtime.engine.ops.layer_stack import DecoderLayerWeights, LayerDescription, RoutedExperts
from runtime.engine.quant.weight import KEPT_WEIGHTS

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class CLoraLinear(ctypes.Structure):
    """csrc/decode_layers.c: LoraLinear (a linear's adapter slots, ``runtime.engine.ops.lora.LoraWeights``)."""

    _fields_ = [("a", _ptr), ("b", _ptr), ("part_rows", _ptr), ("parts", _i64)]


class CLayer(ctypes.Structure):
    """csrc/decode_layers.c: DecodeLayer."""

    _fields_ = [
        (name, _ptr)
        for name in (
            "input_norm",
            "qkv",
            "qkv_bias",
            "o",
            "post_norm",
            "gate_up",
            "down",
            "k_pool",
            "v_pool",
            "k_t",
            "v",
            "prefix_k",
            "prefix_v",
        )
    ]
    _fields_ += [("lora", CLoraLinear * 4)]  # qkv, o, gate_up, down
    _fields_ += [("k_scales", _ptr), ("v_scales", _ptr)]  # a quantized mirror's per-key scales (int8), per step
    _fields_ += [("k_scale", _f32), ("v_scale", _f32)]  # a quantized pool's layer scales (fp8), per step
    _fields_ += [("q_norm", _ptr), ("k_norm", _ptr), ("qk_eps", _f32)]  # per-head q/k norms (NULL: none)
    _fields_ += [("qk_whole", _i64), ("clip", _f32)]  # OLMoE: the norms span the projection; the q/k/v clamp (0: none)
    _fields_ += [("moe", _ptr)]  # a sparse layer's CMoeLayer (NULL: a dense MLP)
    _fields_ += [("pre_mlp_norm", _ptr), ("post_mlp_norm", _ptr)]  # Gemma's sandwich norms (NULL: pre-norm)
    _fields_ += [("rope_table", _i64), ("windowed", _i64)]  # its rotary table; attends over its window


class CMoeLayer(ctypes.Structure):
    """csrc/moe_mlp.h: MoeLayer (a sparse layer's router and experts, ``RoutedExperts``)."""

    _fields_ = [
        (name, _i64) for name in ("experts", "top_k", "inter", "renormalize", "round_weights", "router_kernel")
    ] + [("router", _ptr), ("gate_up", _ptr), ("down", _ptr)]
    _fields_ += [("shared_inter", _i64), ("shared_gate", _ptr), ("shared_gate_up", _ptr), ("shared_down", _ptr)]


# csrc/moe_mlp.h: MOE_ROUTER_*, the kernel of a router kept dense in a set whose linears read blocks
_DENSE_ROUTERS = {"qf32": ("f32", 1), "qbf16": ("dp", 2)}
_DOT_ROUTER = 4  # MOE_ROUTER_DOT: a router no set's kernel reads, on the plain dot kernel


class _QuantWeight(ctypes.Structure):
    """csrc/decode_layers.c: QuantWeight (a ``QuantizedWeight``'s tensors, as ``quant_linear_f32`` reads
    them): one band of ``rows`` output rows, and the next band's (a ``QuantizedBands``: a merged
    layer whose parts' formats differ, multiplied band by band as ``quant_linear`` does), or NULL."""

    _fields_ = [
        ("kind", _i64),
        ("group", _i64),
        ("qs", _ptr),
        ("scales", _ptr),
        ("mins", _ptr),
        ("supers", _ptr),
        ("rows", _i64),
        ("next", _ptr),
    ]


# What the C layer (csrc/decode_layers.c) computes: RMSNorm with the weight as the norm layer holds it
# (Gemma's unit offset is added to its weight at load: runtime.engine.layers.norm.UnitOffsetRMSNorm),
# placed before attention and MLP or Gemma's sandwich of four, a dense silu- or gelu_tanh-gated MLP or
# routed silu-gated experts with or without a gated shared expert (csrc/moe_mlp.c), neox rotary halves over any share
# of the head (a layer's own table: Gemma 3's windowed layers), full or windowed attention, RMSNorm of
# each q and k head or of the whole q and k projections before RoPE or none, q/k/v clamped or not, no
# soft-cap, and a bias on the qkv projection only.
C_NORMS = ("rms", "rms_unit_offset")
C_NORM_PLACEMENTS = ("pre", "sandwich")
# activation name -> the C layer's code (csrc/decode_layers.c: ACT_SILU, ACT_GELU_TANH)
C_ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


def c_layer_declines(description: LayerDescription) -> str | None:
    """Why the C layer cannot compute a layer of this description (None: it computes it exactly as
    the layer's forward does). The one place that decides which declared choices the C layer runs."""
    checks = (
        (description.norm in C_NORMS, f"norm form {description.norm}"),
        (description.norm_placement in C_NORM_PLACEMENTS, f"{description.norm_placement} norms"),
        (description.activation in C_ACTIVATIONS, f"activation {description.activation}"),
        (description.mlp in ("dense", "experts"), f"{description.mlp} MLP"),
        (description.rope_style == "neox", f"rope style {description.rope_style}"),
        (description.rotary_dim <= description.head_dim, "rotary dims past the head"),
        (description.qk_norm in (None, "head", "projection"), f"q/k norm over the {description.qk_norm}"),
        (description.attn_softcap is None, "an attention soft-cap"),
        (not description.o_bias and not description.mlp_bias, "biases past the qkv projection"),
    )
    return next((reason for ok, reason in checks if not ok), None)


@dataclass
class StackDescription:
    """The per-model part of the call: the set of kernels (and so its dtype), the row counts every
    layer's plans give that set, the shapes and every layer's weight addresses."""

    kernels: str  # a key of decode_layers._ENTRY_POINTS
    rows: range  # the step sizes whose every linear runs on the set's kernel
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float
    activation: int  # the gated MLP's code in the C layer (C_ACTIVATIONS), every layer's
    window: int | None  # the windowed layers' window (None: no layer is windowed)
    first_windowed: int | None  # the first windowed layer's index (its pool gives the windowed slots' count)
    layers: Any = field(repr=False)  # ctypes array of CLayer (weight fields filled)
    # the qf32 and qbf16 sets: each quantized linear's _QuantWeight, whose addresses the layers hold (kept alive here)
    quant: list[_QuantWeight] = field(default_factory=list, repr=False)
    # Multi-LoRA: the slots' count and rank where the layers' linears take adapters in this set's dtype
    # (their addresses are in the layers' ``lora`` entries), else None: a step with adapters runs the layers
    lora_shape: tuple[int, int] | None = None
    lora_keep: list[torch.Tensor] = field(default_factory=list, repr=False)  # the part_rows arrays the layers point at
    moe_keep: list[Any] = field(default_factory=list, repr=False)  # the sparse layers' CMoeLayer s and address arrays

    @property
    def dtype(self) -> torch.dtype:
        return STACK_DTYPES[self.kernels]


def _linear_band(plan: CpuWeightPlan | None, kernels: str) -> KernelBand | None:
    """The plan's band that the set ``kernels`` runs (None: the plan has none, or not on this CPU's copy)."""
    if plan is None:
        return None
    band = plan.band_of("blocks" if kernels in QUANT_SETS else kernels)
    return band if band is not None and stack_kernels(band, STACK_DTYPES[kernels]) == kernels else None


def _address(band: KernelBand, quant: list[_QuantWeight]) -> int:
    """The address the set's linear kernel reads for ``band``: the packed copy's, or for the quantized
    sets the first of the ``_QuantWeight`` s describing the blocks, band by band (each appended to
    ``quant``, which keeps it alive)."""
    operand = band.operand
    if not isinstance(operand, KEPT_WEIGHTS):
        return band.address
    following: int | None = None
    for _, part in reversed(operand.bands()):  # (each band points at the one after it)
        mins, supers = part.mins, part.supers
        desc = _QuantWeight(
            kind_code(part),
            part.group,
            part.qs.data_ptr(),
            part.scales.data_ptr(),
            mins.data_ptr() if mins is not None else None,
            supers.data_ptr() if supers is not None else None,
            part.shape[0],
            following,
        )
        quant.append(desc)
        following = ctypes.addressof(desc)
    assert following is not None
    return following


def describe_layers(layers: list[DecoderLayerWeights], kernels: str) -> StackDescription | None:
    """The stack's ``StackDescription`` on the set ``kernels`` when the C call runs every layer exactly
    as its forward would, else None. ``layers``: the records of layers whose declared descriptions
    the C layer implements (``c_layer_declines``, checked once when the stack takes the model)."""
    first = layers[0]
    dtype = STACK_DTYPES[kernels]
    q_heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.description.head_dim
    hidden = first.input_norm.shape[0]
    inter = next((layer.down.weight.shape[1] for layer in layers if layer.down is not None), 0)
    eps, scale = first.input_norm_eps, first.scaling
    activation = C_ACTIVATIONS[first.description.activation]
    windows = {layer.description.window for layer in layers} - {None}
    if len(windows) > 1:
        return None  # (one windowed plan per step)
    window = next(iter(windows), None)
    group = q_heads // kv_heads
    if q_heads % kv_heads or group > attn_kernels.MAX_GROUP or head_dim > attn_kernels.MAX_HEAD_DIM:
        return None
    if dtype == torch.bfloat16 and group * head_dim > attn_kernels.MAX_GROUP_X_DIM:
        return None
    array = (CLayer * len(layers))()
    quant: list[_QuantWeight] = []
    moe_keep: list[Any] = []
    rows = range(0, 1 << 62)
    for layer, entry in zip(layers, array):
        if layer.tp_size != 1 or layer.scaling != scale or C_ACTIVATIONS[layer.description.activation] != activation:
            return None
        if layer.rope_table not in (0, 1):
            return None
        if (layer.num_heads, layer.num_kv_heads, layer.description.head_dim) != (q_heads, kv_heads, head_dim):
            return None
        norms = [(layer.input_norm, layer.input_norm_eps), (layer.post_norm, layer.post_norm_eps)]
        sandwich = layer.description.norm_placement == "sandwich"
        mlp_norms = (layer.pre_mlp_norm, layer.post_mlp_norm)
        if sandwich:
            if layer.pre_mlp_norm is None or layer.post_mlp_norm is None:
                return None
            norms += [(layer.pre_mlp_norm, layer.post_norm_eps), (layer.post_mlp_norm, layer.post_norm_eps)]
        elif any(norm is not None for norm in mlp_norms):
            return None
        if any(
            norm_eps != eps or norm.shape != (hidden,) or norm.dtype != dtype or not norm.is_contiguous()
            for norm, norm_eps in norms
        ):
            return None
        shapes = [((q_heads + 2 * kv_heads) * head_dim, hidden), (hidden, q_heads * head_dim)]
        linears = [layer.qkv, layer.o]
        if layer.experts is None:
            if layer.gate_up is None or layer.down is None:
                return None
            shapes += [(2 * inter, hidden), (hidden, inter)]
            linears += [layer.gate_up, layer.down]
        bands = [_linear_band(layer_plan(linear), kernels) for linear in linears]
        if any(band is None for band in bands) or any(
            tuple(linear.weight.shape) != shape for linear, shape in zip(linears, shapes)
        ):
            return None
        if kernels == "amx" and layer.experts is None and activation == 0 and inter % 32:
            return None  # (the fused AMX gate/up kernel's column blocks)
        bias = layer.qkv.bias
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        if not _qk_norms_taken(layer, dtype):
            return None
        for band in bands:
            assert band is not None
            rows = range(max(rows.start, band.rows.start), min(rows.stop, band.rows.stop))
        entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        addresses = [_address(band, quant) for band in bands if band is not None]
        entry.qkv, entry.o = addresses[:2]
        if layer.experts is not None:
            described = describe_experts(layer.experts, kernels, hidden, quant, moe_keep)
            if described is None:
                return None
            moe, expert_rows = described
            rows = range(max(rows.start, expert_rows.start), min(rows.stop, expert_rows.stop))
            entry.moe = ctypes.addressof(moe)
        else:
            entry.gate_up, entry.down = addresses[2:]
        entry.qkv_bias = bias.data_ptr() if bias is not None else None
        if layer.q_norm is not None and layer.k_norm is not None:
            entry.q_norm, entry.k_norm = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
            entry.qk_eps = layer.qk_norm_eps
            entry.qk_whole = layer.description.qk_norm == "projection"
        entry.clip = layer.description.qkv_clip or 0.0
        if sandwich:
            entry.pre_mlp_norm, entry.post_mlp_norm = (norm.data_ptr() for norm in mlp_norms if norm is not None)
        entry.rope_table = layer.rope_table
        entry.windowed = int(layer.description.window is not None)
    description = StackDescription(
        kernels,
        rows,
        hidden,
        q_heads,
        kv_heads,
        head_dim,
        inter,
        eps,
        scale,
        activation,
        window,
        next((i for i, layer in enumerate(layers) if layer.description.window is not None), None),
        array,
        quant,
    )
    description.moe_keep = moe_keep
    description.lora_shape = _describe_lora(layers, array, dtype, description.lora_keep)
    return description


def describe_experts(
    experts: RoutedExperts, kernels: str, hidden: int, quant: list[_QuantWeight], keep: list[Any]
) -> tuple[CMoeLayer, range] | None:
    """A sparse layer's ``CMoeLayer`` on the set ``kernels`` and the step sizes it takes (each
    appended to ``keep`` with the arrays of the experts' addresses, which keeps them alive), or None
    where the C call would not run its products on the kernels the layer's own loop takes: the
    router's n rows on the set's linear (or, in a set reading blocks, a router kept dense on the
    dense kernel of its dtype), and every expert's products of m rows, for every m up to the step's,
    on the set's linear."""
    dtype = STACK_DTYPES[kernels]
    num = len(experts.gate_up)
    router_plan = layer_plan(experts.router)
    router, router_code = _linear_band(router_plan, kernels), 0
    if router is None and router_plan is not None and kernels in _DENSE_ROUTERS:
        dense, router_code = _DENSE_ROUTERS[kernels]
        router = router_plan.band_of(dense)
        router = router if router is not None and stack_kernels(router, dtype) == dense else None
    weight = experts.router.weight
    dot = router is None and router_plan is not None and dot_router(router_plan, dtype)
    if not (router is not None or dot) or tuple(weight.shape) != (num, hidden) or experts.router.bias is not None:
        return None
    inter = experts.down[0].weight.shape[1]
    if kernels == "amx" and inter % 32:
        return None  # (the fused AMX gate/up kernel's column blocks)
    rows = router.rows if router is not None else DOT_ROUTER_ROWS
    addresses: list[list[int]] = [[], []]
    for linears, shape, out in ((experts.gate_up, (2 * inter, hidden), 0), (experts.down, (hidden, inter), 1)):
        for linear in linears:
            plan = layer_plan(linear)
            band = _linear_band(plan, kernels)
            if plan is None or band is None or tuple(linear.weight.shape) != shape or linear.bias is not None:
                return None
            stop = _leading_rows(plan, band, dtype)
            rows = range(max(rows.start, 1), min(rows.stop, stop))
            addresses[out].append(_address(band, quant))
    shared = _describe_shared(experts, kernels, hidden, quant) if experts.shared is not None else (0, 0, 0, 0, rows)
    if shared is None:
        return None
    rows = range(max(rows.start, shared[4].start), min(rows.stop, shared[4].stop))
    gate_up, down = ((ctypes.c_void_p * num)(*column) for column in addresses)
    if router is not None:
        router_address = _address(router, quant)
    else:
        assert isinstance(weight, torch.Tensor)  # (dot_router)
        router_address = weight.data_ptr()
    moe = CMoeLayer(
        num,
        experts.top_k,
        inter,
        experts.renormalize,
        experts.weights_in_model_dtype,
        router_code if router is not None else _DOT_ROUTER,
        router_address,
        ctypes.addressof(gate_up),
        ctypes.addressof(down),
        *shared[:4],
    )
    keep.extend((moe, gate_up, down))
    return moe, rows


def _describe_shared(
    experts: RoutedExperts, kernels: str, hidden: int, quant: list[_QuantWeight]
) -> tuple[int, int, int, int, range] | None:
    """A sparse layer's shared expert for ``CMoeLayer`` (its intermediate size, the gate's weight and
    the gate/up and down addresses) and the step sizes it takes, or None where the C call would not run
    it as ``CpuOps`` does: its gate a dense weight of the step's dtype on the plain dot kernel (decode
    steps' rows), its linears on the set's kernel for the step's rows."""
    shared = experts.shared
    assert shared is not None
    dtype = STACK_DTYPES[kernels]
    gate, gate_plan = shared.gate.weight, layer_plan(shared.gate)
    if gate_plan is None or not dot_router(gate_plan, dtype) or tuple(gate.shape) != (1, hidden):
        return None
    assert isinstance(gate, torch.Tensor)  # (dot_router)
    inter = shared.down.weight.shape[1]
    rows = DOT_ROUTER_ROWS
    addresses = []
    for linear, shape in ((shared.gate_up, (2 * inter, hidden)), (shared.down, (hidden, inter))):
        plan = layer_plan(linear)
        band = _linear_band(plan, kernels)
        if plan is None or band is None or tuple(linear.weight.shape) != shape or linear.bias is not None:
            return None
        rows = range(max(rows.start, band.rows.start), min(rows.stop, band.rows.stop))
        addresses.append(_address(band, quant))
    if kernels == "amx" and inter % 32:
        return None  # (the fused AMX gate/up kernel's column blocks)
    if shared.gate.bias is not None:
        return None
    return inter, gate.data_ptr(), addresses[0], addresses[1], rows


def _leading_rows(plan: CpuWeightPlan, band: KernelBand, dtype: torch.dtype) -> int:
    """The first row count from 1 whose product the plan does not run on ``band`` (an expert takes
    any number of a step's rows: every count up to the step's must run on the set's kernel); a
    count runs on the first band that takes it (``CpuWeightPlan.band``)."""
    if band.rows.start > 1:
        return 1
    stop = band.rows.stop
    for earlier in plan.bands[: plan.bands.index(band)]:
        if (earlier.dtype is None or earlier.dtype == dtype) and len(earlier.rows) and earlier.rows.stop > 1:
            stop = min(stop, max(earlier.rows.start, 1))
    return stop


def _qk_norms_taken(layer: DecoderLayerWeights, dtype: torch.dtype) -> bool:
    """Whether the C layer norms this layer's q and k exactly as its forward does: both norms or
    neither, as the description declares, each one weight of a head's size (or, over the whole
    projection, of its q or k part's) in the set's dtype."""
    norms = (layer.q_norm, layer.k_norm)
    span = layer.description.qk_norm
    if span is None:
        return all(norm is None for norm in norms)
    head_dim = layer.description.head_dim
    heads = (layer.num_heads, layer.num_kv_heads) if span == "projection" else (1, 1)
    return all(
        norm is not None and norm.shape == (parts * head_dim,) and norm.dtype == dtype and norm.is_contiguous()
        for norm, parts in zip(norms, heads)
    )


def _describe_lora(
    layers: list[DecoderLayerWeights], array: Any, dtype: torch.dtype, keep: list[torch.Tensor]
) -> tuple[int, int] | None:
    """Fill each layer's adapter slots (a LoRA server's linears hold them: ``LinearBase.lora``); the
    slots' (count, rank), or None where no linear takes adapters or their dtype is not the set's."""
    shape = None
    for layer, entry in zip(layers, array):
        for index, linear in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
            lora = getattr(linear, "lora", None)
            if lora is None:
                continue
            weights = lora.weights
            if weights.a.dtype != dtype or not (weights.a.is_contiguous() and weights.b.is_contiguous()):
                return None
            slots = (int(weights.a.shape[0]), weights.rank)
            if shape not in (None, slots):
                return None
            shape = slots
            rows = torch.tensor(weights.part_rows, dtype=torch.int64)
            keep.append(rows)
            entry.lora[index] = CLoraLinear(
                weights.a.data_ptr(), weights.b.data_ptr(), rows.data_ptr(), weights.num_parts
            )
    return shape
