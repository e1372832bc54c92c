"""What every Triton attention kernel needs to know about where it runs.

Triton has two execution modes. On cuda the kernels are compiled and use bf16/fp16
tensor-core dots with fp32 accumulation. On a CPU-only machine they can only run
under Triton's interpreter (``TRITON_INTERPRET=1``), which executes each program
with numpy: there bf16 arithmetic is wrong (numpy has no bf16), so every kernel
loads its inputs as fp32, and a single small autotune config keeps tests fast.

Triton reads ``TRITON_INTERPRET`` when ``triton`` is first imported (its standard
library, e.g. ``tl.max``, is decorated then) and when each kernel is decorated, not
when it is launched. So the variable must be set before anything imports
``triton`` -- and ``transformers`` imports it. The helpers below detect the mode
from the environment at call time and turn an inconsistent process state into a
clear error instead of a numpy crash deep inside a kernel.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

import torch

logger = logging.getLogger(__name__)

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreter_requested() -> bool:
    """True when this process asked for Triton's interpreter (read at call time)."""
    return os.environ.get(INTERPRET_ENV) == "1"


def triton_loaded_interpreted() -> bool:
    """True when ``triton`` was imported in interpreter mode (its standard library is interpreted).

    A process that imported ``triton`` before setting ``TRITON_INTERPRET=1`` has compiled
    standard-library functions that raise when called from an interpreted kernel.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


def is_interpreted_kernel(kernel: Any) -> bool:
    """True when a (possibly autotuned) kernel object was decorated in interpreter mode."""
    from triton.runtime.interpreter import InterpretedFunction

    seen = 0
    while not isinstance(kernel, InterpretedFunction) and hasattr(kernel, "fn") and seen < 8:
        kernel = kernel.fn  # Autotuner / Heuristics wrap the jitted function in .fn
        seen += 1
    return isinstance(kernel, InterpretedFunction)


def prepare_triton_for_device(device: torch.device | str) -> None:
    """Make the process able to run the Triton kernels on ``device``, or say why it cannot.

    On cpu the interpreter is the only option: when ``triton`` has not been imported yet
    we switch it on here; when it was already imported in compiled mode nothing can be
    done in-process, so we raise with the fix (set ``TRITON_INTERPRET=1`` at start-up).
    """
    device = torch.device(device)
    if device.type != "cpu":
        return
    if not interpreter_requested():
        if "triton" in sys.modules:
            raise RuntimeError(
                "the triton attention backend on cpu needs TRITON_INTERPRET=1, but triton was already "
                "imported in compiled mode; set TRITON_INTERPRET=1 in the environment before start-up"
            )
        logger.info("cpu device: enabling Triton's interpreter (TRITON_INTERPRET=1)")
        os.environ[INTERPRET_ENV] = "1"
    elif "triton" in sys.modules and not triton_loaded_interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 was set after triton had been imported (transformers imports it); "
            "set it in the environment before start-up"
        )


def interpreted_dtype(device: torch.device | str) -> str | None:
    """The dtype ``auto`` means for Triton kernels on ``device``: fp32 where they run interpreted
    (on cpu: the interpreter's numpy backend gets bf16 math wrong), else None (the device's own)."""
    return "float32" if torch.device(device).type == "cpu" else None


def check_launch(kernel: Any, *tensors: torch.Tensor) -> None:
    """Refuse to launch a kernel whose mode does not match where its tensors live."""
    on_cpu = any(t.device.type == "cpu" for t in tensors)
    on_cuda = any(t.device.type == "cuda" for t in tensors)
    if on_cpu and on_cuda:
        raise ValueError("Triton kernel arguments mix cpu and cuda tensors")
    interpreted = is_interpreted_kernel(kernel)
    if on_cpu and not interpreted:
        raise RuntimeError(
            "Triton kernels on cpu tensors need the interpreter: set TRITON_INTERPRET=1 before "
            "importing triton (or anything that imports it, such as transformers)"
        )
    if interpreted and not triton_loaded_interpreted():
        raise RuntimeError(
            "the kernels were decorated for Triton's interpreter but triton itself was imported in "
            "compiled mode; set TRITON_INTERPRET=1 before anything imports triton"
        )


def use_fp32_math() -> bool:
    """Load bf16/fp16 as fp32 and compute in fp32: required by the interpreter's numpy backend."""
    return interpreter_requested()


def next_power_of_2(n: int) -> int:
    """Block width covering ``n`` (head dims like 80 or 96 are padded to 128 and masked)."""
    if n <= 1:
        return 1
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=8)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def device_core_count(device: torch.device | str) -> int:
    """Parallel execution units: SMs on cuda; a small number on cpu, where programs run one by one."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_sm_count(index)
    return 1


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` input precision: exact for fp32 inputs (no silent tf32), native otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"
