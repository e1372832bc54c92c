"""The device ops' Triton kernels compiled on a GPU, in bf16 / fp16 / fp32, against the plain
torch ops on the same GPU (the cases of ops_cases.py; the interpreter runs them in fp32 in
test_triton_ops.py), and a tiny model through TritonOps against TorchOps.

Compiled Triton is needed here, so when this session set TRITON_INTERPRET=1 (the CPU kernel
tests do, for the whole process) the tests run in a fresh process without it.
"""

from __future__ import annotations

import pytest
import torch

from tests.support import ops_cases
from tests.support.triton_interp import run_compiled_when_interpreting

DTYPES = [(torch.float32, 1e-4), (torch.float16, 4e-3), (torch.bfloat16, 3e-2)]


def _ops():
    from runtime.engine.cuda.ops import TritonOps
    from runtime.engine.ops import get_ops

    ops = get_ops("cuda", torch.bfloat16)
    assert isinstance(ops, TritonOps)
    return ops


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("hidden", [37, 128, 4096])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(dtype: torch.dtype, tol: float, hidden: int, residual: bool) -> None:
    ops_cases.check_rms_norm(_ops(), "cuda", dtype, hidden, residual, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_rms_norm_on_strided_head_views(dtype: torch.dtype, tol: float) -> None:
    ops_cases.check_rms_norm_on_head_views(_ops(), "cuda", dtype, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(48, 48), (80, 80), (128, 128), (128, 64)])
@pytest.mark.parametrize("llama3", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_rotary_in_place(
    dtype: torch.dtype, tol: float, head_dim: int, rotary_dim: int, llama3: bool, fused: bool
) -> None:
    ops_cases.check_rotary(_ops(), "cuda", dtype, head_dim, rotary_dim, llama3, fused, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("inter", [37, 1100, 5632])
def test_silu_and_mul(dtype: torch.dtype, tol: float, inter: int) -> None:
    ops_cases.check_silu_and_mul(_ops(), "cuda", dtype, inter, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("head_dim", [48, 80, 128])
def test_store_kv(dtype: torch.dtype, tol: float, head_dim: int) -> None:
    ops_cases.check_store_kv(_ops(), "cuda", dtype, head_dim)


def test_tiny_model_through_triton_ops_matches_torch_ops(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 on the GPU: the same greedy tokens through TritonOps as through TorchOps."""
    from runtime.engine import model_runner
    from runtime.engine.ops import TorchOps
    from tests.support.harness import Harness

    path = tiny_checkpoints.path("qwen3")
    outputs = []
    for ops in (_ops(), TorchOps()):
        monkeypatch.setattr(model_runner, "get_ops", lambda device, dtype, ops=ops: ops)
        runner = model_runner.ModelRunner(
            path,
            device="cuda",
            dtype="float32",
            attention_backend="triton",
            max_total_tokens=512,
            load_progress=False,
            disable_cuda_graph=True,
        )
        prompts = [[3, 9, 27, 5, 11, 70][: 3 + i] for i in range(3)]
        outputs.append([r.output_ids for r in Harness(runner).generate(prompts, 6)])
    assert outputs[0] == outputs[1]


run_compiled_when_interpreting(globals(), __file__)
