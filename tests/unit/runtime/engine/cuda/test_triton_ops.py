"""The device ops' Triton kernels (``runtime.engine.cuda.kernels`` through ``TritonOps``) against
the plain torch ops, on CPU under Triton's interpreter in fp32, plus a whole tiny model run
through them. The same cases run compiled in bf16/fp16/fp32 in test_triton_ops_gpu.py.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module
sets ``TRITON_INTERPRET=1`` before anything imports it (see tests/support/triton_interp.py).
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
from tests.support import ops_cases  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()
OPS = TritonOps()
FP32 = torch.float32
TOL = 1e-5


@pytest.mark.parametrize("hidden", [1, 37, 48, 80, 128, 257])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(hidden: int, residual: bool) -> None:
    ops_cases.check_rms_norm(OPS, "cpu", FP32, hidden, residual, TOL)


def test_rms_norm_on_strided_head_views() -> None:
    ops_cases.check_rms_norm_on_head_views(OPS, "cpu", FP32, TOL)


@pytest.mark.parametrize("head_dim,rotary_dim", [(48, 48), (80, 80), (128, 128), (128, 64)])
@pytest.mark.parametrize("llama3", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_rotary_in_place(head_dim: int, rotary_dim: int, llama3: bool, fused: bool) -> None:
    ops_cases.check_rotary(OPS, "cpu", FP32, head_dim, rotary_dim, llama3, fused, TOL)


@pytest.mark.parametrize("inter", [1, 37, 64, 1100])
def test_silu_and_mul(inter: int) -> None:
    ops_cases.check_silu_and_mul(OPS, "cpu", FP32, inter, TOL)


@pytest.mark.parametrize("head_dim", [48, 80, 128])
def test_store_kv(head_dim: int) -> None:
    ops_cases.check_store_kv(OPS, "cpu", FP32, head_dim)


def test_layouts_a_kernel_does_not_take_fall_back_to_torch() -> None:
    from runtime.engine.cuda import kernels as triton_kernels
    from runtime.engine.layers.rotary import RotaryEmbedding
    from runtime.engine.rope_config import RopeConfig

    assert triton_kernels.silu_and_mul(torch.randn(4, 9)) is None  # odd width
    cache = RotaryEmbedding(16, 32, RopeConfig(rope_type="default", theta=10000.0))
    positions = torch.tensor([0, 5, 31])
    q = torch.randn(3, 16, 2).transpose(1, 2)  # [3, 2, 16], dims not unit-stride
    k = torch.randn(3, 1, 16)
    assert not triton_kernels.rotary_(q, k, positions, cache.cos_cache, cache.sin_cache, 16)
    want_q, want_k = q.clone(), k.clone()
    ops_cases.REFERENCE.rotary_(want_q, want_k, ops_cases.REFERENCE.rope(cache, positions, FP32))
    OPS.rotary_(q, k, OPS.rope(cache, positions, FP32))  # through the torch op, still in place
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def test_whole_model_through_triton_ops_matches_torch_ops(tiny_checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 tiny Qwen3 (per-head q/k norm) and Llama 3 (llama3 rope, tied head): the same greedy
    tokens and logits through TritonOps as through TorchOps."""
    from runtime.engine import model_runner
    from runtime.engine.ops import TorchOps
    from tests.support.harness import Harness

    for name in ("qwen3", "llama_tied_llama3"):
        path: Path = tiny_checkpoints.path(name)
        outputs = []
        for ops in (TritonOps(), TorchOps()):
            monkeypatch.setattr(model_runner, "get_ops", lambda device, dtype, ops=ops: ops)
            runner = model_runner.ModelRunner(
                path, device="cpu", dtype="float32", max_total_tokens=512, load_progress=False
            )
            assert (
                runner.model.model.layers[0].mlp.gate_up_proj.ops is ops
            )  # (the gated activation runs through its ops)
            h = Harness(runner)
            prompts = [[3, 9, 27, 5, 11, 70][: 3 + i] for i in range(3)]
            outputs.append([(r.output_ids, r.logprobs) for r in h.generate(prompts, 5, return_logprob=True)])
        (tri, ref) = outputs
        assert [ids for ids, _ in tri] == [ids for ids, _ in ref], name
        for (_, lp_tri), (_, lp_ref) in zip(tri, ref):
            assert lp_tri == pytest.approx(lp_ref, abs=1e-4)


if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
