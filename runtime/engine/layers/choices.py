"""The layer choices a model family makes, turned into work: its MLP's activation (gated, or an
encoder's plain one), its norm form, its rope style. Each is a name in the family's entry
(``runtime.checkpoints.families``, which also lists every name these tables implement) that the
layers look up here, so that no runner or model compares a family's name to pick a formula.

A name the family table does not list is a family the layers cannot run:
``runtime.engine.model_config`` refuses its checkpoint with ``UnsupportedModelError`` before any
weight is read. A device's whole-layer kernels (the CPU's one-call stack) take only the choices they
implement, and leave any other layer to the layers one by one (``runtime.engine.ops.layer_stack``).
"""

from __future__ import annotations

from typing import Callable

import torch

from runtime.engine.layers.norm import LayerNorm, NormLayer, RMSNorm, UnitOffsetRMSNorm
from runtime.engine.model_config import ModelConfig
from runtime.engine.ops import DeviceOps, RopeInputs
from runtime.engine.ops.experts import ExpertActivation, ExpertWeight
from runtime.engine.ops.linear_weights import WeightPlan

# activation name -> act(gate) * up of a merged gate/up projection's output (weight, bias, plan), through
# the device ops (one pass with the projection where the device fuses them). "swish" is silu's
# other name. (A sparse MLP's experts hand theirs to the device ops' expert loop.)
GatedActivation = ExpertActivation
# rope style -> rotate q [T, Hq, D] and k [T, Hkv, D] in place for the forward's rotary inputs
Rotation = Callable[[DeviceOps, torch.Tensor, torch.Tensor, RopeInputs], None]


def _silu_and_mul(
    ops: DeviceOps, x: torch.Tensor, weight: ExpertWeight, bias: torch.Tensor | None, plan: WeightPlan | None
) -> torch.Tensor:
    return ops.linear_silu_and_mul(x, weight, bias, plan)


def _gelu_tanh_and_mul(
    ops: DeviceOps, x: torch.Tensor, weight: ExpertWeight, bias: torch.Tensor | None, plan: WeightPlan | None
) -> torch.Tensor:
    return ops.gelu_tanh_and_mul(ops.linear(x, weight, bias, plan))


def _neox_rotation(ops: DeviceOps, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
    ops.rotary_(q, k, rope)  # DeviceOps.rotary_: the neox halves, on every device


GATED_ACTIVATIONS: dict[str, GatedActivation] = {
    "silu": _silu_and_mul,
    "swish": _silu_and_mul,
    "gelu_pytorch_tanh": _gelu_tanh_and_mul,
}

# activation name -> act(gate) * up of a merged projection's output already computed (a forward that adds
# adapter products to it: runtime.engine.ops.lora), through the device ops
GATED_ACTIVATIONS_OF_OUTPUT: dict[str, Callable[[DeviceOps, torch.Tensor], torch.Tensor]] = {
    "silu": lambda ops, x: ops.silu_and_mul(x),
    "swish": lambda ops, x: ops.silu_and_mul(x),
    "gelu_pytorch_tanh": lambda ops, x: ops.gelu_tanh_and_mul(x),
}

# activation name -> act(x) of an ungated MLP's up projection (an encoder's), through the device ops
PlainActivation = Callable[[DeviceOps, torch.Tensor], torch.Tensor]


def _gelu(ops: DeviceOps, x: torch.Tensor) -> torch.Tensor:
    return ops.gelu(x)


PLAIN_ACTIVATIONS: dict[str, PlainActivation] = {"gelu": _gelu}

# norm form -> the layer that computes it (``rms``: x / rms(x) * weight, fp32 statistics;
# ``rms_unit_offset``: x / rms(x) * (1 + weight), Gemma's; ``layer_norm``: torch's LayerNorm, BERT's)
NORM_LAYERS: dict[str, type[NormLayer]] = {
    "rms": RMSNorm,
    "rms_unit_offset": UnitOffsetRMSNorm,
    "layer_norm": LayerNorm,
}

# rope style -> how q and k rotate: ``neox`` pairs the two halves of a head's rotary dims
ROPE_ROTATIONS: dict[str, Rotation] = {"neox": _neox_rotation}


def norm_layer(
    config: ModelConfig, size: int, dtype: torch.dtype, ops: DeviceOps, eps: float | None = None
) -> NormLayer:
    """A norm layer of ``config``'s family's form over ``size`` features (``eps``: the config's
    ``rms_norm_eps`` unless the family's own config names another, BERT's ``layer_norm_eps``)."""
    return NORM_LAYERS[config.norm](size, config.rms_norm_eps if eps is None else eps, params_dtype=dtype, ops=ops)
