"""What the device's LoRA kernels read: one linear's stacked adapter weights and one forward's adapter runs.

Multi-LoRA serving (``runtime.engine.lora``) keeps every adapter a batch may use in one of ``S`` slots;
each linear an adapter targets holds the slots' low-rank matrices stacked (``LoraWeights``), and
each forward says which runs of its packed tokens use which slot (``LoraSegments``). The base
GEMM runs once for every token; ``DeviceOps.lora_add`` then adds, per run, its adapter's
``scaling * (x A^T) B^T`` (S-LoRA / Punica's "shrink" and "expand", SGLang's segmented kernels).

A linear merges several checkpoint projections (q/k/v, gate/up): their adapters' ``A`` matrices
share one shrink (the same input) and each ``B`` expands into its own rows of the output
(``part_rows``). A checkpoint that stores a merged projection fused (Phi-3's ``qkv_proj``) has one
part over all rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass
class LoraWeights:
    """One linear's adapters, slot by slot (this TP rank's shard, in the model's dtype).

    ``a``: ``[S, P * R, K]``: slot ``s``'s shrink matrices of the linear's ``P`` parts, part ``p``
    at rows ``p * R : (p + 1) * R`` (an adapter of rank ``r < R``, or one that does not target a
    part, leaves the other rows zero). ``b``: ``[S, N, R]``: slot ``s``'s expand matrices, the
    scaling (``alpha / r``, or rsLoRA's ``alpha / sqrt(r)``) folded in; output row ``n`` of part ``p``
    reads the shrink's rows of part ``p``. ``part_rows``: the ``P + 1`` boundaries of the parts in
    the output's ``N`` rows (this rank's local rows)."""

    a: torch.Tensor
    b: torch.Tensor
    part_rows: tuple[int, ...]

    @property
    def rank(self) -> int:
        """``R``: the rank every slot is padded to."""
        return int(self.b.shape[2])

    @property
    def num_parts(self) -> int:
        return len(self.part_rows) - 1


@dataclass
class LoraSegments:
    """Which runs of one forward's packed tokens use which adapter slot.

    Run ``i`` is tokens ``starts[i] : starts[i + 1]`` and uses slot ``slots[i]``; a slot of -1 is
    the base model (nothing added). Runs are in token order, back to back, and cover the batch's
    tokens. Device tensors for the kernels, host copies for planning without a sync."""

    starts: torch.Tensor  # int32 [n + 1] on the model's device
    slots: torch.Tensor  # int32 [n]
    starts_cpu: list[int]
    slots_cpu: list[int]

    @functools.cached_property
    def max_len(self) -> int:
        """The longest run that uses an adapter (0: none does); once per forward, not per linear."""
        lens = [e - s for s, e, slot in zip(self.starts_cpu, self.starts_cpu[1:], self.slots_cpu) if slot >= 0]
        return max(lens, default=0)

    @functools.cached_property
    def any_adapter(self) -> bool:
        return any(slot >= 0 for slot in self.slots_cpu)

    @classmethod
    def from_runs(cls, lengths: list[int], slots: list[int], device: torch.device) -> "LoraSegments":
        """Runs of ``lengths`` tokens using ``slots``, adjacent runs of one slot merged."""
        starts: list[int] = [0]
        merged: list[int] = []
        for length, slot in zip(lengths, slots):
            if length == 0:
                continue
            if merged and merged[-1] == slot:
                starts[-1] += length
            else:
                merged.append(slot)
                starts.append(starts[-1] + length)
        return cls(
            starts=torch.tensor(starts, dtype=torch.int32, device=device),
            slots=torch.tensor(merged, dtype=torch.int32, device=device),
            starts_cpu=starts,
            slots_cpu=merged,
        )


def reference_lora_add(out: torch.Tensor, x: torch.Tensor, weights: LoraWeights, segments: LoraSegments) -> None:
    """``DeviceOps.lora_add``'s plain torch meaning: per run with a slot, ``out[run] += (x[run] a_s^T)``
    expanded part by part with ``b_s`` (the shrink in fp32, the sum rounded to ``out``'s dtype)."""
    rank = weights.rank
    bounds = weights.part_rows
    for start, end, slot in zip(segments.starts_cpu, segments.starts_cpu[1:], segments.slots_cpu):
        if slot < 0 or end == start:
            continue
        shrunk = x[start:end].float() @ weights.a[slot].float().t()  # [L, P * R]
        delta = torch.empty(end - start, out.shape[1], dtype=torch.float32, device=out.device)
        for part in range(weights.num_parts):
            lo, hi = bounds[part], bounds[part + 1]
            delta[:, lo:hi] = shrunk[:, part * rank : (part + 1) * rank] @ weights.b[slot, lo:hi].float().t()
        out[start:end] = (out[start:end].float() + delta).to(out.dtype)


class LoraContext:
    """What every adapted linear of one model reads during a forward: the forward's runs, set only where
    some token uses an adapter (None: the linears add nothing). Set by the model runner's LoRA manager
    before each forward, on the thread that runs it."""

    def __init__(self) -> None:
        self.segments: LoraSegments | None = None


@dataclass
class LinearLora:
    """A linear's adapter slots and the model's shared context (``LinearBase.lora``)."""

    weights: LoraWeights
    context: LoraContext

    def active(self) -> LoraSegments | None:
        """This forward's runs where some token uses an adapter, else None (the manager sets none for a
        forward whose tokens all run on the base model)."""
        return self.context.segments
