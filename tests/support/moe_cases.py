"""Random fused-experts inputs shared by the interpreter tests (tests/unit/runtime/engine/cuda/test_triton_moe.py)
and their compiled twins on a GPU (tests/gpu/test_fused_moe_gpu.py)."""

from __future__ import annotations

from typing import Any

import torch


def expert_case(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    weights_dtype: torch.dtype = torch.float32,
    ids: torch.Tensor | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """``fused_experts``' tensor arguments: random activations and experts (scaled so every stage is
    O(1)); each token picks ``top_k`` distinct experts (or ``ids``), with softmax-like weights."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    if ids is None:
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, generator=gen).softmax(dim=1)
    return dict(
        x=x.to(device, dtype),
        w13=w13.to(device, dtype),
        w2=w2.to(device, dtype),
        topk_weights=weights.to(device, weights_dtype),
        topk_ids=ids.to(device, torch.int64),
    )
