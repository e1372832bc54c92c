"""Attention over the paged KV pool with plain torch (SDPA): the default on CPU.

Batched, not a loop per request per layer. ``init_forward_metadata`` plans once per
forward: requests are packed into a few *groups*; within a group every request's queries
are padded to the group's longest extend and its keys to the group's longest sequence, so
each layer does one gather from the pool and one SDPA call per group:

- decode: one group holding every request (queries padded to 1, keys to the max seq len);
- extend / mixed: requests extending by one token (the decode part of a mixed batch) form
  one group; the others are grouped greedily, longest first, so that the padded work of a
  group stays within 2x its real work (a long prompt is never padded against many short
  ones). A typical prefill batch is a single group.

Masks are boolean (True = may attend): key ``j`` of a request is visible to its new token
``i`` when ``j < seq_len`` and ``j <= prefix_len + i``. Padded query rows may see key 0 so
no row is fully masked (which would give NaN); their outputs are discarded. Padded key
positions read the pool's padding slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.forward_batch import ForwardBatch

# Padded work below this many (query, key) pairs is always acceptable in one group.
_GROUP_SLACK = 1 << 16


@dataclass
class AttnGroup:
    """One padded SDPA call: ``n`` requests, ``q_len`` padded queries, ``kv_len`` padded keys."""

    q_index: torch.Tensor  # int64 [n, q_len]: packed-token row of each padded query (0 for padding)
    kv_loc: torch.Tensor  # int64 [n, kv_len]: KV-pool slot of each padded key (0 for padding)
    mask: torch.Tensor  # bool [n, 1, q_len, kv_len]
    out_tokens: torch.Tensor | None  # int64 [t]: packed rows this group produces; None = all rows in order
    out_rows: torch.Tensor | None  # int64 [t]: matching rows of the flattened [n * q_len] output


@dataclass
class TorchNativeMetadata:
    groups: list[AttnGroup]


class TorchNativeAttnBackend(AttentionBackend):
    """Stateless between forwards; ``model_runner`` is accepted for a uniform constructor."""

    def __init__(self, model_runner: Any = None) -> None:
        self.model_runner = model_runner

    # ---- planning (once per forward) -------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = _host_list(batch.seq_lens_cpu, batch.seq_lens)
        ext_lens = _host_list(batch.extend_lens_cpu, batch.extend_lens)
        prefix_lens = _host_list(batch.prefix_lens_cpu, batch.prefix_lens)
        bs = len(seq_lens)
        if batch.forward_mode.is_decode():
            groups = [self._decode_group(batch, list(range(bs)), seq_lens, in_order=True)]
        else:
            starts = [0] * bs
            for i in range(1, bs):
                starts[i] = starts[i - 1] + ext_lens[i - 1]
            ones = [i for i in range(bs) if ext_lens[i] == 1]
            multi = [i for i in range(bs) if ext_lens[i] != 1]
            groups = []
            if ones:
                groups.append(self._decode_group(batch, ones, seq_lens, in_order=False, starts=starts))
            for members in _pack_groups(multi, ext_lens, seq_lens):
                groups.append(self._extend_group(batch, members, starts, ext_lens, prefix_lens, seq_lens))
        batch.attn_metadata = TorchNativeMetadata(groups)

    def _kv_locations(self, batch: ForwardBatch, members: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_loc [n, L], key_valid [n, L])`` read from req_to_token for the group's requests."""
        device = batch.req_pool_indices.device
        kv_len = max(seq_lens[i] for i in members)
        idx = torch.tensor(members, dtype=torch.int64, device=device)
        rows = batch.req_pool_indices.index_select(0, idx)
        kv_loc = batch.req_to_token_pool.req_to_token[rows, :kv_len].to(torch.int64)
        lens = torch.tensor([seq_lens[i] for i in members], dtype=torch.int64, device=device)
        valid = torch.arange(kv_len, device=device)[None, :] < lens[:, None]
        return kv_loc.masked_fill_(~valid, 0), valid

    def _decode_group(
        self,
        batch: ForwardBatch,
        members: list[int],
        seq_lens: list[int],
        in_order: bool,
        starts: list[int] | None = None,
    ) -> AttnGroup:
        device = batch.req_pool_indices.device
        kv_loc, valid = self._kv_locations(batch, members, seq_lens)
        if in_order:
            q_index = torch.arange(len(members), dtype=torch.int64, device=device)[:, None]
            out_tokens = out_rows = None
        else:
            assert starts is not None
            tokens = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
            q_index = tokens[:, None]
            out_tokens = tokens
            out_rows = torch.arange(len(members), dtype=torch.int64, device=device)
        return AttnGroup(q_index, kv_loc, valid[:, None, None, :], out_tokens, out_rows)

    def _extend_group(
        self,
        batch: ForwardBatch,
        members: list[int],
        starts: list[int],
        ext_lens: list[int],
        prefix_lens: list[int],
        seq_lens: list[int],
    ) -> AttnGroup:
        device = batch.req_pool_indices.device
        kv_loc, valid = self._kv_locations(batch, members, seq_lens)
        q_len = max(ext_lens[i] for i in members)
        n = len(members)
        ext = torch.tensor([ext_lens[i] for i in members], dtype=torch.int64, device=device)
        start = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        prefix = torch.tensor([prefix_lens[i] for i in members], dtype=torch.int64, device=device)
        qi = torch.arange(q_len, dtype=torch.int64, device=device)[None, :]  # [1, q_len]
        q_valid = qi < ext[:, None]  # [n, q_len]
        q_index = torch.where(q_valid, start[:, None] + qi, 0)
        kj = torch.arange(kv_loc.shape[1], dtype=torch.int64, device=device)[None, None, :]
        causal = kj <= (prefix[:, None, None] + qi[:, :, None])  # [n, q_len, kv_len]
        mask = causal & valid[:, None, :]
        mask[:, :, 0] |= ~q_valid  # padded query rows see key 0 only, to stay finite
        out_tokens = q_index[q_valid]  # row-major: request by request, token by token
        out_rows = (torch.arange(n, device=device)[:, None] * q_len + qi).expand(n, q_len)[q_valid]
        return AttnGroup(q_index, kv_loc, mask[:, None], out_tokens, out_rows)

    # ---- per layer -------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        meta: TorchNativeMetadata = batch.attn_metadata
        gqa = layer.num_heads != layer.num_kv_heads
        out: torch.Tensor | None = None
        for g in meta.groups:
            n, q_len = g.q_index.shape
            qg = q[g.q_index].transpose(1, 2)  # [n, H, q_len, D]
            kg = k_buf[g.kv_loc].transpose(1, 2)  # [n, Hkv, kv_len, D]
            vg = v_buf[g.kv_loc].transpose(1, 2)
            og = F.scaled_dot_product_attention(
                qg, kg.to(qg.dtype), vg.to(qg.dtype), attn_mask=g.mask, scale=layer.scaling, enable_gqa=gqa
            )
            og = og.transpose(1, 2).reshape(n * q_len, layer.num_heads, layer.head_dim)
            if g.out_tokens is None:
                return og  # a single in-order decode group covers every token
            if out is None:
                out = q.new_empty(q.shape[0], layer.num_heads, layer.head_dim)
            out.index_copy_(0, g.out_tokens, og.index_select(0, g.out_rows))
        assert out is not None, "attention called on an empty batch"
        return out


def _host_list(cached: list[int], tensor: torch.Tensor) -> list[int]:
    """The batch's host copy when the builder filled it, else one device->host copy."""
    return list(cached) if len(cached) == int(tensor.shape[0]) else [int(x) for x in tensor.tolist()]


def _pack_groups(members: list[int], ext_lens: list[int], seq_lens: list[int]) -> list[list[int]]:
    """Greedy, longest sequence first: close a group when padding would more than double its work."""
    order = sorted(members, key=lambda i: (-seq_lens[i], -ext_lens[i]))
    groups: list[list[int]] = []
    current: list[int] = []
    real = max_q = max_k = 0
    for i in order:
        n_q, n_k = max(max_q, ext_lens[i]), max(max_k, seq_lens[i])
        new_real = real + ext_lens[i] * seq_lens[i]
        if current and (len(current) + 1) * n_q * n_k > 2 * new_real + _GROUP_SLACK:
            groups.append(current)
            current, real, n_q, n_k, new_real = [], 0, ext_lens[i], seq_lens[i], ext_lens[i] * seq_lens[i]
        current.append(i)
        real, max_q, max_k = new_real, n_q, n_k
    if current:
        groups.append(current)
    return groups
