"""A model's decoder layers as the one-call decode stack's C code reads them (``describe_layers``).

The description is per model, not per step: which set of kernels runs the call (and so its dtype),
the shapes, every layer's weight addresses (of the device's packed copies), made once from the
model's ``DecoderLayerWeights`` and again only when a packed copy it read is made or dropped. A
model whose layers the C layer cannot run exactly as their forward would (another layer choice,
per-head q/k norm, a window, mixed shapes, biases the kernels lack) gets None, and its steps run
the layers one by one. ``decode_layers.py`` runs the steps.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu.prepacked import DP_ADDRESS, TILE_ADDRESS, packed_copy, panel_address
from runtime.engine.ops.layer_stack import DecoderLayerWeights
from runtime.engine.quant.weight import QuantizedWeight, blocks_of

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class _Layer(ctypes.Structure):
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


class _QuantWeight(ctypes.Structure):
    """csrc/decode_layers.c: QuantWeight (a ``QuantizedWeight``'s tensors, as ``quant_linear_f32`` reads them)."""

    _fields_ = [("kind", _i64), ("group", _i64), ("qs", _ptr), ("scales", _ptr), ("mins", _ptr)]


# The sets of kernels a call can run (csrc/decode_layers.c), by the dtype they take, in the order
# tried: bf16 linears on AMX tiles or on AVX512-BF16 dot products, fp32 ones on the panel kernel,
# and in either dtype on weights kept quantized (runtime.engine.quant: the qf32 and qbf16 sets).
_KERNEL_SETS = {torch.bfloat16: ("amx", "dp", "qbf16"), torch.float32: ("f32", "qf32")}
_SET_DTYPES = {kernels: dtype for dtype, sets in _KERNEL_SETS.items() for kernels in sets}
QUANT_SETS = ("qf32", "qbf16")  # the sets that read a weight's blocks
_QUANT_KINDS = {"q8": 0, "q4": 1}  # csrc/quant_linear.c: kind


@dataclass
class StackDescription:
    """The per-model part of the call: the set of kernels (and so its dtype), the shapes and every
    layer's weight addresses (of the packed copies as of ``packed_generation`` ``generation``)."""

    kernels: str  # a key of _ENTRY_POINTS
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    scale: float
    layers: Any = field(repr=False)  # ctypes array of _Layer (weight fields filled)
    # the qf32 and qbf16 sets: each quantized linear's _QuantWeight, whose addresses the layers hold (kept alive here)
    quant: list[_QuantWeight] = field(default_factory=list, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return _SET_DTYPES[self.kernels]


def _packed_address(
    weight: torch.Tensor | QuantizedWeight,
    tp_size: int,
    kernels: str,
    dtype: torch.dtype,
    quant: list[_QuantWeight] | None = None,
) -> int:
    """The address of ``weight``'s packed copy as the linear kernel of ``kernels`` reads it (the
    AMX tile layout, oneDNN's AVX512-BF16 layout, the fp32 panel copy; for the qf32 and qbf16 sets
    a weight kept quantized, or a dense one's blocks (``blocks_of``), described in a ``_QuantWeight``
    appended to ``quant``), else 0."""
    if kernels in QUANT_SETS:
        blocks = weight if isinstance(weight, QuantizedWeight) else blocks_of(weight)
        if blocks is None or tp_size != 1 or blocks.device.type != "cpu":
            return 0
        mins = blocks.mins
        desc = _QuantWeight(
            _QUANT_KINDS[blocks.kind],
            blocks.group,
            blocks.qs.data_ptr(),
            blocks.scales.data_ptr(),
            mins.data_ptr() if mins is not None else None,
        )
        if quant is not None:
            quant.append(desc)
        return ctypes.addressof(desc)
    if isinstance(weight, QuantizedWeight):
        return 0
    packed = packed_copy(weight)
    if tp_size != 1 or weight.dtype != dtype or packed is None:
        return 0
    if kernels != "f32":
        return int(getattr(packed, TILE_ADDRESS if kernels == "amx" else DP_ADDRESS, 0))
    return panel_address(packed, *weight.shape)


# The layer choices (activation, norm form, rope style) the C layer implements: silu*mul, RMSNorm
# with the weight as it is, neox rotary halves.
C_LAYER_CHOICES = frozenset({("silu", "rms", "neox"), ("swish", "rms", "neox")})


def _kernel_set(layer: DecoderLayerWeights, dtype: torch.dtype, blocks: bool) -> str | None:
    """The set of kernels whose linear reads the layer's packed qkv weight (a bf16 copy is in at
    most one of the two layouts; ``blocks``: only the sets that read blocks), else None;
    ``describe_layers`` checks every other linear against it."""
    for kernels in _KERNEL_SETS.get(dtype, ()):
        if (not blocks or kernels in QUANT_SETS) and _packed_address(layer.qkv, layer.tp_size, kernels, dtype):
            return kernels
    return None


def has_blocks(layers: list[DecoderLayerWeights]) -> bool:
    """Whether the layers' dense weights carry their blocks too (``--quantization gguf_dual``)."""
    return blocks_of(layers[0].qkv) is not None


def describe_layers(layers: list[DecoderLayerWeights], blocks: bool = False) -> StackDescription | None:
    """The stack's ``StackDescription`` when the C call runs every layer exactly as its forward would,
    else None; ``blocks``: with the kernels that read the weights' blocks (a dual model's few-row steps)."""
    first = layers[0]
    q_heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
    hidden, inter = first.input_norm.shape[0], first.down.shape[1]
    eps, scale = first.input_norm_eps, first.scaling
    dtype = first.input_norm.dtype
    kernels = _kernel_set(first, dtype, blocks)
    if kernels is None:
        return None
    group = q_heads // kv_heads
    if q_heads % kv_heads or group > attn_kernels.MAX_GROUP or head_dim > attn_kernels.MAX_HEAD_DIM:
        return None
    if dtype == torch.bfloat16 and group * head_dim > attn_kernels.MAX_GROUP_X_DIM:
        return None
    array = (_Layer * len(layers))()
    quant: list[_QuantWeight] = []
    for layer, entry in zip(layers, array):
        if layer.qk_norm or layer.sliding_window is not None or layer.scaling != scale:
            return None
        if (layer.activation, layer.norm, layer.rope_style) not in C_LAYER_CHOICES:
            return None
        if (layer.num_heads, layer.num_kv_heads, layer.head_dim) != (q_heads, kv_heads, head_dim):
            return None
        norms = ((layer.input_norm, layer.input_norm_eps), (layer.post_norm, layer.post_norm_eps))
        if any(
            norm_eps != eps or norm.shape != (hidden,) or norm.dtype != dtype or not norm.is_contiguous()
            for norm, norm_eps in norms
        ):
            return None
        weights = (layer.qkv, layer.o, layer.gate_up, layer.down)
        shapes = (
            ((q_heads + 2 * kv_heads) * head_dim, hidden),
            (hidden, q_heads * head_dim),
            (2 * inter, hidden),
            (hidden, inter),
        )
        addresses = [_packed_address(weight, layer.tp_size, kernels, dtype, quant) for weight in weights]
        if not all(addresses) or any(tuple(weight.shape) != shape for weight, shape in zip(weights, shapes)):
            return None
        if (kernels == "amx" and inter % 32) or any(
            b is not None for b in (layer.o_bias, layer.gate_up_bias, layer.down_bias)
        ):
            return None  # (the fused AMX gate/up kernel's column blocks)
        bias = layer.qkv_bias
        if bias is not None and (bias.dtype != dtype or not bias.is_contiguous()):
            return None
        entry.input_norm, entry.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
        entry.qkv, entry.o, entry.gate_up, entry.down = addresses
        entry.qkv_bias = bias.data_ptr() if bias is not None else None
    return StackDescription(kernels, hidden, q_heads, kv_heads, head_dim, inter, eps, scale, array, quant)
