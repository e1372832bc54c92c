"""The attention-backend interface shared by torch_native and triton.

A backend owns no KV memory: it writes each layer's new K/V into the
MHATokenToKVPool at ``batch.out_cache_loc`` and reads each request's cached
tokens through ``req_to_token[req_pool_indices[i], :seq_lens[i]]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from runtime.forward_batch import ForwardBatch


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5


class AttentionBackend(ABC):
    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan once per forward (indices, split counts); stored in ``batch.attn_metadata``."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """q ``[T, num_heads, head_dim]``, k/v ``[T, num_kv_heads, head_dim]`` for the T new tokens.

        Stores k/v at ``batch.out_cache_loc`` in layer ``layer.layer_id``, then returns the
        attention output ``[T, num_heads, head_dim]``: each new token attends causally to its
        request's prefix and to the new tokens up to itself.
        """
