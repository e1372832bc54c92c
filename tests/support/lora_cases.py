"""Multi-LoRA inputs and the plainest possible meaning of ``lora_add``, shared by the interpreter
tests (tests/unit/runtime/engine/cuda/test_triton_lora.py) and their compiled twins on a GPU
(tests/gpu/test_triton_lora_gpu.py); importing this module sets nothing up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from runtime.engine.ops.lora import LoraSegments, LoraWeights, reference_lora_add

LoraAdd = Callable[[torch.Tensor, torch.Tensor, LoraWeights, LoraSegments], None]

# name -> (run lengths, slots): how a batch's tokens may fall into adapter runs
RUNS: dict[str, tuple[list[int], list[int]]] = {
    # a single-token run, a base run between adapters, a run longer than a 16-row token block
    "mixed": ([3, 1, 17, 2], [1, -1, 0, 2]),
    # decode: adjacent single-token runs, every slot, a base token among them
    "decode": ([1, 1, 1, 1, 1, 1], [0, 2, -1, 1, 0, 2]),
    # base tokens first and last
    "base_edges": ([2, 5, 3], [-1, 1, -1]),
    # one long run over three token blocks
    "long": ([40], [2]),
}


@dataclass
class LoraCase:
    """One linear's LoRA inputs: ``out [T, N]`` as the base GEMM left it, ``x [T, K]``, the stacked weights."""

    out: torch.Tensor
    x: torch.Tensor
    weights: LoraWeights


def lora_case(
    tokens: int,
    depth: int,
    part_rows: tuple[int, ...],
    rank: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    slots: int = 3,
    x_row_pad: int = 0,
) -> LoraCase:
    """Random inputs scaled so ``x A^T`` and its expansion are O(1). Slot 1 is a rank-padded adapter
    (only its first ``rank // 2`` ranks are non-zero, the rest left zero as the slot table pads them);
    with more than one part, slot 2 does not target part 1 (its ``A`` and ``B`` rows there are zero).
    ``x_row_pad`` > 0 gives ``x`` rows ``depth + x_row_pad`` apart (a view into a wider tensor)."""
    gen = torch.Generator().manual_seed(seed)
    parts, rows = len(part_rows) - 1, part_rows[-1]
    wide = torch.randn(tokens, depth + x_row_pad, generator=gen)
    a = torch.randn(slots, parts * rank, depth, generator=gen) / max(1, depth) ** 0.5
    b = torch.randn(slots, rows, rank, generator=gen) / max(1, rank) ** 0.5
    used = rank // 2
    for p in range(parts):
        a[1, p * rank + used : (p + 1) * rank] = 0
    b[1, :, used:] = 0
    if parts > 1 and slots > 2:
        a[2, rank : 2 * rank] = 0
        b[2, part_rows[1] : part_rows[2]] = 0
    out = torch.randn(tokens, rows, generator=gen) * 2
    x = wide.to(device, dtype)[:, :depth]
    weights = LoraWeights(a=a.to(device, dtype), b=b.to(device, dtype), part_rows=part_rows)
    return LoraCase(out=out.to(device, dtype), x=x, weights=weights)


def segments(lengths: list[int], slots: list[int], device: str, merge: bool = True) -> LoraSegments:
    """Runs of ``lengths`` tokens using ``slots``; ``merge=False`` keeps adjacent runs of one slot apart."""
    if merge:
        return LoraSegments.from_runs(lengths, slots, torch.device(device))
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    return LoraSegments(
        starts=torch.tensor(starts, dtype=torch.int32, device=device),
        slots=torch.tensor(slots, dtype=torch.int32, device=device),
        starts_cpu=starts,
        slots_cpu=list(slots),
    )


def plain_lora_add(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segs: LoraSegments) -> torch.Tensor:
    """What ``lora_add`` leaves in ``out``, token by token in float64: its slot's ``x A^T``, then each
    part's rows ``h_part B_part^T``, added to ``out`` and rounded to its dtype (a new tensor)."""
    result = out.clone()
    rank, bounds = weights.rank, weights.part_rows
    for run, slot in enumerate(segs.slots_cpu):
        for t in range(segs.starts_cpu[run], segs.starts_cpu[run + 1]):
            if slot < 0:
                continue
            h = weights.a[slot].double() @ x[t].double()
            delta = torch.zeros(out.shape[1], dtype=torch.float64, device=out.device)
            for p in range(len(bounds) - 1):
                lo, hi = bounds[p], bounds[p + 1]
                delta[lo:hi] = weights.b[slot, lo:hi].double() @ h[p * rank : (p + 1) * rank]
            result[t] = (out[t].double() + delta).to(out.dtype)
    return result


def base_rows(segs: LoraSegments, tokens: int) -> list[int]:
    """Tokens nothing is added to: runs of slot -1, and rows past the last run."""
    rows = [t for run, slot in enumerate(segs.slots_cpu) if slot < 0 for t in range(*segs.starts_cpu[run : run + 2])]
    return rows + list(range(segs.starts_cpu[-1], tokens))


def check_lora_add(lora_add: LoraAdd, case: LoraCase, segs: LoraSegments, rtol: float, atol: float) -> torch.Tensor:
    """``lora_add`` on a copy of ``case.out``: within ``rtol``/``atol`` of the float64 loop and of
    ``reference_lora_add``, base rows left bit for bit, the inputs unchanged; returns the result."""
    x_before, a_before, b_before = case.x.clone(), case.weights.a.clone(), case.weights.b.clone()
    got = case.out.clone()
    lora_add(got, case.x, case.weights, segs)
    assert got.dtype == case.out.dtype and got.shape == case.out.shape
    want = plain_lora_add(case.out, case.x, case.weights, segs)
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)
    ref = case.out.clone()
    reference_lora_add(ref, case.x, case.weights, segs)
    torch.testing.assert_close(got.float(), ref.float(), rtol=rtol, atol=atol)
    base = base_rows(segs, case.out.shape[0])
    assert torch.equal(got[base], case.out[base]), "base tokens are left as they are"
    assert torch.equal(case.x, x_before) and torch.equal(case.weights.a, a_before)
    assert torch.equal(case.weights.b, b_before)
    return got
