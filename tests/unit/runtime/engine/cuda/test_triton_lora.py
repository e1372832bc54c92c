"""The multi-LoRA Triton kernels (``runtime.engine.cuda.lora_kernels``: the segmented shrink and
expand) against a per-token float64 loop and ``reference_lora_add``, on CPU under Triton's
interpreter, small shapes. The same checks run compiled at bigger shapes in bf16/fp16/fp32, with a
CUDA graph, in tests/gpu/test_triton_lora_gpu.py.

Triton picks interpreter or compiled mode when ``triton`` is first imported, so this module sets
``TRITON_INTERPRET=1`` before anything imports it (see tests/support/triton_interp.py).
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from runtime.engine.cuda.triton_common import triton_loaded_interpreted  # noqa: E402

IN_PROCESS = "triton" not in sys.modules or triton_loaded_interpreted()

from runtime.engine.cuda.lora_kernels import lora_add  # noqa: E402
from runtime.engine.cuda.ops import TritonOps  # noqa: E402
from runtime.engine.ops import TorchOps  # noqa: E402
from runtime.engine.ops.lora import LoraWeights, reference_lora_add  # noqa: E402
from tests.support.lora_cases import RUNS, check_lora_add, lora_case, plain_lora_add, segments  # noqa: E402
from tests.support.triton_interp import replace_tests_with_fresh_process_run  # noqa: E402

TOL = 1e-5  # fp32: reassociation only
# The interpreter rounds fp32 to bf16 by truncation (the GPU rounds to nearest): one bf16 step apart.
BF16_RTOL, BF16_ATOL = 2**-7, 1e-3
FP16_RTOL, FP16_ATOL = 2**-10, 1e-4

P1 = (0, 24)
P3 = (0, 20, 27, 36)  # q, k, v of uneven sizes (GQA)


def test_reference_is_the_plain_loop() -> None:
    case = lora_case(23, 40, P3, 12, seed=1)
    segs = segments(*RUNS["mixed"], "cpu")
    ref = case.out.clone()
    reference_lora_add(ref, case.x, case.weights, segs)
    torch.testing.assert_close(ref, plain_lora_add(case.out, case.x, case.weights, segs), rtol=1e-6, atol=1e-6)


# K = 40 (a masked depth step) or 64 (two even steps); R = 12 (not a multiple of 8), 16, 24 (two
# rank steps of 16, the second masked); P = 1 or 3 uneven parts.
@pytest.mark.parametrize("runs", sorted(RUNS))
@pytest.mark.parametrize("depth,rank,part_rows", [(40, 12, P3), (64, 16, P1), (40, 24, P1)])
def test_lora_add_matches_the_loop(runs: str, depth: int, rank: int, part_rows: tuple[int, ...]) -> None:
    lengths, slots = RUNS[runs]
    case = lora_case(sum(lengths), depth, part_rows, rank, seed=depth + rank)
    check_lora_add(lora_add, case, segments(lengths, slots, "cpu"), TOL, TOL)


def test_adjacent_runs_of_one_slot_and_untouched_padding_rows() -> None:
    """Two runs of the same slot back to back (not merged) give what one merged run gives; rows
    past the last run (a batch padded for a CUDA graph) are not touched."""
    case = lora_case(12, 40, P3, 8, seed=2)
    split = check_lora_add(lora_add, case, segments([3, 4, 2], [0, 0, 1], "cpu", merge=False), TOL, TOL)
    merged = check_lora_add(lora_add, case, segments([7, 2], [0, 1], "cpu"), TOL, TOL)
    assert torch.equal(split[:9], merged[:9])
    assert torch.equal(split[9:], case.out[9:])


def test_rank_padding_and_untargeted_parts_add_nothing_there() -> None:
    """Slot 2 does not target part 1 (zero rows of A and B): those output rows stay bit for bit;
    slot 1's padded ranks change nothing against the same adapter at its true rank."""
    case = lora_case(6, 40, P3, 16, seed=3)
    segs = segments([6], [2], "cpu")
    got = check_lora_add(lora_add, case, segs, TOL, TOL)
    assert torch.equal(got[:, 20:27], case.out[:, 20:27])
    assert not torch.equal(got[:, :20], case.out[:, :20])

    # slot 1 holds a rank-8 adapter padded to 16: the same product from an unpadded rank-8 table
    used = 8
    a1 = case.weights.a[1].view(3, 16, 40)[:, :used].reshape(1, 3 * used, 40)
    b1 = case.weights.b[1:2, :, :used]
    padded = case.out.clone()
    lora_add(padded, case.x, case.weights, segments([6], [1], "cpu"))
    exact = case.out.clone()
    lora_add(exact, case.x, LoraWeights(a1.contiguous(), b1.contiguous(), P3), segments([6], [0], "cpu"))
    torch.testing.assert_close(padded, exact, rtol=TOL, atol=TOL)


def test_x_with_a_row_stride_and_more_parts_than_one_launch_takes() -> None:
    """``x`` a view with rows ``K + 8`` apart; six parts (gate/up-like pairs and empties) go in two
    expand launches of at most four parts each."""
    case = lora_case(23, 40, P3, 12, seed=4, x_row_pad=8)
    assert case.x.stride(0) == 48
    check_lora_add(lora_add, case, segments(*RUNS["mixed"], "cpu"), TOL, TOL)
    six = lora_case(23, 40, (0, 5, 5, 17, 30, 33, 41), 8, seed=5)
    check_lora_add(lora_add, six, segments(*RUNS["mixed"], "cpu"), TOL, TOL)


@pytest.mark.parametrize(
    "dtype,rtol,atol", [(torch.bfloat16, BF16_RTOL, BF16_ATOL), (torch.float16, FP16_RTOL, FP16_ATOL)]
)
def test_half_precision_rounds_once(dtype: torch.dtype, rtol: float, atol: float) -> None:
    """bf16/fp16 inputs (fp32 math under the interpreter): one rounding of ``out + delta`` away from
    the float64 loop."""
    case = lora_case(23, 40, P3, 12, seed=6, dtype=dtype)
    check_lora_add(lora_add, case, segments(*RUNS["mixed"], "cpu"), rtol, atol)


def test_only_base_runs_and_empty_batches_leave_out_alone() -> None:
    case = lora_case(7, 40, P1, 8, seed=7)
    got = case.out.clone()
    lora_add(got, case.x, case.weights, segments([4, 3], [-1, -1], "cpu"))
    assert torch.equal(got, case.out)
    empty = lora_case(0, 40, P1, 8, seed=8)
    lora_add(empty.out, empty.x, empty.weights, segments([], [], "cpu"))
    assert empty.out.shape == (0, 24)


def test_inputs_that_do_not_fit_are_refused() -> None:
    case = lora_case(7, 40, P3, 8, seed=9)
    segs = segments([7], [0], "cpu")
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(case.out, case.x[:, :32], case.weights, segs)
    with pytest.raises(ValueError, match="part_rows"):
        lora_add(case.out, case.x, LoraWeights(case.weights.a, case.weights.b, (0, 20, 27, 30)), segs)
    with pytest.raises(ValueError, match="dtype"):
        lora_add(case.out.double(), case.x, case.weights, segs)
    with pytest.raises(ValueError, match="contiguous"):
        lora_add(case.out.t().contiguous().t(), case.x, case.weights, segs)
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(case.out, case.x, case.weights, segments([9], [0], "cpu"))


def test_triton_ops_runs_the_kernels_and_matches_torch_ops(monkeypatch: Any) -> None:
    from runtime.engine.cuda import lora_kernels

    calls = []
    real = lora_kernels.lora_add
    monkeypatch.setattr(lora_kernels, "lora_add", lambda *a: calls.append(1) or real(*a))
    case = lora_case(23, 40, P3, 12, seed=10)
    segs = segments(*RUNS["mixed"], "cpu")
    got, want = case.out.clone(), case.out.clone()
    TritonOps().lora_add(got, case.x, case.weights, segs)
    TorchOps().lora_add(want, case.x, case.weights, segs)
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


# aten ops that read a device value on the host (or size a result from values): each would sync on cuda
_SYNCING_OPS = {"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.masked_select", "aten.bincount"}
_SYNCING_OPS |= {"aten.unique", "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.repeat_interleave"}


def test_no_torch_op_reads_values_on_the_host() -> None:
    """A CPU stand-in for the GPU test's CUDA-graph capture: no torch op in ``lora_add`` turns a
    tensor's value into a host value (the run count and longest run come from the segments' host
    copies; the launches pass pointers and shapes only)."""
    case = lora_case(23, 40, P3, 12, seed=11)
    segs = segments(*RUNS["mixed"], "cpu")
    with _RecordOps() as seen:
        lora_add(case.out, case.x, case.weights, segs)
    assert "aten.empty" in seen.ops, seen.ops  # (the mode saw the wrapper's torch ops)
    assert not seen.ops & _SYNCING_OPS, seen.ops & _SYNCING_OPS


if not IN_PROCESS:
    replace_tests_with_fresh_process_run(globals(), __file__)
