"""Device and dtype resolution for ``--device`` and ``--dtype``.

Kept apart from the model runner because the CLI, the scheduler and tests all need
the same answer to "what does auto mean on this machine" before any model exists.
"""

from __future__ import annotations

import logging

import torch

from runtime.engine.quant.loading import DUAL_METHOD  # (its activations follow the dense rule)

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``auto`` -> cuda when a GPU is visible, else cpu; ``cuda``/``cuda:N``/``cpu`` as given."""
    if isinstance(name, torch.device):
        return name
    name = name.strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"--device {name} was requested but no CUDA device is available")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"unsupported device {name!r}: use auto, cuda or cpu")
    return device


def concrete_device(device: torch.device) -> torch.device:
    """``device`` with the index it stands for: a bare ``cuda`` is the current cuda device (what
    pools, graphs and memory queries of one runner must agree on); others as they are."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def cpu_supports_bf16() -> bool:
    """True when the CPU has native bf16 matmul (AVX512-BF16 or AMX) through oneDNN.

    Without it, bf16 on CPU is emulated and both slower and less accurate than fp32.
    """
    if not torch.backends.mkldnn.is_available():
        return False
    cpu = getattr(torch, "cpu", None)
    for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        fn = getattr(cpu, probe, None)
        if fn is not None:
            try:
                if fn():
                    return True
            except Exception:  # a probe that fails means "unknown": fall through to fp32
                logger.debug("bf16 probe %s failed", probe, exc_info=True)
    return False


def cpu_has_amx() -> bool:
    """True when the CPU has AMX tiles (torch's probe, as ``cpu_supports_bf16`` reads it)."""
    probe = getattr(getattr(torch, "cpu", None), "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:  # a probe that fails means "unknown": not AMX
        logger.debug("AMX probe failed", exc_info=True)
        return False


def dtype_reason(
    name: str | torch.dtype,
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    native_bf16: bool | None = None,
) -> str:
    """Why ``resolve_dtype(name, device, quantization, native_bf16)`` is what it is, for the start-up log."""
    if isinstance(name, torch.dtype) or name.strip().lower() != "auto":
        return "--dtype"
    if torch.device(device).type == "cuda":
        return "auto: the GPU's half precision"
    native = cpu_supports_bf16() if native_bf16 is None else native_bf16
    if quantization == "gguf" and native:
        return "auto with --quantization gguf on a CPU with native bf16: the blocks' bf16 kernels"
    if quantization is not None and quantization != DUAL_METHOD:
        return "auto with --quantization: the kept-quantized kernels' one-call decode stack takes fp32 activations"
    if native:
        return "auto: this CPU has native bf16 matmul (AVX512-BF16 or AMX)"
    return "auto: this CPU has no native bf16 matmul (bf16 would be emulated: slower and less exact)"


def resolve_dtype(
    name: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    quantization: str | None = None,
    native_bf16: bool | None = None,
) -> torch.dtype:
    """``auto`` -> bf16 on cuda (fp16 on GPUs without bf16); on CPUs with weights kept quantized
    (``quantization``) fp32, but for a GGUF file's blocks (``gguf``) on a CPU with native bf16 matmul:
    bf16, whose few rows run on AVX512-BF16 dot products (csrc/quant_linear_bf16.c: Qwen2.5-Coder-1.5B
    Q4_K_M's decode layers 38.6 ms a token against fp32's 51.0 on a 2-core AVX-512 EPYC) and whose
    many rows on the weight dequantized to bf16 (``quant_kernels.BF16_DENSE_MIN_ROWS``); with
    ``gguf_dual``, whose dense values serve the large products, the dense rule; else bf16 where the
    CPU has native bf16 matmul, else fp32. ``native_bf16``: the CPU class
    the caller decided on (None: this host's, ``cpu_supports_bf16``), so that one reading of the CPU
    decides every rule of a start, and a test can set the class it assumes."""
    if isinstance(name, torch.dtype):
        return name
    key = name.strip().lower()
    device = torch.device(device)
    if key == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        native = cpu_supports_bf16() if native_bf16 is None else native_bf16
        if quantization is not None and quantization != DUAL_METHOD:
            return torch.bfloat16 if quantization == "gguf" and native else torch.float32
        return torch.bfloat16 if native else torch.float32
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: use auto, bfloat16, float16 or float32")
    return _DTYPES[key]
