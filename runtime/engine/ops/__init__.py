"""The device-ops seam: one object per (device, dtype) that layers call for their
device-specific work (``DeviceOps``), picked once by ``get_ops``.

- cpu: ``runtime.engine.cpu.ops.CpuOps`` (the C kernels and prepacked oneDNN linears where they
  apply, else plain torch);
- cuda, in bf16 / fp16 / fp32 with Triton installed: ``runtime.engine.cuda.ops.TritonOps``
  (fused residual-add + RMSNorm, in-place rotary, silu*mul and the KV store as Triton
  kernels);
- anything else: ``runtime.engine.ops.torch_ops.TorchOps`` (plain torch).

``TINYSERVE_OPS=torch`` forces the plain implementation everywhere (to tell a kernel's
problem from the model's).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from runtime.engine.ops.base import DeviceOps
from runtime.engine.ops.layer_stack import DecoderLayerWeights, DecoderStackModel, LayerStack
from runtime.engine.ops.rope import RopeCache, RopeInputs
from runtime.engine.ops.torch_ops import TorchOps
from runtime.engine.platform import ServingPlatform

__all__ = [
    "DecoderLayerWeights",
    "DecoderStackModel",
    "DeviceOps",
    "LayerStack",
    "RopeCache",
    "RopeInputs",
    "ServingPlatform",
    "TorchOps",
    "default_ops",
    "get_ops",
]

OPS_ENV = "TINYSERVE_OPS"
TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def get_ops(device: torch.device | str, dtype: torch.dtype) -> DeviceOps:
    """The ops for tensors of ``dtype`` on ``device`` (one shared object per device type and dtype)."""
    return _ops_for(torch.device(device).type, dtype, os.environ.get(OPS_ENV, "auto"))


def default_ops(dtype: torch.dtype | None = None) -> DeviceOps:
    """``get_ops`` for torch's current default device (a layer built inside ``with torch.device(...)``
    without explicit ops) and ``dtype`` (default: torch's default dtype)."""
    return get_ops(torch.get_default_device(), dtype or torch.get_default_dtype())


@functools.lru_cache(maxsize=None)
def _ops_for(device_type: str, dtype: torch.dtype, choice: str) -> DeviceOps:
    if choice == "torch":
        return TorchOps()
    if device_type == "cpu":
        from runtime.engine.cpu.ops import CpuOps

        return CpuOps()
    if device_type == "cuda" and dtype in TRITON_DTYPES and importlib.util.find_spec("triton") is not None:
        from runtime.engine.cuda.ops import TritonOps

        return TritonOps()
    return TorchOps()
