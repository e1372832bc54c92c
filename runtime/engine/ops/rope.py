"""The rotary inputs that cross the device seam: the tables a model builds once (``RopeCache``)
and one forward's inputs made from them (``RopeInputs``), shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


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
