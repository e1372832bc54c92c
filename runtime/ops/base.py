"""What a layer may ask of the device: the ``DeviceOps`` protocol.

Layers hold the ops object they were built with and call it for every piece of work that
has a device-specific fast version (a fused kernel, a prepacked weight); they never look
at which device or dtype they run on. ``runtime.ops.get_ops`` picks the implementation
once per (device, dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn


class RopeCache(Protocol):
    """The rotary tables a model builds once (``runtime.layers.rotary.RotaryEmbedding``)."""

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


class DeviceOps(Protocol):
    """The device-specific work of a forward. Every method has the plain torch meaning of
    ``runtime.ops.torch_ops.TorchOps``; implementations differ in speed and rounding only."""

    name: str

    def prepare_process(self) -> None:
        """Process-wide settings for serving on this device (once, before the model is built)."""
        ...

    def prepare_model(self, model: nn.Module) -> None:
        """Device-specific copies of the loaded weights (call after every full load)."""
        ...

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)``; ``packed`` is the layer's ``packed_weight`` slot."""
        ...

    def float_linear(self, x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor:
        """``linear(x, weight, None, packed).float()`` (the LM head's fp32 logits), where a device
        can write the fp32 result directly."""
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

    def linear_silu_and_mul(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
    ) -> torch.Tensor:
        """``silu_and_mul(linear(x, weight, bias, packed))`` (a gated MLP's merged gate/up
        projection), in one pass where a device can fuse the two."""
        ...

    def decoder_layers(
        self, layers: nn.ModuleList, rope: RopeInputs, hidden: torch.Tensor, batch: Any, backend: Any
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(hidden, residual)`` after all of a model's decoder ``layers`` for the embeddings
        ``hidden`` (which become the residual stream), where the device runs the whole stack of
        this batch in one call with the layers' own results; None: run the layers one by one."""
        ...

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, Hkv, D]`` at KV slots ``loc`` (int64 ``[n]``) of layer ``layer_id``
        of ``pool`` (an ``MHATokenToKVPool``)."""
        ...

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """int64 ``argmax(dim=-1)`` of ``[rows, cols]`` logits (greedy sampling)."""
        ...
