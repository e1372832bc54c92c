"""What a device's whole-layer kernels (the CPU's one-call decode stack) read of a model, and
what the model runner hands a model's forward: the layer stack.

Each decoder layer class declares what it is made of (``LayerDescription``: norm form and placement,
activation, MLP kind, attention soft-cap, q/k norm and its span, rotary style and share, window,
biases) in a ``describe`` method of its own class; a device's whole-layer kernels run a layer iff
they implement every declared choice (decided in one place by the device, from this data). A layer
whose class declares nothing, a subclass that changes a layer without declaring what it is now
included (``declared_description`` reads only the layer's own class), never runs in one call. A
layer the kernels take then names its tensors in a ``DecoderLayerWeights`` record; the device never
reads a model's attribute names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.ops.rope import RopeInputs


@dataclass(frozen=True)
class LayerDescription:
    """What one decoder layer computes, as data (each field a choice some family makes)."""

    norm: str  # the norm form (runtime.engine.layers.choices: "rms", "rms_unit_offset")
    norm_placement: str  # "pre": input and post-attention norms; "sandwich": Gemma's four per layer
    activation: str  # the gated MLP's (or the experts') activation
    mlp: str  # "dense" (one gated MLP) or "experts" (a routed sparse MLP)
    rope_style: str  # how q and k rotate ("neox": the two halves of the rotary dims)
    rotary_dim: int  # the dims of each head that rotate (its share of head_dim)
    head_dim: int
    qk_norm: str | None = None  # None, "head" (each head's q and k), "projection" (the whole q / k: OLMoE)
    qkv_clip: float | None = None  # q, k, v clamped to +-clip after the norms (OLMoE's clip_qkv)
    attn_softcap: float | None = None  # attention scores soft-capped (Gemma 2)
    window: int | None = None  # the layer attends within this many keys (None: all)
    experts_top_k: int = 0  # "experts": each token's experts ...
    experts_renormalize: bool = False  # ... with their weights divided by their sum
    shared_expert: bool = False  # "experts": an always-on expert beside the routed ones (Qwen2-MoE)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


def declared_description(layer: object) -> LayerDescription | None:
    """``layer.describe()`` where the layer's own class declares it (defines ``describe`` itself),
    else None: a subclass inherits no declaration, so one that changes what a layer computes and
    says nothing is never taken for its parent by a device's whole-layer kernels."""
    describe = type(layer).__dict__.get("describe")
    return describe(layer) if callable(describe) else None


@dataclass(frozen=True)
class SharedExpert:
    """A sparse layer's always-on expert (Qwen2-MoE): its output scaled by ``sigmoid(gate(x))`` is
    added to the routed experts' (``DeviceOps.moe_shared_gate``)."""

    gate: LinearWeightLayer  # [1, hidden]
    gate_up: LinearWeightLayer  # [2 * inter, hidden], gate rows first
    down: LinearWeightLayer  # [hidden, inter]


@dataclass(frozen=True)
class RoutedExperts:
    """A sparse layer's MLP (``description.mlp == "experts"``) as a device's whole-layer kernels read
    it: the router, every expert's linears by global id (the layer owns and loads them; a device
    reads their weights and plans), and how the top-k weights are made (``runtime.engine.layers.moe``)."""

    router: LinearWeightLayer  # [num_experts, hidden]
    # per expert this rank holds, in id order (all of them but under expert parallelism)
    gate_up: tuple[LinearWeightLayer, ...]  # [2 * inter, hidden], gate rows first
    down: tuple[LinearWeightLayer, ...]  # per expert: [hidden, inter]
    top_k: int
    renormalize: bool  # the top-k weights divided by their sum
    weights_in_model_dtype: bool  # the weights rounded to the model's dtype before they scale
    shared: SharedExpert | None = None

    @property
    def linears(self) -> tuple[LinearWeightLayer, ...]:
        shared = () if self.shared is None else (self.shared.gate, self.shared.gate_up, self.shared.down)
        return (self.router, *self.gate_up, *self.down, *shared)


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer (RMSNorm, fused-qkv attention, RMSNorm, gated MLP or routed experts) as a
    device's whole-layer kernels read it: its declared description, the layer's own parameters and
    linear layers (owned, and loaded, by the layer; the record only names them: a linear's weight
    and the device's plan for it are read from the layer when the device describes the stack) and
    shapes, made by the layer (``decode_weights``) so that a device never reads attribute names."""

    description: LayerDescription
    input_norm: torch.Tensor  # [hidden]
    input_norm_eps: float
    post_norm: torch.Tensor  # [hidden]
    post_norm_eps: float
    qkv: LinearWeightLayer  # [(q_heads + 2 * kv_heads) * head_dim, hidden]: q rows, then k, then v
    o: LinearWeightLayer  # [hidden, q_heads * head_dim]
    gate_up: LinearWeightLayer | None  # [2 * inter, hidden]: gate rows first (None: a sparse layer)
    down: LinearWeightLayer | None  # [hidden, inter]
    num_heads: int  # query heads (on this rank)
    num_kv_heads: int
    scaling: float  # attention's softmax scale
    tp_size: int  # ranks the layer's linears are split over
    # q/k norms before RoPE: per head (``description.qk_norm == "head"``: each [head_dim], applied to
    # every query (key) head of the qkv output) or over the whole projection ("projection": q_norm
    # [num_heads * head_dim], k_norm [num_kv_heads * head_dim]), with their eps; None: none
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qk_norm_eps: float = 0.0
    experts: RoutedExperts | None = None  # a sparse layer's MLP (gate_up and down are None then)
    # the sandwich placement (``description.norm_placement == "sandwich"``, Gemma): ``post_norm`` norms the
    # attention output alone, ``pre_mlp_norm`` the residual stream after its add (the MLP's input) and
    # ``post_mlp_norm`` the MLP's output, each [hidden] with ``post_norm_eps``; None: the pre placement
    pre_mlp_norm: torch.Tensor | None = None
    post_mlp_norm: torch.Tensor | None = None
    # which of the model's rotary inputs the layer rotates with (an index into ``DecoderStackModel.rope_tables``:
    # Gemma 3's windowed layers have their own base)
    rope_table: int = 0

    @property
    def linears(self) -> tuple[LinearWeightLayer, ...]:
        """Every linear the layer's kernels read: qkv, o, then gate_up and down, or the experts'."""
        mlp = self.experts.linears if self.experts is not None else (self.gate_up, self.down)
        return tuple(linear for linear in (self.qkv, self.o, *mlp) if linear is not None)


class DescribedLayer(Protocol):
    """A decoder layer a device's whole-layer kernels may take: its description, and its record
    (asked only after the device accepted the description)."""

    def describe(self) -> LayerDescription: ...

    def decode_weights(self) -> DecoderLayerWeights: ...


class DecoderStackModel(Protocol):
    """What a device's layer stack needs of a model: its decoder layers in order (none: the stack
    always runs them one by one through the model), and running the layers one by one (for the
    forwards the stack does not take)."""

    def decoder_layers(self) -> Sequence[Any]: ...

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rope_tables(self, rope: RopeInputs, dtype: torch.dtype) -> tuple[RopeInputs, ...]:
        """The forward's rotary inputs, ``rope`` first, then any a family's layers use instead
        (``DecoderLayerWeights.rope_table`` indexes them)."""
        ...


class LayerStack(Protocol):
    """A device's way of running all of a model's decoder layers for one forward, handed to the
    model's forward by the model runner (``DeviceOps.layer_stack``): ``(hidden, residual)`` after
    every layer for the embeddings ``hidden`` (which become the residual stream), exactly as the
    layers one by one would give them."""

    def __call__(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
