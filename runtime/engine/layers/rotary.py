"""Rotary position embedding (neox / rotate-half layout, as in HF Llama, Mistral and Qwen).

cos/sin for every position up to ``max_position`` are computed once in fp32 and cached on
the device; a forward only gathers the rows of the batch's positions. Scaling variants:
``linear`` (positions divided by ``factor``) and ``llama3`` (per-frequency smooth
interpolation between the original and the scaled wavelength).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.engine.model_config import RopeConfig
from runtime.engine.ops.torch_ops import rotate_half_


def rope_inv_freq(rotary_dim: int, rope: RopeConfig) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32) after the configured scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        if rope.original_max_position_embeddings is None:
            raise ValueError("llama3 rope scaling needs original_max_position_embeddings")
        old_len = float(rope.original_max_position_embeddings)
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """The cos/sin tables (the ``RopeCache`` of ``runtime.engine.ops``).

    A forward makes its rotary inputs once (``DeviceOps.rope``: every layer uses the same
    positions) and each layer rotates its q and k in place with ``DeviceOps.rotary_``.
    """

    # The buffers registered in __init__ (declared for the type checker: nn.Module's attribute
    # lookup of a buffer is typed ``Tensor | Module``).
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor

    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.max_position = max_position
        inv_freq = rope_inv_freq(self.rotary_dim, rope)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        # Owned here, never written after construction: [max_position, rotary_dim // 2] each.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` ``[T, 1, rotary_dim // 2]`` in ``dtype`` (the activations' dtype, as in HF)."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, D]`` (any strides) rotated as a new contiguous tensor, in plain torch
        (the reference the device ops' in-place ``rotary_`` must equal). (Not ``apply``: that name
        is ``nn.Module.apply(fn)``, which a model's ``apply`` calls on every sub-module.)"""
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out.copy_(x)
        rotate_half_(out, cos, sin, self.rotary_dim)
        return out
