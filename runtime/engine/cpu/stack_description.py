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
    QUANT_SETS,
    STACK_DTYPES,
    CpuWeightPlan,
    KernelBand,
    layer_plan,
    stack_kernels,
)
from runtime.engine.ops.layer_stack import DecoderLayerWeights, LayerDescription
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
    _fields_ += [("pre_mlp_norm", _ptr), ("post_mlp_norm", _ptr)]  # Gemma's sandwich norms (NULL: pre-norm)
    _fields_ += [("rope_table", _i64), ("windowed", _i64)]  # its rotary table; attends over its window


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
        ("rows", _i64),
        ("next", _ptr),
    ]


# What the C layer (csrc/decode_layers.c) computes: RMSNorm with the weight as the norm layer holds it
# (Gemma's unit offset is added to its weight at load: runtime.engine.layers.norm.UnitOffsetRMSNorm),
# placed before attention and MLP or Gemma's sandwich of four, a dense silu- or gelu_tanh-gated MLP,
# neox rotary halves over any share of the head (a layer's own table: Gemma 3's windowed layers), full
# or windowed attention, RMSNorm of each q and k head before RoPE or none, no clamp, no soft-cap, and a
# bias on the qkv projection only.
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
        (description.mlp == "dense", f"{description.mlp} MLP"),
        (description.rope_style == "neox", f"rope style {description.rope_style}"),
        (description.rotary_dim <= description.head_dim, "rotary dims past the head"),
        (description.qk_norm in (None, "head"), f"q/k norm over the {description.qk_norm}"),
        (description.qkv_clip is None, "a q/k/v clamp"),
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
    layers: Any = field(repr=False)  # ctypes array of CLayer (weight fields filled)
    # the qf32 and qbf16 sets: each quantized linear's _QuantWeight, whose addresses the layers hold (kept alive here)
    quant: list[_QuantWeight] = field(default_factory=list, repr=False)
    # Multi-LoRA: the slots' count and rank where the layers' linears take adapters in this set's dtype
    # (their addresses are in the layers' ``lora`` entries), else None: a step with adapters runs the layers
    lora_shape: tuple[int, int] | None = None
    lora_keep: list[torch.Tensor] = field(default_factory=list, repr=False)  # the part_rows arrays the layers point at

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
        mins = part.mins
        desc = _QuantWeight(
            kind_code(part),
            part.group,
            part.qs.data_ptr(),
            part.scales.data_ptr(),
            mins.data_ptr() if mins is not None else None,
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
    hidden, inter = first.input_norm.shape[0], first.down.weight.shape[1]
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
        shapes = (
            ((q_heads + 2 * kv_heads) * head_dim, hidden),
            (hidden, q_heads * head_dim),
            (2 * inter, hidden),
            (hidden, inter),
        )
        bands = [_linear_band(layer_plan(linear), kernels) for linear in layer.linears]
        if any(band is None for band in bands) or any(
            tuple(linear.weight.shape) != shape for linear, shape in zip(layer.linears, shapes)
        ):
            return None
        if kernels == "amx" and activation == 0 and inter % 32:
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
        entry.qkv, entry.o, entry.gate_up, entry.down = (_address(band, quant) for band in bands if band is not None)
        entry.qkv_bias = bias.data_ptr() if bias is not None else None
        if layer.q_norm is not None and layer.k_norm is not None:
            entry.q_norm, entry.k_norm = layer.q_norm.data_ptr(), layer.k_norm.data_ptr()
            entry.qk_eps = layer.qk_norm_eps
        if sandwich:
            entry.pre_mlp_norm, entry.post_mlp_norm = (norm.data_ptr() for norm in mlp_norms if norm is not None)
        entry.rope_table = layer.rope_table
        entry.windowed = int(layer.description.window is not None)
    description = StackDescription(
        kernels, rows, hidden, q_heads, kv_heads, head_dim, inter, eps, scale, activation, window, array, quant
    )
    description.lora_shape = _describe_lora(layers, array, dtype, description.lora_keep)
    return description


def _qk_norms_taken(layer: DecoderLayerWeights, dtype: torch.dtype) -> bool:
    """Whether the C layer norms this layer's q and k heads exactly as its forward does: both norms
    or neither, as the description declares, each one weight of a head's size in the set's dtype."""
    norms = (layer.q_norm, layer.k_norm)
    if layer.description.qk_norm is None:
        return all(norm is None for norm in norms)
    head_dim = layer.description.head_dim
    return all(
        norm is not None and norm.shape == (head_dim,) and norm.dtype == dtype and norm.is_contiguous()
        for norm in norms
    )


def _describe_lora(
    layers: list[DecoderLayerWeights], array: Any, dtype: torch.dtype, keep: list[torch.Tensor]
) -> tuple[int, int] | None:
    """Fill each layer's adapter slots (a LoRA server's linears hold them: ``LinearBase.lora``); the
    slots' (count, rank), or None where no linear takes adapters or their dtype is not the set's."""
    shape = None
    for layer, entry in zip(layers, array):
        for index, linear in enumerate(layer.linears):
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
