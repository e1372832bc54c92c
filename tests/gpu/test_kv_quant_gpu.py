"""A quantized KV cache (int8, fp8_e4m3, fp8_e5m2, bf16 under fp32) through the compiled Triton kernels
on a GPU, in bf16 and fp32: the store byte for byte against ``KVCacheFormat.quantize`` run by torch
on the same GPU (its CUDA division rule included), the decode and extend kernels against float64
attention over the dequantized pool (the cases of tests/support/kv_quant_cases.py; the interpreter runs
them in fp32 in tests/unit/runtime/engine/cuda/test_triton_kv_quant.py), and the tiny Llama with CUDA
graphs against torch_native on the same quantized cache.

Compiled Triton is needed here, so when this session set TRITON_INTERPRET=1 (the CPU kernel tests
do, for the whole process) the tests run in a fresh process without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support import kv_quant_cases as cases
from tests.support.triton_interp import run_compiled_when_interpreting

# fp32: ieee dots, reassociation only; bf16: q and the softmax weights enter the dots in bf16, the
# output is rounded to bf16 (the dequantized reference is exact: codes times scales in float64).
DTYPES = [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)]
QUANTIZED = ["int8", "fp8_e4m3", "fp8_e5m2"]
# (format, model dtype, tolerance): a bf16 cache under a bf16 model is the plain cache, so bf16 under fp32 only
READ_CASES = [(n, d, t) for n in QUANTIZED for d, t in DTYPES] + [("bf16", torch.float32, 1e-4)]


def _ops():
    from runtime.engine.cuda.ops import TritonOps
    from runtime.engine.ops import get_ops

    ops = get_ops("cuda", torch.bfloat16)
    assert isinstance(ops, TritonOps)
    return ops


@pytest.mark.parametrize("name", cases.FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_store_quantizes_as_the_reference(name: str, dtype: torch.dtype, head_dim: int) -> None:
    cases.check_store(_ops(), "cuda", name, dtype, head_dim)


@pytest.mark.parametrize("name", cases.FORMATS)
def test_store_rounds_ties_and_saturates_as_torch(name: str) -> None:
    cases.check_store_rounding("cuda", name)


@pytest.mark.parametrize("name,dtype,tol", READ_CASES)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_decode_reads_the_quantized_pool(
    name: str, dtype: torch.dtype, tol: float, grouped: bool, cap: float | None
) -> None:
    cases.check_decode("cuda", name, dtype, grouped, tol, cap=cap, head_dim=128)


@pytest.mark.parametrize("name,dtype,tol", READ_CASES)
@pytest.mark.parametrize("cap,window", [(None, None), (5.0, 9), (None, 40)])
def test_extend_reads_the_quantized_prefix(
    name: str, dtype: torch.dtype, tol: float, cap: float | None, window: int | None
) -> None:
    cases.check_extend("cuda", name, dtype, tol, cap=cap, window=window, head_dim=128)


@pytest.mark.parametrize("kv", QUANTIZED)
def test_tiny_llama_with_cuda_graphs_matches_torch_native(tiny_llama_path: Path, kv: str) -> None:
    """fp32, prompts of equal length (see the interpreter test for why): the Triton backend decoding
    through captured CUDA graphs gives torch_native's greedy tokens on the same quantized cache."""
    from runtime.engine.model_runner import ModelRunner
    from tests.support.harness import Harness

    prompts = [list(range(3, 15)), list(range(20, 32)), list(range(40, 52))]
    outputs = {}
    for backend in ("torch_native", "triton"):
        runner = ModelRunner(
            tiny_llama_path,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            max_total_tokens=1024,
            max_running_requests=8,
            kv_cache_dtype=kv,
            load_progress=False,
            disable_cuda_graph=backend != "triton",
        )
        if backend == "triton":
            assert runner.graph_runner is not None and runner.graph_runner.replay_mode == "cuda"
        outputs[backend] = [r.output_ids for r in Harness(runner).generate(prompts, max_new_tokens=8)]
    assert outputs["triton"] == outputs["torch_native"]


run_compiled_when_interpreting(globals(), __file__)
