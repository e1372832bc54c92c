"""``--attention-backend`` name -> backend class.

Backends are constructed as ``cls(model_runner)`` (SGLang's convention): a backend reads
what it needs (device, pools, head counts, max_running_requests) from the runner. The
Triton backend is imported lazily so CPU-only code paths never import Triton. A name may
have a device-specific class: ``torch_native`` on CPU is the CPU wing's backend (the same
plan, run through the CPU kernels), so the plain backend never passes through CPU paths.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from runtime.engine.attention.base import AttentionBackend

ATTENTION_BACKENDS: dict[str, str] = {
    "torch_native": "runtime.engine.attention.torch_native:TorchNativeAttnBackend",
    "triton": "runtime.engine.cuda.attention:TritonAttnBackend",
}
# (name, device type) -> the class that replaces the default one on that device.
DEVICE_BACKENDS: dict[tuple[str, str], str] = {
    ("torch_native", "cpu"): "runtime.engine.cpu.attention:CpuAttnBackend",
}


def resolve_attention_backend_name(name: str, device: torch.device) -> str:
    """``auto`` -> ``triton`` on cuda, ``torch_native`` elsewhere; other names are checked."""
    key = name.strip().lower()
    if key == "auto":
        return "triton" if device.type == "cuda" else "torch_native"
    if key not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}: choose auto, {', '.join(ATTENTION_BACKENDS)}")
    return key


def get_attention_backend_class(name: str, device: torch.device) -> type[AttentionBackend]:
    key = resolve_attention_backend_name(name, device)
    target = DEVICE_BACKENDS.get((key, device.type), ATTENTION_BACKENDS[key])
    module_name, cls_name = target.split(":")
    module = importlib.import_module(module_name)
    return getattr(module, cls_name)


def create_attention_backend(name: str, model_runner: Any) -> AttentionBackend:
    return get_attention_backend_class(name, model_runner.device)(model_runner)
