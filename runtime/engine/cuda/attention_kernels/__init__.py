"""Triton attention kernels over the paged KV pool (decode, extend, kv_indices).

The kernel modules are imported lazily (on first attribute access) on purpose: Triton
decides between compiled and interpreter mode when ``triton`` and each kernel are first
imported, so ``runtime.engine.cuda.triton_common.prepare_triton_for_device`` must be able to run before that.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "decode_attention_fwd": "runtime.engine.cuda.attention_kernels.decode_attention",
    "get_num_kv_splits": "runtime.engine.cuda.attention_kernels.decode_attention",
    "extend_attention_fwd": "runtime.engine.cuda.attention_kernels.extend_attention",
    "create_kv_indices": "runtime.engine.cuda.attention_kernels.kv_indices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
