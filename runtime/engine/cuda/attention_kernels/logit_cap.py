"""Soft-capping of attention logits inside the Triton kernels: ``cap * tanh(score / cap)``.

Gemma 2 caps every layer's scaled attention scores (``AttentionLayerSpec.logit_softcap``); the
decode and extend kernels apply ``soft_cap`` to each block of scores after the scaling and before
the mask, behind a ``logit_cap`` constexpr (0: off, and then the code is not even compiled in).

Why two tanh: compiled, the device library's ``tanh`` (libdevice on CUDA, ocml on ROCm: correctly
rounded to a few ulp). Triton's interpreter (CPU tests) has no device library, so there tanh is
written with ``exp``: an odd polynomial near 0 (where ``1 - exp(-2|x|)`` would cancel) and
``(1 - e) / (1 + e)``, ``e = exp(-2|x|)`` beyond it (no overflow for any x); both within a few fp32
ulp of tanh. Which one is decided when this module is imported, the moment Triton picks its mode.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from runtime.engine.cuda.triton_common import interpreter_requested

_DEVICE_TANH = tl.constexpr(not interpreter_requested())
# Below this |x| the series x - x^3/3 + 2x^5/15 is exact to ~1e-9 relative.
_SERIES_LIMIT = tl.constexpr(0.0625)


@triton.jit
def _tanh(x):
    """tanh of an fp32 block (see the module docstring for the two forms)."""
    if _DEVICE_TANH:
        t = libdevice.tanh(x)
    else:
        ax = tl.abs(x)
        e = tl.exp(-2.0 * ax)
        far = (1.0 - e) / (1.0 + e)
        x2 = x * x
        near = ax * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0)))
        t = tl.where(ax < _SERIES_LIMIT, near, far)
        t = tl.where(x < 0, -t, t)
    return t


@triton.jit
def soft_cap(qk, logit_cap: tl.constexpr):
    """``logit_cap * tanh(qk / logit_cap)`` for the scaled scores ``qk`` (fp32); ``qk`` as is when 0."""
    if logit_cap > 0:
        qk = logit_cap * _tanh(qk / logit_cap)
    return qk
