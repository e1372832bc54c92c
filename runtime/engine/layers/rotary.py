"""Rotary position embedding (neox / rotate-half layout, as in HF Llama, Mistral and Qwen).

cos/sin for every position up to ``max_position`` are computed once in fp32 and cached on
the device; a forward only gathers the rows of the batch's positions. Scaling variants:
``linear`` (positions divided by ``factor``), ``llama3`` (per-frequency smooth
interpolation between the original and the scaled wavelength) and ``longrope`` (Phi-3.5,
Phi-4-mini: per-frequency divisors, short or long, and an attention factor in cos and sin).

LongRoPE's two sets of frequencies live in one table of ``2 * max_position`` rows: the short
rows, then the long ones. A forward's table positions (``table_positions``) point a token at the
long rows by adding ``max_position`` where transformers' ``generate`` uses the long factors, so every
device's rotary op (which gathers rows at positions, or reads the table at them in a kernel)
serves both without knowing of them.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from runtime.engine.forward_batch import ForwardBatch, ForwardMode
from runtime.engine.ops.torch_ops import rotate_half_
from runtime.engine.rope_config import RopeConfig, longrope_switch_len


def rope_inv_freq(rotary_dim: int, rope: RopeConfig, long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (fp32) after the configured scaling (``long``: a
    longrope's long factors, else its short ones)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    if rope.rope_type == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"longrope needs {rotary_dim // 2} factors (one per rotary pair), got {len(factors)}")
        # transformers' operation order: 1 / (factor * theta ** exponent)
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
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
        # longrope: a sequence longer than this rotates its new tokens with the long rows (None:
        # one set of frequencies, or a context that never outgrows the short ones)
        self.long_after = longrope_switch_len(rope, max_position)
        sets = [rope_inv_freq(self.rotary_dim, rope)]
        if self.long_after is not None:
            sets.append(rope_inv_freq(self.rotary_dim, rope, long=True))
        positions = torch.arange(max_position, dtype=torch.float32)[:, None]
        freqs = torch.cat([positions * inv_freq[None, :] for inv_freq in sets])
        cos, sin = freqs.cos(), freqs.sin()
        if rope.attention_factor != 1.0:  # (as transformers: fp32 cos / sin times the factor)
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        # Owned here, never written after construction: [max_position (x2: longrope), rotary_dim // 2] each.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def table_positions(self, batch: ForwardBatch) -> torch.Tensor:
        """The table rows of ``batch``'s tokens: their positions, moved to the long rows (by
        ``max_position``) for the tokens transformers' ``generate`` rotates with the long factors.

        transformers picks the set per forward (the long one when its last position + 1 exceeds
        ``original_max_position_embeddings``), and ``generate`` keeps every cached key on the same
        side: the step at which a sequence outgrows the limit re-runs it whole with the long factors
        (Phi-3's ``prepare_inputs_for_generation``). Per request here: an extend's tokens are long
        when the scheduler says the request is (``batch.long_rope``: its whole sequence is past the
        limit, which a chunk's ``seq_lens`` may not show; it recomputes a request that outgrows the
        limit, ``scheduler_proc.long_rope``), or, in a batch without that choice (tests' harness),
        when its sequence after the forward is; a decode or verify token when its own position + 1
        is (past the limit only long requests decode). Tensor ops only (no host sync; a CUDA graph
        replays them)."""
        positions = batch.positions
        if self.long_after is None:
            return positions
        if batch.forward_mode in (ForwardMode.DECODE, ForwardMode.VERIFY):
            long = positions >= self.long_after
        else:
            per_request = batch.long_rope if batch.long_rope is not None else batch.seq_lens > self.long_after
            long = torch.repeat_interleave(per_request, batch.extend_lens, output_size=positions.shape[0])
        return positions + long.to(positions.dtype) * self.max_position

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
