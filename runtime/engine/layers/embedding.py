"""Vocab-parallel token embedding and LM head.

Each rank owns a contiguous block of ``ceil(vocab / tp_size)`` vocabulary rows (the last
block is zero-padded). The embedding looks up only ids in its block, zeroes the rest and
all-reduces; the LM head computes logits for its block and all-gathers them, then the
padding columns are cut off so callers always see exactly ``vocab_size`` logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.engine.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from runtime.engine.layers.linear import LazyWeight, check_shape, copy_into
from runtime.engine.ops import DeviceOps, default_ops
from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.quant.loading import PendingShards
from runtime.engine.quant.weight import KeptWeight


class VocabParallelEmbedding(nn.Module):
    weight: nn.Parameter | KeptWeight  # (kept quantized: see runtime.engine.quant.loading)

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        params_dtype: torch.dtype | None = None,
        ops: DeviceOps | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops or default_ops(params_dtype)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.rows_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        # blocks kept quantized (runtime.engine.quant.loading); the last rank's padding rows become zero blocks
        self.quant_shards = PendingShards()
        self.pads_rows = True
        self.tied_to: VocabParallelEmbedding | None = None  # (a tied LM head: the embedding whose weight it is)
        self.tied_head: ParallelLMHead | None = None  # (the LM head that shares this weight, if tied)

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = None) -> None:
        if self.tied_head is not None:
            self.tied_head.drop_plan()  # the head's plan read the old values
        check_shape(name, weight.shape, (self.vocab_size, self.hidden_size))
        n = max(self.vocab_end - self.vocab_start, 0)
        with torch.no_grad():
            param.data[n:].zero_()  # padding rows of the last block: never looked up, zero logits
        if n and not self.quant_shards.take(weight, 0, self.vocab_start, n, 0):
            copy_into(param.data[:n], weight.narrow(0, self.vocab_start, n), name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.ops.embedding(input_ids, self.weight, self.dtype)
        in_block = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_block, input_ids - self.vocab_start, 0)
        out = self.ops.embedding(local_ids, self.weight, self.dtype) * in_block.unsqueeze(-1).to(self.dtype)
        return tensor_model_parallel_all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding, LinearWeightLayer):
    """Output projection to the vocabulary; shares the embedding's weight when tied (then the
    embedding's loader drops this head's plan, which read the shared values)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (its loader fills it; any device copy of it is one for both,
        and so is its quantized form, ``runtime.engine.quant.loading``)."""
        self.weight = embedding.weight
        # references, not sub-modules (no second set of names)
        object.__setattr__(self, "tied_to", embedding)
        object.__setattr__(embedding, "tied_head", self)

    def weight_loader(self, param: nn.Parameter, weight: LazyWeight, name: str, shard_id: Any = None) -> None:
        self.drop_plan()  # (an untied head's own weight: its plan read the old values)
        super().weight_loader(param, weight, name, shard_id)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[n, hidden]`` in model dtype -> fp32 logits ``[n, vocab_size]``."""
        if self.tp_size == 1:  # (one rank: no padding rows, nothing to gather)
            return self.ops.float_linear(hidden, self.weight, self.plan)
        logits = self.ops.linear(hidden, self.weight, None, self.plan)
        logits = tensor_model_parallel_all_gather(logits, self.tp_size, dim=-1)
        return logits[:, : self.vocab_size].float()
