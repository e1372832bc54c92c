"""Soft-capped attention logits on a GPU: the compiled Triton decode and extend kernels (device
tanh, tensor-core dots) and torch_native on cuda, through the batches of
``tests.support.attention_softcap``, against the formula of transformers' eager Gemma 2 attention
(the interpreter runs the same batches in fp32 in tests/unit/runtime/engine/attention/test_attention_softcap.py).

Compiled Triton is needed here, so when this session set TRITON_INTERPRET=1 (the CPU kernel tests
do, for the whole process) the tests run in a fresh process without it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.attention_softcap import CAP, check, layer_specs, run_steps, runner_view
from tests.support.triton_interp import run_compiled_when_interpreting

DTYPES = [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 5e-2)]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (4, 4, 80), (8, 1, 128)])
@pytest.mark.parametrize("cap", [CAP, None])
def test_triton_kernels_cap_logits(
    dtype: torch.dtype, tol: float, heads: int, kv_heads: int, head_dim: int, cap: float | None
) -> None:
    """Grouped (GQA) and per-head (MHA) decode, extend with and without cached prefix, windowed and full."""
    from runtime.engine.cuda.attention import TritonAttnBackend

    backend = TritonAttnBackend(runner_view(heads, kv_heads, "cuda"))
    results = run_steps(backend, layer_specs(heads, kv_heads, head_dim, cap), cap, dtype=dtype, device="cuda")
    check(results, tol)


# torch_native's half-precision scores are rounded to the dtype before the cap (as in transformers'
# eager attention), a little looser than the kernels' fp32 scores.
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.float16, 1e-2), (torch.bfloat16, 8e-2)])
def test_torch_native_caps_logits_on_cuda(dtype: torch.dtype, tol: float) -> None:
    from runtime.engine.attention.torch_native import TorchNativeAttnBackend

    backend = TorchNativeAttnBackend(runner_view(4, 2, "cuda"))
    check(run_steps(backend, layer_specs(4, 2, 64, CAP), CAP, dtype=dtype, device="cuda"), tol)


run_compiled_when_interpreting(globals(), __file__)
