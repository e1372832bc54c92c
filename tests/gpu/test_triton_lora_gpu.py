"""The multi-LoRA Triton kernels (``runtime.engine.cuda.lora_kernels``) compiled on a GPU, in bf16 /
fp16 / fp32, against the per-token float64 loop and ``reference_lora_add`` on the same GPU (the
interpreter runs the same checks at small shapes in test_triton_lora.py), over shapes that reach each
token block (16, 32, 64 rows), and captured in a CUDA graph: a capture fails on any host sync, and
the replays take adapter runs the capture never saw.

Compiled Triton is needed here, so when this session set TRITON_INTERPRET=1 (the CPU kernel tests
do, for the whole process) the tests run in a fresh process without it.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.support.lora_cases import check_lora_add, lora_case, segments
from tests.support.triton_interp import run_compiled_when_interpreting

# One rounding of out + delta apart (the expand's tf32 products add ~2^-11 of delta for bf16).
DTYPES = [(torch.float32, 1e-4), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)]

SHAPES = [
    # depth, rank, part_rows
    (4096, 16, (0, 4096)),  # o_proj-like, one part
    (1024, 64, (0, 1024, 1280, 1536)),  # q/k/v of a GQA model
    (1000, 12, (0, 700, 900, 1100)),  # depth, rank and part sizes off every block
    (2048, 8, (0, 2816, 5632)),  # gate/up
]

RUNS = {
    # decode: 32 single-token runs, every slot and base tokens among them (16-row blocks)
    "decode": ([1] * 32, [i % 4 - 1 for i in range(32)]),
    # a short prefill mix: longest run 17 (32-row blocks)
    "mixed": ([3, 1, 17, 2, 9], [1, -1, 0, 2, 1]),
    # prefill: runs over many 64-row blocks, a base run and a single token between them
    "prefill": ([100, 3, 257, 1, 64], [0, -1, 1, 2, 0]),
}


def _lora() -> ModuleType:
    from runtime.engine.cuda import lora_kernels

    return lora_kernels


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("runs", sorted(RUNS))
@pytest.mark.parametrize("depth,rank,part_rows", SHAPES)
def test_lora_add_matches_the_loop(
    dtype: torch.dtype, tol: float, runs: str, depth: int, rank: int, part_rows: tuple[int, ...]
) -> None:
    lengths, slots = RUNS[runs]
    case = lora_case(sum(lengths), depth, part_rows, rank, seed=depth + rank, dtype=dtype, device="cuda", slots=4)
    check_lora_add(_lora().lora_add, case, segments(lengths, slots, "cuda"), tol, tol)


def test_block_rows_follow_the_longest_run() -> None:
    blocks = [_lora().lora_blocks(max(RUNS[r][0]), 192, 1024, 1536, 64, torch.bfloat16) for r in sorted(RUNS)]
    assert [b.block_m for b in blocks] == [16, 32, 64]


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_x_with_a_row_stride_adjacent_runs_of_one_slot_and_padding_rows(dtype: torch.dtype, tol: float) -> None:
    """``x`` a view with rows ``K + 64`` apart; two runs of one slot back to back; rows past the last
    run (a batch padded for a CUDA graph) untouched; six parts in two expand launches."""
    case = lora_case(200, 1024, (0, 1024, 1280, 1536), 32, seed=5, dtype=dtype, device="cuda", slots=4, x_row_pad=64)
    got = check_lora_add(_lora().lora_add, case, segments([70, 50, 40], [0, 0, 3], "cuda", merge=False), tol, tol)
    assert torch.equal(got[160:], case.out[160:])
    six = lora_case(150, 512, (0, 100, 100, 612, 1124, 1200, 1301), 16, seed=6, dtype=dtype, device="cuda")
    check_lora_add(_lora().lora_add, six, segments([40, 30, 80], [2, -1, 0], "cuda"), tol, tol)


def test_triton_ops_runs_the_kernels() -> None:
    from runtime.engine.cuda.ops import TritonOps
    from runtime.engine.ops import get_ops

    ops = get_ops("cuda", torch.bfloat16)
    assert isinstance(ops, TritonOps)
    case = lora_case(30, 1024, (0, 1024, 1280, 1536), 16, seed=7, dtype=torch.bfloat16, device="cuda")
    check_lora_add(ops.lora_add, case, segments(*RUNS["mixed"], "cuda"), 1.6e-2, 1.6e-2)


def test_an_eager_call_never_syncs() -> None:
    lora = _lora()
    case = lora_case(30, 1024, (0, 1024, 1280, 1536), 16, seed=8, dtype=torch.bfloat16, device="cuda")
    segs = segments(*RUNS["mixed"], "cuda")
    lora.lora_add(case.out.clone(), case.x, case.weights, segs)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lora.lora_add(case.out, case.x, case.weights, segs)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_cuda_graph_replays_new_runs() -> None:
    """Capture a decode-like call (8 runs of one token), then replay it with new activations, slots
    (base runs, one slot for all) and adapter weights: each replay equals an eager call bit for bit
    and follows the reference."""
    lora = _lora()
    tokens, depth, bounds, rank = 8, 1024, (0, 1024, 1280, 1536), 16
    case = lora_case(tokens, depth, bounds, rank, seed=9, dtype=torch.bfloat16, device="cuda", slots=4)
    segs = segments([1] * tokens, [0, 1, 2, 3, 0, 1, 2, 3], "cuda", merge=False)
    out = case.out.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm the allocator outside the capture
        for _ in range(2):
            lora.lora_add(out, case.x, case.weights, segs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora.lora_add(out, case.x, case.weights, segs)

    gen = torch.Generator().manual_seed(10)
    new_slots = [[3, -1, 3, -1, 0, 0, 2, 1], [2] * tokens, [-1] * tokens]
    for slots in new_slots:
        fresh = lora_case(tokens, depth, bounds, rank, seed=int(torch.randint(100, (1,), generator=gen)), slots=4)
        case.x.copy_(fresh.x.to("cuda", torch.bfloat16))
        case.weights.a.copy_(fresh.weights.a.to("cuda", torch.bfloat16))
        case.weights.b.copy_(fresh.weights.b.to("cuda", torch.bfloat16))
        base = fresh.out.to("cuda", torch.bfloat16)
        segs.slots.copy_(torch.tensor(slots, dtype=torch.int32))
        segs.slots_cpu[:] = slots  # (the eager call and the reference read the host copy)
        out.copy_(base)
        graph.replay()
        eager = base.clone()
        lora.lora_add(eager, case.x, case.weights, segs)
        assert torch.equal(out, eager)  # the same kernels on the same rows: bit for bit
        case.out = base
        check_lora_add(lora.lora_add, case, segs, 1.6e-2, 1.6e-2)


run_compiled_when_interpreting(globals(), __file__)
