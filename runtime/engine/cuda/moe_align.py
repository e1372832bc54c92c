"""Sorting a batch's (token, choice) pairs by local expert into blocks of ``BLOCK_M`` rows, on the device.

Why: the grouped GEMM of ``runtime.engine.cuda.moe_kernels`` gives each program ``BLOCK_M`` rows
that all belong to one expert, so that a program multiplies by one expert's weights only. Pair
``p = t * top_k + j`` is choice ``j`` of token ``t``; each expert's pairs are laid out one after the
other in ``sorted_ids``, and each expert's run is padded to a whole number of blocks with the
sentinel ``T * top_k`` (a row the GEMM masks out).

Why without a host sync: everything here is sized from ``T``, ``top_k``, the number of local
experts ``E`` and ``BLOCK_M`` alone, never from the routing itself, so a decode step that routes
through these kernels can be captured in a CUDA graph and replayed with other routings. At most
``min(E, T * top_k)`` experts have pairs, and each wastes at most ``BLOCK_M - 1`` rows, so
``T * top_k + min(E, T * top_k) * (BLOCK_M - 1)`` rows always suffice (the tighter of the two
bounds; ``T * top_k + E * (BLOCK_M - 1)`` is the textbook one, far larger in decode, where the
GEMMs' grids are sized from it). Blocks past the routing's padded total have expert -1 and the
GEMMs' programs for them return at once.

How: two launches of one program per local expert. The first counts the expert's pairs; the
second reads every expert's count (so each program knows where its run starts without a prefix
sum launched in between), writes its pairs in ascending pair order (a stable sort: the same
routing always gives the same layout) and marks its blocks. A choice whose expert is on another
rank (``expert_map`` gives -1, expert parallelism) or outside ``[0, E)`` matches no program and
lands in no block. The cost is ``E * T * top_k`` vectorised comparisons, spread over ``E`` programs:
small next to the GEMMs' ``T * top_k * 3 * H * I`` multiply-adds (not measured on a GPU yet).

Memory: the caller's ``topk_ids`` and ``expert_map`` are read only; the returned buffers are new.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from runtime.engine.cuda.triton_common import cdiv, check_launch, interpreter_requested, next_power_of_2


class MoeAlignment(NamedTuple):
    """Where each (token, choice) pair goes in the grouped GEMMs (all int32, on ``topk_ids``' device)."""

    sorted_ids: torch.Tensor  # [num_blocks * block_m]: pair t * top_k + j in expert order; padding = T * top_k
    expert_of_block: torch.Tensor  # [num_blocks]: the local expert of each block; -1 past the padded total
    num_tokens_post_padded: torch.Tensor  # [1]: rows in use (each local expert's pairs rounded up to blocks)
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound on the padded rows of any routing of ``num_pairs`` pairs over ``num_experts`` experts."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


@triton.jit
def _local_experts(TopkIds, ExpertMap, map_len, offs, mask, HAS_MAP: tl.constexpr):
    """The local expert of pairs ``offs`` (-1 where masked, remote, or an id outside the map)."""
    ids = tl.load(TopkIds + offs, mask=mask, other=-1)
    if HAS_MAP:
        known = mask & (ids >= 0) & (ids < map_len)
        ids = tl.load(ExpertMap + ids, mask=known, other=-1)
    return ids.to(tl.int32)


@triton.jit
def _count_kernel(TopkIds, ExpertMap, map_len, Counts, num_pairs, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    hits = tl.zeros([BLOCK], dtype=tl.int32)
    for p0 in range(0, num_pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        local = _local_experts(TopkIds, ExpertMap, map_len, offs, offs < num_pairs, HAS_MAP)
        hits += (local == expert).to(tl.int32)
    tl.store(Counts + expert, tl.sum(hits, axis=0))


@triton.jit
def _scatter_kernel(
    TopkIds,
    ExpertMap,
    map_len,
    Counts,  # [num_experts]: the count kernel's output
    SortedIds,  # [num_blocks * BLOCK_M], filled with the sentinel beforehand
    ExpertOfBlock,  # [num_blocks], filled with -1 beforehand
    NumPadded,  # [1]
    num_pairs,
    num_experts,
    HAS_MAP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    expert = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.load(Counts + experts, mask=experts < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(experts < expert, padded, 0), axis=0)
    own_blocks = tl.sum(tl.where(experts == expert, padded, 0), axis=0) // BLOCK_M
    if expert == 0:
        tl.store(NumPadded, tl.sum(padded, axis=0))
    for b0 in range(0, own_blocks, BLOCK):
        b = b0 + tl.arange(0, BLOCK)
        tl.store(ExpertOfBlock + start // BLOCK_M + b, tl.zeros([BLOCK], dtype=tl.int32) + expert, mask=b < own_blocks)
    dest = start
    for p0 in range(0, num_pairs, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        local = _local_experts(TopkIds, ExpertMap, map_len, offs, offs < num_pairs, HAS_MAP)
        hit = (local == expert).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1  # this pair's place among the expert's pairs in this chunk
        tl.store(SortedIds + dest + rank, offs.to(tl.int32), mask=hit > 0)
        dest += tl.sum(hit, axis=0)


def align_pairs_to_blocks(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, expert_map: torch.Tensor | None = None
) -> MoeAlignment:
    """Lay out the pairs of ``topk_ids [T, top_k]`` (expert ids, any integer dtype) by local expert
    in blocks of ``block_m`` rows for ``num_experts`` local experts.

    ``expert_map`` (int32 ``[E_global]``): global id -> local index, -1 for an expert on another
    rank; None: the ids are local indices. No host sync: the buffers' sizes depend only on the
    shapes and ``block_m`` (see the module docstring)."""
    num_pairs = topk_ids.numel()
    num_blocks = cdiv(max_padded_pairs(num_pairs, num_experts, block_m), block_m)
    device = topk_ids.device
    sorted_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    expert_of_block = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
    num_padded = torch.zeros(1, dtype=torch.int32, device=device)
    if num_pairs == 0 or num_experts == 0:
        return MoeAlignment(sorted_ids, expert_of_block, num_padded, block_m)
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    has_map = expert_map is not None
    if expert_map is not None and (expert_map.dtype != torch.int32 or expert_map.device != device):
        expert_map = expert_map.to(device=device, dtype=torch.int32)
    emap = expert_map if expert_map is not None else ids  # (not read without a map)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    check_launch(_count_kernel, ids, emap, counts, sorted_ids, expert_of_block, num_padded)
    block = min(64 if interpreter_requested() else 1024, max(16, next_power_of_2(num_pairs)))
    num_warps = max(1, min(8, block // 256))
    map_len = emap.numel()
    _count_kernel[(num_experts,)](
        ids, emap, map_len, counts, num_pairs, HAS_MAP=has_map, BLOCK=block, num_warps=num_warps
    )
    _scatter_kernel[(num_experts,)](
        ids,
        emap,
        map_len,
        counts,
        sorted_ids,
        expert_of_block,
        num_padded,
        num_pairs,
        num_experts,
        HAS_MAP=has_map,
        BLOCK_M=block_m,
        BLOCK=block,
        BLOCK_E=max(16, next_power_of_2(num_experts)),
        num_warps=num_warps,
    )
    return MoeAlignment(sorted_ids, expert_of_block, num_padded, block_m)
