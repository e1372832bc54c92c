"""csrc/lora.c (``runtime.engine.cpu.lora_kernels``) against ``reference_lora_add``, at every build level
this CPU runs: fp32 within fp32 rounding, bf16 within one bf16 rounding of the exact sum.

The cases cover what the kernel splits its work by: runs of the base model (slot -1) between adapted
ones, adjacent runs of different slots, one slot in runs far apart, one-token runs and a long run
(shrink tiles of fewer than 4 tokens, expand steps of 1..4 tokens), P = 1..3 parts of uneven sizes
(expand blocks cut short at a part's end), ranks padded with zeros, R not a multiple of 8 (the
transpose's scalar remainder), K not a multiple of 32 (AVX512-BF16's masked last step) and rows
of ``x`` and ``out`` with strides wider than their width.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from runtime.engine.cpu import kernel_library, lora_kernels
from runtime.engine.cpu.ops import CpuOps
from runtime.engine.ops.lora import LoraSegments, LoraWeights, reference_lora_add

pytestmark = pytest.mark.usefixtures("kernel_level")  # every build this CPU runs (tests/conftest.py)

CPU = torch.device("cpu")


@dataclass
class Case:
    k: int
    parts: tuple[int, ...]  # output rows of each part
    rank: int
    slots: int
    lengths: list[int]  # the runs, in token order
    run_slots: list[int]


CASES = {
    "mixed": Case(100, (37, 5, 20), 8, 5, [3, 1, 1, 10, 5, 20, 2], [2, -1, 4, 0, 2, 1, -1]),
    "long_run": Case(77, (50, 43), 16, 3, [1, 300, 6], [1, 0, -1]),
    "one_part_all_slots": Case(64, (72,), 64, 8, [2, 3, 1, 4, 5, 1, 7, 2, 9], [7, 6, 5, 4, 3, 2, 1, 0, 7]),
    "one_token_runs": Case(96, (16, 3, 30), 12, 4, [1] * 13, [0, 1, 2, 3, 0, -1, 1, 2, 2, 3, 0, 1, 3]),
    "decode_shape": Case(576, (576, 192, 192), 16, 8, [8] * 8, list(range(8))),
}


def _make(
    case: Case, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, LoraWeights, LoraSegments]:
    """out and x with row strides wider than their rows, and each slot's adapter of its own rank
    (rows of a and columns of b past it zero, as the loader pads them)."""
    gen = torch.Generator().manual_seed(seed)
    tokens, n, parts = sum(case.lengths), sum(case.parts), len(case.parts)
    bounds = [0]
    for rows in case.parts:
        bounds.append(bounds[-1] + rows)
    a = torch.randn(case.slots, parts * case.rank, case.k, generator=gen)
    b = torch.randn(case.slots, n, case.rank, generator=gen) / case.rank
    for slot in range(case.slots):
        used = max(1, case.rank - 3 * slot)
        a.view(case.slots, parts, case.rank, case.k)[slot, :, used:] = 0
        b[slot, :, used:] = 0
    x = torch.randn(tokens, case.k + 5, generator=gen).to(dtype)[:, : case.k]
    out = torch.randn(tokens, n + 3, generator=gen).to(dtype)[:, :n]
    weights = LoraWeights(a=a.to(dtype), b=b.to(dtype), part_rows=tuple(bounds))
    return out, x, weights, LoraSegments.from_runs(case.lengths, case.run_slots, CPU)


def _exact(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> torch.Tensor:
    """The reference's sum in fp64 on the same (rounded) inputs."""
    exact = out.double()
    as64 = LoraWeights(a=weights.a.double(), b=weights.b.double(), part_rows=weights.part_rows)
    reference_lora_add(exact, x.double(), as64, segments)
    return exact


def _magnitude(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> torch.Tensor:
    """The exact sum of the terms' absolute values: what bounds the fp32 rounding error of a sum
    (a result near zero after cancellation keeps the error of its terms, not of its size)."""
    absolute = LoraWeights(a=weights.a.abs(), b=weights.b.abs(), part_rows=weights.part_rows)
    return _exact(out.abs(), x.abs(), absolute, segments)


def _bf16_ulp(values: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at ``values`` (8 significant bits)."""
    exponent = torch.frexp(values.abs().clamp_min(2.0**-126))[1]
    return torch.ldexp(torch.ones_like(values), exponent - 8)


def _check(got: torch.Tensor, out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
    expected = out.clone()
    reference_lora_add(expected, x, weights, segments)
    exact, fp32_error = _exact(out, x, weights, segments), 1e-5 * _magnitude(out, x, weights, segments)
    if out.dtype == torch.float32:
        assert bool(((got.double() - exact).abs() <= fp32_error).all())
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    else:
        # one bf16 rounding of the fp32 sum: within one spacing of the exact sum, plus what fp32
        # sums may be off (the reference's too)
        bound = _bf16_ulp(exact) + fp32_error
        assert bool(((got.double() - exact).abs() <= bound).all())
        assert bool(((expected.double() - exact).abs() <= bound).all())
    for start, end, slot in zip(segments.starts_cpu, segments.starts_cpu[1:], segments.slots_cpu):
        if slot < 0:
            assert torch.equal(got[start:end], out[start:end])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_reference(name: str, dtype: torch.dtype) -> None:
    out, x, weights, segments = _make(CASES[name], dtype)
    assert x.stride(0) != x.shape[1] and out.stride(0) != out.shape[1]
    got = out.clone()
    assert lora_kernels.lora_add(got, x, weights, segments)
    _check(got, out, x, weights, segments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_ops_lora_add_is_the_reference(dtype: torch.dtype) -> None:
    out, x, weights, segments = _make(CASES["mixed"], dtype, seed=3)
    got = out.clone()
    CpuOps().lora_add(got, x, weights, segments)
    _check(got, out, x, weights, segments)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_tokens_result_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each output's sums run in one order whatever tokens share the call (csrc/lora.c): a token
    alone gives the same bits as in a batch, where it shares tiles and chunks with others."""
    out, x, weights, segments = _make(CASES["mixed"], dtype, seed=5)
    batch = out.clone()
    assert lora_kernels.lora_add(batch, x, weights, segments)
    for token in (0, 4, 9, 30, 41):
        run = max(i for i, start in enumerate(segments.starts_cpu[:-1]) if start <= token)
        alone = out[token : token + 1].clone()
        one = LoraSegments.from_runs([1], [segments.slots_cpu[run]], CPU)
        assert lora_kernels.lora_add(alone, x[token : token + 1], weights, one)
        assert torch.equal(alone, batch[token : token + 1])


def test_runs_without_an_adapter_write_nothing() -> None:
    out, x, weights, _ = _make(CASES["mixed"], torch.float32)
    got = out.clone()
    assert lora_kernels.lora_add(got, x, weights, LoraSegments.from_runs([4, 38], [-1, -1], CPU))
    assert torch.equal(got, out)


def test_a_single_row_of_any_stride() -> None:
    """A one-token batch whose row views keep a stride torch left arbitrary."""
    out, x, weights, _ = _make(CASES["mixed"], torch.float32)
    segments = LoraSegments.from_runs([1], [3], CPU)
    row_x, row_out = x[5:6], out[7:8].clone()
    got = row_out.clone()
    assert lora_kernels.lora_add(got, row_x, weights, segments)
    _check(got, row_out, row_x, weights, segments)


@pytest.mark.parametrize(
    "lengths,run_slots,part_rows",
    [
        ([10, 33], [0, 5], None),  # slot == S
        ([10, 33], [0, 99], None),
        ([42], [0], (0, 37, 42, 60)),  # parts short of N
        ([42], [0], (0, 40, 30, 62)),  # parts out of order
    ],
    ids=["slot_S", "slot_99", "parts_short", "parts_unordered"],
)
def test_bad_arguments_are_refused_before_any_read(
    lengths: list[int], run_slots: list[int], part_rows: tuple[int, ...] | None
) -> None:
    out, x, weights, _ = _make(CASES["mixed"], torch.float32)
    if part_rows is not None:
        weights = LoraWeights(a=weights.a, b=weights.b, part_rows=part_rows)
    got = out.clone()
    with pytest.raises(ValueError):
        lora_kernels.lora_add(got, x, weights, LoraSegments.from_runs(lengths, run_slots, CPU))
    assert torch.equal(got, out)


def test_runs_past_the_batch_are_refused() -> None:
    out, x, weights, _ = _make(CASES["mixed"], torch.float32)
    starts = [0, 40, 44]  # the batch has 42 tokens
    segments = LoraSegments(
        starts=torch.tensor(starts, dtype=torch.int32),
        slots=torch.tensor([0, 1], dtype=torch.int32),
        starts_cpu=starts,
        slots_cpu=[0, 1],
    )
    got = out.clone()
    with pytest.raises(ValueError):
        lora_kernels.lora_add(got, x, weights, segments)
    assert torch.equal(got, out)


def test_where_it_does_not_apply_the_reference_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    out, x, weights, segments = _make(CASES["mixed"], torch.float32)
    expected = out.clone()
    reference_lora_add(expected, x, weights, segments)
    half = LoraWeights(a=weights.a.half(), b=weights.b.half(), part_rows=weights.part_rows)
    assert not lora_kernels.lora_add(out.half(), x.half(), half, segments)  # fp16: no CPU kernel
    strided_a = LoraWeights(
        a=weights.a.transpose(1, 2).contiguous().transpose(1, 2), b=weights.b, part_rows=weights.part_rows
    )
    assert not lora_kernels.lora_add(out.clone(), x, strided_a, segments)
    assert not lora_kernels.lora_add(out.clone(), x.t().contiguous().t(), weights, segments)  # columns apart
    got = out.clone()
    CpuOps().lora_add(got, x, strided_a, segments)
    torch.testing.assert_close(got, expected)
    monkeypatch.setattr(kernel_library, "load", lambda: None)  # kernels off
    got = out.clone()
    assert not lora_kernels.lora_add(got, x, weights, segments)
    assert torch.equal(got, out)
    CpuOps().lora_add(got, x, weights, segments)
    assert torch.equal(got, expected)
