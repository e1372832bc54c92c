"""The layer choices a model family makes: its gated MLP's activation, its norm form, its rope
style. Each is a name in the family's entry (``runtime.checkpoints.families``) that the layers
turn into work here, so that no runner or model compares a family's name to pick a formula.

A name missing from a table is a family the layers cannot run: ``runtime.engine.model_config``
refuses its checkpoint with ``UnsupportedModelError`` before any weight is read. A device's
whole-layer kernels (the CPU's one-call stack) take only the choices they implement, and leave
any other layer to the layers one by one (``runtime.engine.ops.layer_stack``).
"""

from __future__ import annotations

from typing import Callable

import torch

from runtime.engine.layers.linear import MergedColumnParallelLinear
from runtime.engine.layers.norm import RMSNorm

# activation name -> act(gate) * up of a merged gate/up projection's output, through its device
# ops (one pass with the projection where the device fuses them). "swish" is silu's other name.
GatedActivation = Callable[[MergedColumnParallelLinear, torch.Tensor], torch.Tensor]


def _silu_and_mul(gate_up: MergedColumnParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return gate_up.ops.linear_silu_and_mul(x, gate_up.weight, gate_up.bias)


GATED_ACTIVATIONS: dict[str, GatedActivation] = {"silu": _silu_and_mul, "swish": _silu_and_mul}

# norm form -> the layer that computes it (``rms``: x / rms(x) * weight, fp32 statistics)
NORM_FORMS: dict[str, type[RMSNorm]] = {"rms": RMSNorm}

# rope style -> what rotates: ``neox`` pairs the two halves of a head's rotary dims, the one
# layout ``DeviceOps.rotary_`` (and every device's kernel) implements.
ROPE_STYLES: tuple[str, ...] = ("neox",)


def gated_activation(name: str) -> GatedActivation:
    """The gated activation called ``name`` (KeyError: a name ``model_config`` let through)."""
    return GATED_ACTIVATIONS[name]
