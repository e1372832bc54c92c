"""The attention-backend interface shared by torch_native and triton.

A backend owns no KV memory: it writes each layer's new K/V into the
MHATokenToKVPool at ``batch.out_cache_loc`` and reads each request's cached
tokens through ``req_to_token[req_pool_indices[i], :seq_lens[i]]``.

A backend that can run inside a captured CUDA graph (``supports_cuda_graph``) splits
its decode planning in two, as SGLang does: at capture time the plan is made of views
of buffers allocated once (``init_cuda_graph_state``), so the captured kernels read
fixed addresses; at replay time the plan for the real batch is written into those same
buffers in place, outside the graph, before it is replayed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.ops import DeviceOps, get_ops


@dataclass(frozen=True)
class AttentionLayerSpec:
    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    scaling: float  # softmax scale, usually head_dim ** -0.5
    # W: each query sees only keys at positions q - W < j <= q (a windowed layer); None: full attention.
    sliding_window: int | None = None
    # C: attention scores are soft-capped, ``C * tanh(score / C)`` after scaling and before the
    # mask and softmax (Gemma 2); None: plain scores.
    logit_softcap: float | None = None


class AttentionBackend(ABC):
    supports_cuda_graph: bool = False
    # The device ops that write K/V: the model runner's, else picked from the pool at first use.
    _ops: DeviceOps | None = None

    def __init__(self, model_runner: Any = None) -> None:
        """Every backend is built as ``cls(model_runner)`` (``runtime.engine.attention.registry``,
        SGLang's convention); a backend reads what it needs from the runner."""

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch) -> None:
        """Write the new tokens' K/V at ``batch.out_cache_loc`` of layer ``layer.layer_id``.

        A windowed layer of a pool that keeps those layers apart writes at the tokens' SWA
        slots (``translate_swa``: one small gather per layer, valid inside a CUDA graph too)."""
        pool = batch.token_to_kv_pool
        if self._ops is None:
            self._ops = getattr(getattr(self, "model_runner", None), "ops", None) or get_ops(pool.device, pool.dtype)
        loc = batch.out_cache_loc
        translate = getattr(pool, "translate_swa", None) if layer.sliding_window is not None else None
        if translate is not None:
            loc = translate(loc)
        self._ops.store_kv(pool, layer.layer_id, loc, k, v)

    def claim_decode_step(self, batch: ForwardBatch, num_layers: int) -> Any | None:
        """This decode (or verify) forward's decode-key mirror, for a device's whole-layer kernels that
        run all ``num_layers`` layers' KV writes and attention themselves (the CPU's one-call stack),
        or None: the backend keeps no such mirror (the base), or cannot hand this step over."""
        return None

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

    # ---- decode under CUDA graphs (runtime/engine/cuda/graph_runner.py) ----------------------

    def init_cuda_graph_state(self, max_bs: int, max_kv_tokens: int) -> None:
        """Allocate the fixed plan buffers: up to ``max_bs`` requests, ``max_kv_tokens`` KV slots in total."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Plan the static decode ``batch`` (of a captured size) as views of the fixed buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Rewrite, in place, the plan made at capture for ``batch``'s current contents."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
