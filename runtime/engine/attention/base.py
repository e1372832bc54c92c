"""The attention-backend interface shared by torch_native and triton.

A backend owns no KV memory: it writes each layer's new K/V into the
MHATokenToKVPool at ``batch.out_cache_loc`` and reads each request's cached
tokens through ``req_to_token[req_pool_indices[i], :seq_lens[i]]``.

A backend that can run inside a captured CUDA graph (``supports_cuda_graph``) splits
its decode planning in two, as SGLang does: at capture time the plan is made of views
of buffers allocated once (``init_cuda_graph_state``), so the captured kernels read
fixed addresses; at replay time the plan for the real batch is written into those same
buffers in place, outside the graph, before it is replayed.

An encoder's attention (BERT: ``forward_encoder``) is every backend's alike: each request's new
tokens attend to each other both ways, and the KV pool is neither read nor written (an encoder keeps
no KV), so it needs no plan and no pool: one SDPA call per group of requests of one length.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

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

    def forward_encoder(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        """An encoder layer's attention: q ``[T, num_heads, D]``, k/v ``[T, num_kv_heads, D]`` for the T
        new tokens -> ``[T, num_heads, D]``, each token attending to every new token of its own request
        (before and after it; never another request's). Nothing is read from or written to the KV pool,
        so a request's tokens must all be in this forward (none cached before it).

        Requests of equal length share one ``scaled_dot_product_attention`` call (``[n, heads, L, D]``,
        no mask); a request alone in its length reads its rows as views. KV heads are repeated for
        their query group (GQA) before the call."""
        if layer.sliding_window is not None or layer.logit_softcap is not None:
            raise NotImplementedError("encoder attention is full and plain: no window, no soft-cap")
        groups = batch.attn_metadata
        if not isinstance(groups, EncoderGroups):  # once per forward, shared by every layer
            groups = batch.attn_metadata = EncoderGroups.of(batch, q.device)
        group = layer.num_heads // layer.num_kv_heads
        out = q.new_empty(q.shape)
        for length, n, rows in groups.groups:
            qg, kg, vg = (_request_major(x, rows, n, length) for x in (q, k, v))
            if group > 1:
                kg, vg = kg.repeat_interleave(group, dim=1), vg.repeat_interleave(group, dim=1)
            attended = F.scaled_dot_product_attention(qg, kg, vg, scale=layer.scaling)  # [n, Hq, L, D]
            attended = attended.transpose(1, 2).reshape(n * length, layer.num_heads, -1)
            if isinstance(rows, slice):
                out[rows] = attended
            else:
                out.index_copy_(0, rows, attended)
        return out

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


@dataclass(frozen=True)
class EncoderGroups:
    """An encoder forward's requests by length (``AttentionBackend.forward_encoder``): for each length,
    how many requests have it and their packed rows (a slice for one request, else an index tensor),
    planned once per forward (``batch.attn_metadata``: an encoder's forward plans nothing else)."""

    groups: tuple[tuple[int, int, torch.Tensor | slice], ...]

    @staticmethod
    def of(batch: ForwardBatch, device: torch.device) -> "EncoderGroups":
        lens = list(batch.extend_lens_cpu) or [int(n) for n in batch.extend_lens.tolist()]
        prefix = list(batch.prefix_lens_cpu) or [int(n) for n in batch.prefix_lens.tolist()]
        if any(prefix):
            raise ValueError("an encoder attends within one forward: a request's tokens cannot follow a cached prefix")
        starts = [0, *itertools.accumulate(lens)][:-1]
        by_len: dict[int, list[int]] = {}
        for start, n in zip(starts, lens):
            by_len.setdefault(n, []).append(start)
        groups: list[tuple[int, int, torch.Tensor | slice]] = []
        for length, firsts in by_len.items():
            if len(firsts) == 1:
                groups.append((length, 1, slice(firsts[0], firsts[0] + length)))
            else:
                first = torch.tensor(firsts, dtype=torch.int64, device=device)
                groups.append((length, len(firsts), (first[:, None] + torch.arange(length, device=device)).reshape(-1)))
        return EncoderGroups(tuple(groups))


def _request_major(x: torch.Tensor, rows: torch.Tensor | slice, n: int, length: int) -> torch.Tensor:
    """The packed tokens ``rows`` of ``x [T, heads, D]`` (n requests of ``length`` tokens, back to
    back) as ``[n, heads, length, D]``: a view for a slice, one gather otherwise."""
    picked = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)
    return picked.view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)
