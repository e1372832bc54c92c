"""Fused mixture-of-experts on cuda: every routed expert's gated MLP over its tokens in three
Triton launches (plus the routing's layout, ``runtime.engine.cuda.moe_align``), ``fused_experts``.

Why grouped GEMMs: an expert loop launches two matmuls per expert with a host-known token count
each, which needs the routing on the host (a sync per layer, no CUDA graph) and leaves the GPU
idle on the many tiny per-expert products of a decode step. Here the (token, choice) pairs are
first laid out by expert in blocks of ``BLOCK_M`` rows on the device; then one kernel, launched
over ``w13`` and then over ``w2``, gives each program one block (so one expert's weights) and one
tile of output columns. Its grid is sized from the shapes only, and programs of blocks past the
routing's padded total return at once: nothing waits on the host.

The steps, and where they round (where transformers' expert MLP rounds, so that the results
follow ``reference_experts`` to within fp32 reassociation):

1. ``gate_up[p] = x[t] @ w13[e].T`` for each pair ``p = t * top_k + j`` routed to local expert
   ``e``, fp32 accumulation, rounded to ``x``'s dtype (a linear's output);
2. ``hidden[p] = act(gate) * up`` with ``act``'s output rounded first (silu, or gelu with the tanh
   approximation) - a small kernel over the same blocks, so remote pairs and padding are skipped;
3. ``down[p] = hidden[p] @ w2[e].T`` rounded to the dtype, then times the routing weight
   (``MUL_ROUTED_WEIGHT``: the product in fp32, which is torch's for an fp32 weight and rounds the
   same as torch's for a model-dtype one), rounded again: one pair's contribution;
4. ``out[t] = sum_j down[t * top_k + j]``, summed in fp32 and rounded once (torch; ``top_k`` 1
   needs no sum). ``down`` starts zeroed, so pairs whose expert is on another rank add nothing.

Block sizes are a host-side function of the shapes (no autotuning: nothing is benchmarked while
a CUDA graph is captured); the GPU ones are reasonable defaults, not tuned per device.

Under Triton's interpreter (CPU tests, ``TRITON_INTERPRET=1``) everything is computed in fp32
with small blocks: the interpreter's numpy backend has no bf16 (``runtime.engine.cuda.triton_common``).

Memory per call: ``gate_up [T * top_k, 2I]``, ``hidden [T * top_k, I]`` and ``down [T * top_k, H]``
in the activations' dtype, the alignment's few int32 buffers, and the output ``[T, H]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from runtime.engine.cuda.moe_align import MoeAlignment, align_pairs_to_blocks
from runtime.engine.cuda.triton_common import (
    cdiv,
    check_launch,
    dot_precision,
    interpreter_requested,
    next_power_of_2,
    use_fp32_math,
)

# activation name -> the act-and-mul kernel's ACTIVATION ("swish" is silu's other name)
ACTIVATIONS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@dataclass(frozen=True)
class GemmBlocks:
    """One grouped GEMM's tile of output columns and depth step, and its launch shape."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeBlocks:
    """The blocks of one ``fused_experts`` call: rows per block are shared by both GEMMs (the
    alignment is made once for ``block_m``); each GEMM has its own columns and depth."""

    block_m: int
    up: GemmBlocks  # over w13: N = 2I, K = H
    down: GemmBlocks  # over w2: N = H, K = I
    block_i: int  # act-and-mul's columns per program


def _gemm_blocks(n: int, k: int, block_m: int, dtype: torch.dtype) -> GemmBlocks:
    if interpreter_requested():  # few, small programs: the interpreter pays per op, not per element
        return GemmBlocks(32, 32, 1, 1)
    wide = block_m >= 64
    block_n = min(128 if wide else 64, max(16, next_power_of_2(n)))
    # fp32 tiles take twice the shared memory per stage: a shorter step keeps three stages resident
    block_k = min(32 if dtype == torch.float32 else 64, max(16, next_power_of_2(k)))
    return GemmBlocks(block_n, block_k, 8 if wide and block_n >= 128 else 4, 3)


def moe_blocks(num_pairs: int, num_experts: int, hidden: int, inter: int, dtype: torch.dtype) -> MoeBlocks:
    """Blocks for ``num_pairs`` (token, choice) pairs over ``num_experts`` local experts.

    ``BLOCK_M`` follows the pairs an expert gets on average: 16 rows (tensor-core dots need 16) when
    a block would be mostly padding anyway, as in decode; 32 or 64 in prefill, where wider tiles
    reuse each weight tile over more rows."""
    if interpreter_requested():
        block_m = 16
    else:
        per_expert = num_pairs / max(1, num_experts)
        block_m = 16 if per_expert < 32 else 32 if per_expert < 96 else 64
    block_i = max(16, min(next_power_of_2(inter), (1024 if interpreter_requested() else 4096) // block_m))
    return MoeBlocks(
        block_m,
        _gemm_blocks(2 * inter, hidden, block_m, dtype),
        _gemm_blocks(hidden, inter, block_m, dtype),
        block_i,
    )


@triton.jit
def _grouped_gemm_kernel(
    A,  # [rows, K]: x [T, H] (ROWS_PER_TOKEN = top_k: pair p reads row p // top_k) or hidden [T*k, I] (1)
    a_stride,
    B,  # [E, N, K]: w13 or w2, one expert's [N, K] weight per leading index
    b_stride_e,
    b_stride_n,
    b_stride_k,
    C,  # [T * top_k, N]: row p is pair p's output
    c_stride,
    SortedIds,  # [num_blocks * BLOCK_M] int32 (moe_align)
    ExpertOfBlock,  # [num_blocks] int32
    Weights,  # [T * top_k] routing weights (read when MUL_ROUTED_WEIGHT)
    num_pairs,
    N,
    K,
    ROWS_PER_TOKEN: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP32_MATH: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(ExpertOfBlock + block)
    if expert < 0:  # past the routing's padded total: no work (the grid is sized for the worst case)
        return
    pairs = tl.load(SortedIds + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pairs < num_pairs  # padding holds the sentinel num_pairs
    a_rows = A + (pairs // ROWS_PER_TOKEN).to(tl.int64)[:, None] * a_stride
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_cols = B + expert.to(tl.int64) * b_stride_e + cols.to(tl.int64)[None, :] * b_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        depth = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_rows + depth[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(b_cols + depth[:, None] * b_stride_k, mask=col_ok[None, :], other=0.0)
        else:
            depth_ok = depth < K
            a = tl.load(a_rows + depth[None, :], mask=row_ok[:, None] & depth_ok[None, :], other=0.0)
            b = tl.load(b_cols + depth[:, None] * b_stride_k, mask=depth_ok[:, None] & col_ok[None, :], other=0.0)
        if FP32_MATH:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
    out = acc.to(C.dtype.element_ty)  # the projection's output in the model dtype, as a linear's
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(Weights + pairs, mask=row_ok, other=0.0)
        # the product in the weight's precision (fp32 weights: fp32; model-dtype weights: rounded by the cast)
        out = (out.to(tl.float32) * weight.to(tl.float32)[:, None]).to(C.dtype.element_ty)
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(C + pairs.to(tl.int64)[:, None] * c_stride + cols[None, :], out, mask=mask)


@triton.jit
def _act_and_mul_kernel(
    GateUp,  # [T * top_k, 2 * inter]: gate columns, then up columns
    gu_stride,
    Out,  # [T * top_k, inter]
    out_stride,
    SortedIds,
    ExpertOfBlock,
    num_pairs,
    inter,
    ACTIVATION: tl.constexpr,  # 0: silu; 1: gelu, tanh approximation
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    block = tl.program_id(0)
    if tl.load(ExpertOfBlock + block) < 0:
        return
    pairs = tl.load(SortedIds + block * BLOCK_M + tl.arange(0, BLOCK_M))
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (pairs < num_pairs)[:, None] & (cols < inter)[None, :]
    rows = pairs.to(tl.int64)[:, None]
    gate = tl.load(GateUp + rows * gu_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + rows * gu_stride + inter + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # 0.5 * g * (1 + tanh(u)) == g * sigmoid(2u): no tanh needed, and no cancellation near 0
        inner = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * inner))
    dtype = Out.dtype.element_ty
    act = act.to(dtype).to(tl.float32)  # the activation's output rounds before the product, as in torch
    tl.store(Out + rows * out_stride + cols[None, :], (act * up).to(dtype), mask=mask)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    align: MoeAlignment,
    blocks: GemmBlocks,
    rows_per_token: int,
    weights: torch.Tensor | None,
) -> None:
    """``out[p] = a[p // rows_per_token] @ w[expert of p].T`` (times ``weights[p]`` when given) for
    every pair in ``align``; rows of pairs in no block are not written."""
    n, k = w.shape[1], w.shape[2]
    num_blocks = align.expert_of_block.shape[0]
    check_launch(_grouped_gemm_kernel, a, w, out, align.sorted_ids, *(() if weights is None else (weights,)))
    grid = (num_blocks, cdiv(n, blocks.block_n))
    _grouped_gemm_kernel[grid](
        a,
        a.stride(0),
        w,
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out,
        out.stride(0),
        align.sorted_ids,
        align.expert_of_block,
        weights if weights is not None else out,
        out.shape[0],
        n,
        k,
        ROWS_PER_TOKEN=rows_per_token,
        MUL_ROUTED_WEIGHT=weights is not None,
        EVEN_K=k % blocks.block_k == 0,
        FP32_MATH=use_fp32_math(),
        PRECISION=dot_precision(a.dtype),
        BLOCK_M=align.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps,
        num_stages=blocks.num_stages,
    )


def _check_inputs(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    """Shape and dtype checks only (no values are read: that would sync)."""
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"fused_experts takes x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {x.shape}, {w13.shape}, {w2.shape}"
        )
    hidden, (num_experts, two_inter, w13_hidden) = x.shape[1], w13.shape
    if two_inter % 2 or w13_hidden != hidden or tuple(w2.shape) != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"expert weights do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"expert weights must be in x's dtype {x.dtype}; got {w13.dtype}, {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids / topk_weights must be [T, top_k]; got {topk_ids.shape}, {topk_weights.shape}")


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's routed experts' output for ``x [T, H]``, in ``x``'s dtype: for each token, the sum
    over its ``top_k`` choices whose expert is local of ``weight * down(act(gate) * up)``.

    ``w13 [E, 2I, H]``: each local expert's gate rows then up rows; ``w2 [E, H, I]``: its down
    projection, both in ``x``'s dtype. ``topk_weights [T, top_k]`` (fp32 or ``x``'s dtype) and
    ``topk_ids [T, top_k]`` (int64 global ids) are the router's. ``activation``: ``silu`` (or
    ``swish``) or ``gelu_pytorch_tanh``. ``expert_map`` (int32 ``[E_global]``): global id -> index
    into ``w13``/``w2``, -1 for an expert on another rank (whose choices add nothing), on ``x``'s
    device (a host map would be copied every call, which a CUDA graph cannot capture); None: the ids
    are local indices. No host sync, so a CUDA graph can capture it (see the module docstring)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"no fused expert activation {activation!r} (known: {sorted(ACTIVATIONS)})")
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    num_tokens, hidden = x.shape
    num_experts, top_k, inter = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or num_experts == 0 or inter == 0 or hidden == 0:
        return torch.zeros_like(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    blocks = moe_blocks(num_pairs, num_experts, hidden, inter, x.dtype)
    align = align_pairs_to_blocks(topk_ids, num_experts, blocks.block_m, expert_map)

    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, align, blocks.up, top_k, None)

    hidden_act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    check_launch(_act_and_mul_kernel, gate_up, hidden_act, align.sorted_ids)
    _act_and_mul_kernel[(align.expert_of_block.shape[0], cdiv(inter, blocks.block_i))](
        gate_up,
        gate_up.stride(0),
        hidden_act,
        hidden_act.stride(0),
        align.sorted_ids,
        align.expert_of_block,
        num_pairs,
        inter,
        ACTIVATION=ACTIVATIONS[activation],
        BLOCK_M=blocks.block_m,
        BLOCK_I=blocks.block_i,
        num_warps=4 if blocks.block_m * blocks.block_i >= 1024 else 1,
    )

    down = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)  # remote pairs stay zero
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    _grouped_gemm(hidden_act, w2, down, align, blocks.down, 1, weights)
    if top_k == 1:
        return down
    return down.view(num_tokens, top_k, hidden).sum(dim=1, dtype=torch.float32).to(x.dtype)


def _torch_activation(activation: str, gate: torch.Tensor) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(gate)
    if activation == "gelu_pytorch_tanh":
        return F.gelu(gate, approximate="tanh")
    raise ValueError(f"no fused expert activation {activation!r} (known: {sorted(ACTIVATIONS)})")


def reference_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_experts`` in plain torch, expert by expert (reads the routing on the host: for tests
    and comparisons, not for serving). Each choice's ``(down(act(gate) * up) * weight)`` is rounded
    to ``x``'s dtype, the choices are summed in fp32 and the sum rounded once, as the kernel does."""
    _check_inputs(x, w13, w2, topk_weights, topk_ids)
    inter = w2.shape[2]
    local = topk_ids.long()
    if expert_map is not None:
        emap = expert_map.to(device=x.device, dtype=torch.long)
        known = (local >= 0) & (local < emap.numel())
        local = torch.where(known, emap[local.clamp(0, emap.numel() - 1)], -1)
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(w13.shape[0]):
        tokens, choices = torch.nonzero(local == expert, as_tuple=True)
        if tokens.numel() == 0:
            continue
        gate_up = F.linear(x[tokens], w13[expert])
        hidden = _torch_activation(activation, gate_up[:, :inter]) * gate_up[:, inter:]
        contribution = F.linear(hidden, w2[expert]) * topk_weights[tokens, choices].unsqueeze(1)
        total.index_add_(0, tokens, contribution.to(x.dtype).float())
    return total.to(x.dtype)
