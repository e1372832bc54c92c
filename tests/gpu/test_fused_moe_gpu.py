"""The fused mixture-of-experts Triton kernels compiled on a GPU, in bf16 / fp16 / fp32, against
``reference_experts`` (plain torch on the same GPU; test_triton_moe.py checks that reference
against a per-(token, choice) loop, and runs the same cases in fp32 under the interpreter), over
shapes that reach each of the row blocks (16, 32, 64), and captured in a CUDA graph: a capture
fails on any host sync, and the replays take routings the capture never saw.

Compiled Triton is needed here, so when this session set TRITON_INTERPRET=1 (the CPU kernel
tests do, for the whole process) the tests run in a fresh process without it.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support.moe_cases import expert_case
from tests.support.triton_interp import run_compiled_when_interpreting

DTYPES = [(torch.float32, 1e-4), (torch.float16, 5e-3), (torch.bfloat16, 4e-2)]
ACTIVATIONS = ["silu", "gelu_pytorch_tanh"]


def _moe() -> ModuleType:
    from runtime.engine.cuda import moe_kernels

    return moe_kernels


def _check(case: dict[str, Any], activation: str, tol: float, expert_map: torch.Tensor | None = None) -> torch.Tensor:
    moe = _moe()
    out = moe.fused_experts(**case, activation=activation, expert_map=expert_map)
    want = moe.reference_experts(**case, activation=activation, expert_map=expert_map)
    assert out.shape == case["x"].shape and out.dtype == case["x"].dtype
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    return out


SHAPES = [
    # tokens, experts, top_k, hidden, inter: decode-like (BLOCK_M 16), then 32 and 64 rows a block
    (1, 8, 2, 256, 128),
    (7, 16, 4, 384, 200),  # inter not a multiple of any block
    (600, 16, 2, 512, 256),
    (1024, 8, 2, 1024, 384),
]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", SHAPES)
def test_fused_experts_matches_reference(
    dtype: torch.dtype, tol: float, activation: str, tokens: int, experts: int, top_k: int, hidden: int, inter: int
) -> None:
    _check(expert_case(tokens, experts, top_k, hidden, inter, tokens + experts, dtype, device="cuda"), activation, tol)


def test_block_rows_follow_the_pairs_per_expert() -> None:
    moe = _moe()
    assert [moe.moe_blocks(t * k, e, 512, 256, torch.bfloat16).block_m for t, e, k, _, _ in SHAPES] == [16, 16, 32, 64]


@pytest.mark.parametrize("dtype,tol", DTYPES[1:])
def test_routing_weights_in_the_model_dtype(dtype: torch.dtype, tol: float) -> None:
    _check(expert_case(33, 8, 2, 256, 128, 3, dtype, weights_dtype=dtype, device="cuda"), "silu", tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_expert_parallel_ranks_add_up_to_one_rank(dtype: torch.dtype, tol: float) -> None:
    case = expert_case(65, 16, 4, 256, 128, 4, dtype, device="cuda")
    whole = _check(case, "silu", tol)
    parts = []
    for experts in (list(range(0, 16, 2)), list(range(1, 16, 2))):
        emap = torch.full((16,), -1, dtype=torch.int32, device="cuda")
        emap[experts] = torch.arange(len(experts), dtype=torch.int32, device="cuda")
        parts.append(_check(dict(case, w13=case["w13"][experts], w2=case["w2"][experts]), "silu", tol, emap))
    torch.testing.assert_close((parts[0].float() + parts[1].float()), whole.float(), atol=2 * tol, rtol=2 * tol)


def test_an_eager_call_never_syncs() -> None:
    moe = _moe()
    case = expert_case(17, 8, 2, 256, 128, 5, torch.bfloat16, device="cuda")
    emap = torch.arange(8, dtype=torch.int32, device="cuda")
    moe.fused_experts(**case, activation="silu", expert_map=emap)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe.fused_experts(**case, activation="silu", expert_map=emap)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_cuda_graph_replays_new_routings() -> None:
    """Capture one call, then replay it with new activations, routings (one expert taking every
    choice; half the experts remote) and weights: each replay equals an eager call and the reference."""
    moe = _moe()
    tokens, experts, top_k, hidden, inter = 8, 16, 4, 256, 128
    static = expert_case(tokens, experts, top_k, hidden, inter, 6, torch.bfloat16, device="cuda")
    emap = torch.arange(experts, dtype=torch.int32, device="cuda")
    call = dict(static, activation="silu", expert_map=emap)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        for _ in range(2):
            moe.fused_experts(**call)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_experts(**call)

    gen = torch.Generator().manual_seed(7)
    routings = [
        torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices,
        torch.tensor([3, 3, 3, 3]).expand(tokens, top_k),
        torch.randint(0, experts, (tokens, top_k), generator=gen),
    ]
    maps = [
        torch.arange(experts),
        torch.arange(experts),
        torch.where(torch.arange(experts) < 8, torch.arange(experts), -1),
    ]
    for ids, new_map in zip(routings, maps):
        static["x"].copy_(torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16))
        static["topk_ids"].copy_(ids.to("cuda"))
        static["topk_weights"].copy_(torch.rand(tokens, top_k, generator=gen).softmax(dim=1).to("cuda"))
        emap.copy_(new_map.to("cuda", torch.int32))
        graph.replay()
        eager = moe.fused_experts(**call)
        assert torch.equal(out, eager)  # the same kernels on the same rows: bit for bit
        want = moe.reference_experts(**call)
        torch.testing.assert_close(out.float(), want.float(), atol=4e-2, rtol=4e-2)


run_compiled_when_interpreting(globals(), __file__)
