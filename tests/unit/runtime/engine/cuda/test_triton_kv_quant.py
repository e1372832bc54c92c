"""The Triton kernels over a quantized KV cache (int8, fp8_e4m3, fp8_e5m2, bf16 under fp32), on CPU
under Triton's interpreter: the store byte for byte against ``KVCacheFormat.quantize``, the decode and
extend kernels against float64 attention over the dequantized pool (the cases of
tests/support/kv_quant_cases.py, which tests/gpu/test_kv_quant_gpu.py runs compiled), and the tiny
Llama through the Triton backend against torch_native on the same quantized cache.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module sets
``TRITON_INTERPRET=1`` before anything imports it (see tests/support/triton_interp.py).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from runtime.engine.cuda.ops import TritonOps  # noqa: E402
from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402
from tests.support import kv_quant_cases as cases  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()
FP32 = torch.float32
TOL = 1e-5  # fp32 math on both sides of the comparison: reassociation only


@pytest.mark.parametrize("name", cases.FORMATS)
def test_store_quantizes_as_the_reference(name: str) -> None:
    cases.check_store(TritonOps(), "cpu", name, FP32, head_dim=48)


def test_store_quantizes_bf16_activations_to_int8() -> None:
    cases.check_store(TritonOps(), "cpu", "int8", torch.bfloat16, head_dim=64)


# The CUDA rule for the formats that divide (a bf16 store only rounds).
@pytest.mark.parametrize(
    "name,reciprocal", [(n, None) for n in cases.FORMATS] + [(n, True) for n in ("int8", "fp8_e4m3", "fp8_e5m2")]
)
def test_store_rounds_ties_and_saturates_as_torch(name: str, reciprocal: bool | None) -> None:
    """Every fp8 value, midpoint and neighbour; bf16 ties; int8 x.5 codes: torch's round half to even.
    The CUDA rule (a division as a multiply by the fp32 reciprocal) against torch's CUDA arithmetic."""
    cases.check_store_rounding("cpu", name, reciprocal)


def test_store_declines_what_it_cannot_write() -> None:
    """An int8 row whose values do not fill whole fp32 words cannot take its scale through the fp32
    view: the kernel declines and TritonOps stores through the reference."""
    from memory.kv_format import kv_cache_format
    from runtime.engine.cuda import kernels

    fmt = kv_cache_format("int8", FP32)
    buf = torch.zeros(4, 2, fmt.row_width(6), dtype=torch.int8)
    x = torch.randn(1, 2, 6)
    assert not kernels.store_kv(buf, buf.clone(), torch.tensor([1]), x, x, fmt)
    assert not kernels.store_kv(buf, buf.clone(), torch.tensor([1]), x[..., :5], x[..., :5], fmt)  # wrong D


@pytest.mark.parametrize("name", cases.FORMATS)
def test_decode_reads_the_quantized_pool(name: str) -> None:
    """Per-head (fp32 vector math) and grouped (dots; soft-capped) stage 1, split-K."""
    cases.check_decode("cpu", name, FP32, grouped=False, tol=TOL)
    cases.check_decode("cpu", name, FP32, grouped=True, tol=TOL, cap=5.0, seed=1)


@pytest.mark.parametrize(
    "name,cap,window", [("int8", None, None), ("fp8_e4m3", 5.0, None), ("fp8_e5m2", None, 9), ("bf16", 5.0, 9)]
)
def test_extend_reads_the_quantized_prefix(name: str, cap: float | None, window: int | None) -> None:
    cases.check_extend("cpu", name, FP32, tol=TOL, cap=cap, window=window)


def test_decode_with_head_dim_80_and_int8() -> None:
    """A padded block of dimensions: the row's scale is read after the 80 codes, not the block's 128."""
    cases.check_decode("cpu", "int8", FP32, grouped=True, tol=TOL, head_dim=80)


def test_tiny_llama_greedy_matches_torch_native_on_quantized_caches(tiny_llama_path: Path) -> None:
    """Through ModelRunner: the Triton backend's greedy tokens equal torch_native's on the same
    quantized cache (int8; fp8_e5m2, the coarsest), and decode through the CUDA-graph runner's planned
    replay (eager here) gives the same tokens. The prompts have different lengths (a padded extend
    group): both backends' new tokens attend to their stored values, whichever group they fall in."""
    from runtime.engine.cuda import graph_runner as cgr
    from runtime.engine.model_runner import ModelRunner
    from tests.support.harness import Harness

    prompts = [list(range(3, 15)), list(range(20, 41))]
    for kv in ("int8", "fp8_e5m2"):
        outputs = {}
        for backend in ("torch_native", "triton"):
            runner = ModelRunner(
                tiny_llama_path,
                device="cpu",
                dtype="float32",
                attention_backend=backend,
                max_total_tokens=256,
                kv_cache_dtype=kv,
                load_progress=False,
            )
            assert runner.token_to_kv_pool.format.name == kv
            outputs[backend] = [r.output_ids for r in Harness(runner).generate(prompts, max_new_tokens=4)]
        assert outputs["triton"] == outputs["torch_native"], kv
    graphs = cgr.setup_cuda_graphs(runner, batch_sizes=[2], replay="eager")
    assert graphs is not None
    runner.graph_runner = graphs
    assert [r.output_ids for r in Harness(runner).generate(prompts, max_new_tokens=4)] == outputs["triton"]


if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
