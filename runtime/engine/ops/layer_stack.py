"""What a device's whole-layer kernels (the CPU's one-call decode stack) read of a model, and
what the model runner hands a model's forward: the layer stack.

A model describes each decoder layer in a ``DecoderLayerWeights`` record (the pre-norm layer the
Llama-style families share, with its layer choices named) or says its layers have no such form;
the device never reads a model's attribute names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from runtime.engine.ops.rope import RopeInputs
from runtime.engine.quant.weight import QuantizedWeight


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer (RMSNorm, fused-qkv attention, RMSNorm, gated MLP) as a device's
    whole-layer kernels read it: the layer's own parameters (owned, and loaded, by the layer; the
    record only names them), shapes and layer choices, made by the model (``CausalLM.decode_weights``)
    so that a device never reads a model's attribute names."""

    input_norm: torch.Tensor  # [hidden]
    input_norm_eps: float
    post_norm: torch.Tensor  # [hidden]
    post_norm_eps: float
    # the linears' weights: dense, or kept quantized (runtime.engine.quant)
    qkv: torch.Tensor | QuantizedWeight  # [(q_heads + 2 * kv_heads) * head_dim, hidden]: q rows, then k, then v
    qkv_bias: torch.Tensor | None
    o: torch.Tensor | QuantizedWeight  # [hidden, q_heads * head_dim]
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor | QuantizedWeight  # [2 * inter, hidden]: gate rows first
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor | QuantizedWeight  # [hidden, inter]
    down_bias: torch.Tensor | None
    num_heads: int  # query heads (on this rank)
    num_kv_heads: int
    head_dim: int
    scaling: float  # attention's softmax scale
    sliding_window: int | None  # None: full attention
    qk_norm: bool  # per-head RMSNorm of q and k before rotary
    tp_size: int  # ranks the layer's linears are split over
    # The family's layer choices (runtime.engine.layers.choices): a device's kernels take the
    # layers whose choices they implement and leave the others to the layers one by one.
    activation: str
    norm: str
    rope_style: str


class DecoderStackModel(Protocol):
    """What a device's layer stack needs of a model: its layers' weights (None: its layers are not
    of the record's form, and the stack always runs them one by one), and running the layers one
    by one (for the forwards the stack does not take)."""

    def decode_weights(self) -> list[DecoderLayerWeights] | None: ...

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class LayerStack(Protocol):
    """A device's way of running all of a model's decoder layers for one forward, handed to the
    model's forward by the model runner (``DeviceOps.layer_stack``): ``(hidden, residual)`` after
    every layer for the embeddings ``hidden`` (which become the residual stream), exactly as the
    layers one by one would give them."""

    def __call__(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
