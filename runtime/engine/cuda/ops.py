"""``TritonOps``: the device-ops seam on cuda, through the Triton kernels of
``runtime.engine.cuda.kernels`` (falling back to the torch op where a kernel does not take a
layout). Linears stay cuBLAS (``F.linear``), except weights kept quantized (``--quantization``:
the dequantizing matmul of ``runtime.engine.cuda.quant_matmul``), and greedy argmax stays torch's.

The kernel module is imported on first use, after ``prepare_triton_for_device``: on a CPU
(tests, under Triton's interpreter) that is what switches the interpreter on.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from runtime.engine.cuda.triton_common import prepare_triton_for_device
from runtime.engine.ops.rope import RopeCache, RopeInputs
from runtime.engine.ops.torch_ops import TorchOps
from runtime.engine.quant.weight import QuantizedWeight


class TritonOps(TorchOps):
    name = "triton"

    def __init__(self) -> None:
        self._module: ModuleType | None = None

    def _kernels(self, device: torch.device) -> ModuleType:
        if self._module is None:
            prepare_triton_for_device(device)
            from runtime.engine.cuda import kernels

            self._module = kernels
        return self._module

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            self._kernels(x.device)  # (switches the interpreter on for CPU tensors first)
            from runtime.engine.cuda.quant_matmul import quant_matmul

            return quant_matmul(x, weight, bias)
        return super().linear(x, weight, bias)

    def float_linear(self, x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
        if isinstance(weight, QuantizedWeight):
            self._kernels(x.device)
            from runtime.engine.cuda.quant_matmul import quant_matmul

            return quant_matmul(x, weight, None, out_dtype=torch.float32)
        return super().float_linear(x, weight)

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self._kernels(x.device).rms_norm(x, weight, eps, residual)
        return out if out is not None else super().rms_norm(x, weight, eps, residual)

    def rope(self, cache: RopeCache, positions: torch.Tensor, dtype: torch.dtype) -> RopeInputs:
        return RopeInputs(positions, cache)  # the kernel reads the fp32 tables at the positions itself

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, rope: RopeInputs) -> None:
        cache = rope.cache
        if not self._kernels(q.device).rotary_(
            q, k, rope.positions, cache.cos_cache, cache.sin_cache, cache.rotary_dim
        ):
            super().rotary_(q, k, rope)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        out = self._kernels(x.device).silu_and_mul(x)
        return out if out is not None else super().silu_and_mul(x)

    def store_kv(self, pool: Any, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_buf, v_buf = pool.get_kv_buffer(layer_id)
        if not self._kernels(k.device).store_kv(k_buf, v_buf, loc, k, v):
            super().store_kv(pool, layer_id, loc, k, v)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> None:
        import xgrammar  # the grammar engine's own Triton kernel (constrained requests only)

        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows, backend="triton")
