"""Llama 3.1-style RoPE scaling in a GGUF file: llama.cpp's ``rope_freqs`` tensor back to a config.

llama.cpp's converter does not copy a ``rope_type: llama3`` config's parameters (factor,
low/high_freq_factor, original_max_position_embeddings) into the metadata: it computes one
divisor per rotary frequency (``LlamaModel.generate_extra_tensors``: 1 for the high
frequencies, ``factor`` for the low ones, a smooth blend between) and stores them as the small
F32 tensor ``rope_freqs.weight``; its RoPE divides each inverse frequency ``base^(-2i/d)`` by its
divisor. Those divisors are config, not weights, so they are read at prepare time.

Where the tensor is a llama3 curve, its parameters are recovered (``factor`` is the largest
divisor, low/high_freq_factor Meta's 1 and 4 as in every Llama 3.1-3.3 config, the original
context from a divisor between the bands) and checked by recomputing the tensor as the converter
does: the config is then the source checkpoint's ``llama3`` scaling, and our tables are the ones
transformers builds from that checkpoint, bit for bit. Any other divisors are kept as they are,
as a per-frequency description our rotary layer applies exactly as llama.cpp does: LongRoPE's
``1 / (factor_i * base^(2i/d))`` with the same factors short and long, its long set never chosen
(original = the context) and no attention factor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from runtime.checkpoints.gguf.reader import GGUFContents, GGUFError

TENSOR = "rope_freqs.weight"
# low_freq_factor, high_freq_factor of Meta's Llama 3.1, 3.2 and 3.3 configs
META_FREQ_FACTORS = (1.0, 4.0)
# Meta's original context (8192), tried when no divisor lies between the bands to say it
META_ORIGINAL_CONTEXT = 8192
# The recomputed divisors may differ from the file's by a few fp32 roundings (another pow)
RTOL = 1e-6


def llama3_divisors(
    base: float, dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> np.ndarray:
    """The ``rope_freqs`` divisors llama.cpp's converter writes for a llama3 scaling, in fp32 as it
    computes them (fp32 frequencies and blend, the band limits in double)."""
    f32 = np.float32
    freqs = f32(1.0) / (f32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / f32(dim)))
    wavelen = f32(2 * math.pi) / freqs
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    smooth = (f32(original) / wavelen - f32(low_freq_factor)) / f32(high_freq_factor - low_freq_factor)
    blend = f32(1.0) / ((f32(1.0) - smooth) / f32(factor) + smooth)
    out = np.where(wavelen < high_wavelen, f32(1.0), np.where(wavelen > low_wavelen, f32(factor), blend))
    return out.astype(np.float32)


def llama3_parameters(divisors: np.ndarray, base: float) -> dict[str, Any] | None:
    """The llama3 ``rope_scaling`` whose converter output is ``divisors`` (to fp32 rounding), with
    Meta's low/high_freq_factor; None when no such parameters reproduce them."""
    factor = float(divisors.max())
    if factor <= 1.0:
        return None
    dim = 2 * divisors.shape[0]
    low, high = META_FREQ_FACTORS
    wavelen = 2 * math.pi * np.float64(base) ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    candidates: list[int] = []
    for i in np.flatnonzero((divisors > 1.0) & (divisors < factor)):
        # 1 / divisor = (1 - s) / factor + s, s = (original / wavelen - low) / (high - low)
        smooth = (1.0 / float(divisors[i]) - 1.0 / factor) / (1.0 - 1.0 / factor)
        candidates.append(round(float(wavelen[i]) * (low + smooth * (high - low))))
    candidates.append(META_ORIGINAL_CONTEXT)
    for original in dict.fromkeys(c for c in candidates if c > 0):
        again = llama3_divisors(base, dim, factor, low, high, original)
        if np.allclose(again, divisors, rtol=RTOL, atol=0.0):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": original,
            }
    return None


def rope_freqs_scaling(contents: GGUFContents, rotary_dim: int, base: float, context: int) -> dict[str, Any] | None:
    """The ``rope_scaling`` of a file with a ``rope_freqs`` tensor (None: every divisor 1, no
    scaling); GGUFError when the tensor is not one F32 divisor per rotary frequency."""
    entry = contents.tensors[TENSOR]
    if entry.type_name != "F32" or entry.shape != (rotary_dim // 2,):
        raise GGUFError(
            f"{contents.path}: tensor {TENSOR} must be F32 with one divisor per rotary frequency "
            f"({rotary_dim // 2},), found {entry.type_name} {entry.shape}"
        )
    divisors = np.fromfile(contents.path, dtype="<f4", count=entry.shape[0], offset=entry.offset)
    if not np.all(np.isfinite(divisors)) or np.any(divisors <= 0):
        raise GGUFError(f"{contents.path}: tensor {TENSOR} holds a divisor that is not a positive number")
    if np.all(divisors == 1.0):
        return None
    llama3 = llama3_parameters(divisors, base)
    if llama3 is not None:
        return llama3
    factors = [float(v) for v in divisors]
    return {
        "rope_type": "longrope",
        "short_factor": factors,
        "long_factor": factors,
        "factor": 1.0,
        "attention_factor": 1.0,
        "original_max_position_embeddings": context,
    }
