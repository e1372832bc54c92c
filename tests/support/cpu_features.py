"""Which of the CPU kernels' paths this machine (and this process's library caps) runs."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.cpu import kernel_library
from runtime.engine.cpu.prepacked import AMX_TILES, DP_PAIRS, pack_weight


def bf16_kernels() -> str | None:
    """The set of kernels a bf16 call runs here: "amx" (AMX tiles, and oneDNN packing for them:
    ONEDNN_MAX_CPU_ISA may keep it off), "dp" (oneDNN's AVX512-BF16 packing, as on a CPU without
    AMX), or None; both need the kernels' avx512bf16 build (TINYSERVE_CPU_ISA may select another)."""
    if kernel_library.level() != "avx512bf16":
        return None
    distinct = (torch.arange(64 * 64) % 251).view(64, 64).to(torch.bfloat16)  # (a constant weight fits any layout)
    packed = pack_weight(distinct)
    layout = packed.layout if packed is not None else None
    if kernel_library.amx_available() and layout == AMX_TILES:
        return "amx"
    return "dp" if layout == DP_PAIRS else None


needs_amx = pytest.mark.skipif(
    bf16_kernels() != "amx",
    reason="needs a CPU with AMX tiles (amx_tile, amx_bf16) for oneDNN's and our kernels: the call's linears run on them",
)
