"""What a layer (and the model runner) may ask of the device: the ``DeviceOps`` protocol.

Layers hold the ops object they were built with and call it for every piece of work that
has a device-specific fast version (a fused kernel, a prepacked weight); they never look
at which device or dtype they run on. The model runner asks the same object what serving on
the device assumes (``platform``: memory defaults, CUDA graphs) and for the device's
own way of running a model's decoder layers (``layer_stack``), never the device type.
``runtime.engine.ops.get_ops`` picks the implementation once per (device, dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from runtime.engine.platform import ServingPlatform
from runtime.engine.quant.weight import QuantizedWeight


class RopeCache(Protocol):
    """The rotary tables a model builds once (``runtime.engine.layers.rotary.RotaryEmbedding``)."""

    rotary_dim: int
    cos_cache: torch.Tensor  # fp32 [max_position, rotary_dim // 2]
    sin_cache: torch.Tensor  # fp32 [max_position, rotary_dim // 2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class RopeInputs:
    """One forward's rotary inputs, made once by ``DeviceOps.rope`` and read by every layer.

    ``cos``/``sin`` ``[T, 1, rotary_dim // 2]`` in the activations' dtype are the rows of the
    batch's positions where an implementation gathers them up front (torch, CPU); a kernel
    that reads the fp32 tables at ``positions`` itself (Triton) leaves them None.
    """

    positions: torch.Tensor  # int64 [T]
    cache: RopeCache
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


@dataclass(frozen=True)
class DecoderLayerWeights:
    """One pre-norm decoder layer (RMSNorm, fused-qkv attention, RMSNorm, gated MLP) as a device's
    whole-layer kernels read it: the layer's own parameters (owned, and loaded, by the layer; the
    record only names them) and shapes, made by the model (``LlamaDecoderLayer.decode_weights``) so that a device
    never reads a model's attribute names."""

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


class DecoderStackModel(Protocol):
    """What a device's layer stack needs of a model: its layers' weights, and running the layers
    one by one (for the forwards the stack does not take)."""

    def decode_weights(self) -> list[DecoderLayerWeights]:
        ...

    def run_layers(self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ...


class LayerStack(Protocol):
    """A device's way of running all of a model's decoder layers for one forward, handed to the
    model's forward by the model runner (``DeviceOps.layer_stack``): ``(hidden, residual)`` after
    every layer for the embeddings ``hidden`` (which become the residual stream), exactly as the
    layers one by one would give them."""

    def __call__(self, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any) -> tuple[torch.Tensor, torch.Tensor]:
        ...


class LinearWeightLayer(nn.Module):
    """A layer whose ``weight`` multiplies activations through ``DeviceOps.linear`` /
    ``float_linear`` (the linear layers and the LM head): the weights a device may keep its own
    copy of (``prepare_model``). A marker base, so that a device finds them without importing
    the layers (which import the device ops)."""

    weight: nn.Parameter | QuantizedWeight  # (kept quantized: see runtime.engine.quant.loading)


class DeviceOps(Protocol):
    """The device-specific work of a forward. Every method has the plain torch meaning of
    ``runtime.engine.ops.torch_ops.TorchOps``; implementations differ in speed and rounding only."""

    name: str

    def platform(self, device: torch.device) -> ServingPlatform:
        """What serving on ``device`` assumes (memory defaults, CUDA graphs), asked by the model
        runner instead of testing the device type."""
        ...

    def prepare_process(self) -> None:
        """Process-wide settings for serving on this device (once, before the model is built)."""
        ...

    def prepare_model(self, model: nn.Module) -> None:
        """Device-specific copies of the loaded weights (call after every full load). The device ops own
        those copies (the CPU's hang off the weight tensors they copy); a layer never sees them."""
        ...

    def weight_loaded(self, weight: torch.Tensor) -> None:
        """``weight``'s values were just (re)written by its layer's loader: drop any device copy of
        it (``prepare_model`` makes them again)."""
        ...

    def layer_stack(self, model: DecoderStackModel) -> LayerStack | None:
        """The device's own way of running ``model``'s decoder layers for every forward the model
        runner runs eagerly (the CPU's one-call stack), or None: the model runs them one by one."""
        ...

    def linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
               bias: torch.Tensor | None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` (through the device's copy of ``weight`` where it keeps one);
        a ``QuantizedWeight`` multiplies as its dequantized values would (``reference_linear``), up to
        the kernel's quantization of ``x``."""
        ...

    def embedding(self, ids: torch.Tensor, weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
        """``F.embedding(ids, weight)`` in ``dtype``; of a quantized weight only the looked-up rows are
        dequantized."""
        ...

    def float_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        """``linear(x, weight, None).float()`` (the LM head's fp32 logits), where a device can write
        the fp32 result directly."""
        ...

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """RMSNorm of ``x [..., H]`` as a new tensor (fp32 statistics, cast back before the weight
        multiply, as transformers does). With ``residual``: ``residual += x`` in place first, and
        the norm is of that sum."""
        ...

    def rope(self, cache: RopeCache, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        """The forward's rotary inputs for ``positions`` (once per forward, shared by all layers)."""
        ...

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
        """Rotate ``q [T, Hq, D]`` and ``k [T, Hkv, D]`` in place (neox halves of the first
        ``rotary_dim`` dims). Token rows may be strided (views of a fused qkv output); within
        a token, heads and dims must be packed."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``x [..., 2 * I]`` (gate first) as a new ``[..., I]`` tensor."""
        ...

    def linear_silu_and_mul(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight,
                            bias: torch.Tensor | None) -> torch.Tensor:
        """``silu_and_mul(linear(x, weight, bias))`` (a gated MLP's merged gate/up projection), in
        one pass where a device can fuse the two."""
        ...

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, Hkv, D]`` at KV slots ``loc`` (int64 ``[n]``) of layer ``layer_id``
        of ``pool`` (an ``MHATokenToKVPool``)."""
        ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``argmax(dim=-1)`` of ``[rows, cols]`` logits (greedy sampling)."""
        ...

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        """Constrained decoding: in place, ``logits[r, t] = -inf`` for every token ``t`` whose bit is
        clear in ``bitmask[r]`` (int32 ``[rows, ceil(cols / 32)]``, bit ``t % 32`` of word ``t // 32``),
        for the rows ``rows`` (None: all). ``logits`` is fp32 ``[rows, cols]``, on the bitmask's device."""
        ...
