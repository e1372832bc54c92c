"""Attention over the paged KV pool with plain torch: the plan of ``runtime.engine.attention.plan``
plus SDPA.

Batched, not a loop per request per layer: ``init_forward_metadata`` plans once per forward
(requests packed into a few padded groups, see ``plan``), and each layer does at most one
gather from the pool and one SDPA call per group.

What the plan itself saves on every device:

- one-token groups fold the GQA group into the query axis (``[n, kv_heads, group, D]``
  against ``[n, kv_heads, L, D]``): every KV head's keys are read once for its whole
  query group;
- a layer with soft-capped logits (``AttentionLayerSpec.logit_softcap``) runs the same groups
  through ``runtime.engine.attention.softcap`` (explicit scores: SDPA cannot cap), every other
  layer through SDPA as before;
- keys are gathered with ``index_select`` on flattened slots (advanced indexing with a
  2-D index is ~20x slower on CPU);
- a group whose queries are a contiguous, unpadded run of the packed tokens reads and
  writes them as views (no query gather, no output scatter); when it also has no cached
  prefix, its keys are the new tokens themselves (no pool gather) and the mask is
  ``is_causal``.

The CPU backend (``runtime.engine.cpu.attention.CpuAttnBackend``, what the registry gives for
``torch_native`` on CPU) plans its own group type (``group_type``: a shared prompt prefix
attended once per group and a dense copy of the decode batch's keys) and a prefix cached by
every member of an extend group (``plan_cascade``: ``AttnGroup.shared_loc``), and runs each
group through the C kernels and GEMM paths; this module never touches either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from memory.kv_format import KVRows
from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.attention.plan import (
    AttnGroup,
    TorchNativeMetadata,
    common_cached_prefix,
    extend_outputs,
    host_list,
    one_token_group,
    pack_groups,
    packed_starts,
)
from runtime.engine.attention.softcap import softcapped_attention
from runtime.engine.attention.window_plan import plan_window_groups
from runtime.engine.forward_batch import ForwardBatch


class TorchNativeAttnBackend(AttentionBackend):
    """``model_runner`` (optional) supplies the device ops (``model_runner.ops``, for the KV
    store); without one they are those of the KV pool's device and dtype. Keeps no state
    between forwards."""

    # Plan a prefix shared by every member of a group as its own pass (only a backend that
    # can run that pass, the CPU one, turns this on).
    plan_cascade = False
    # The class of the groups this backend plans (a backend with fast paths of its own plans a
    # subclass carrying their fields; every group of its plans, windowed ones too, is one).
    group_type: type[AttnGroup] = AttnGroup
    # Extra KV bytes this backend may keep per byte of KV pool (the model runner sizes the
    # pool so that both fit in its memory budget).
    kv_copy_fraction = 0.0

    def __init__(self, model_runner: Any = None) -> None:
        self.model_runner = model_runner
        self._ops = getattr(model_runner, "ops", None)

    # ---- planning (once per forward) -------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = host_list(batch.seq_lens_cpu, batch.seq_lens)
        ext_lens = host_list(batch.extend_lens_cpu, batch.extend_lens)
        prefix_lens = host_list(batch.prefix_lens_cpu, batch.prefix_lens)
        bs = len(seq_lens)
        if batch.forward_mode.is_decode():
            groups = [self._decode_group(batch, list(range(bs)), seq_lens, in_order=True)]
        else:
            starts = packed_starts(ext_lens)
            ones = [i for i in range(bs) if ext_lens[i] == 1]
            multi = [i for i in range(bs) if ext_lens[i] != 1]
            groups = []
            if ones:
                in_order = len(ones) == bs
                groups.append(self._decode_group(batch, ones, seq_lens, in_order=in_order, starts=starts))
            for members in pack_groups(multi, ext_lens, seq_lens):
                groups.append(self._extend_group(batch, members, starts, ext_lens, prefix_lens, seq_lens, bs))
        batch.attn_metadata = TorchNativeMetadata(groups)

    def _kv_locations(
        self, batch: ForwardBatch, members: list[int], seq_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kv_loc [n, L], key_valid [n, L])`` read from req_to_token for the group's requests."""
        device = batch.req_pool_indices.device
        kv_len = max(seq_lens[i] for i in members)
        if len(members) == batch.req_pool_indices.shape[0] and members == list(range(len(members))):
            rows = batch.req_pool_indices
        else:
            rows = batch.req_pool_indices.index_select(0, torch.tensor(members, dtype=torch.int64, device=device))
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
        kv_loc, valid = self._kv_locations(batch, members, seq_lens)
        lens = [seq_lens[i] for i in members]
        return one_token_group(kv_loc, valid, min(lens) == max(lens), members, starts, in_order, self.group_type)

    def _extend_group(
        self,
        batch: ForwardBatch,
        members: list[int],
        starts: list[int],
        ext_lens: list[int],
        prefix_lens: list[int],
        seq_lens: list[int],
        bs: int,
    ) -> AttnGroup:
        device = batch.req_pool_indices.device
        kv_loc, _ = self._kv_locations(batch, members, seq_lens)
        # A prefix cached for every member (same slots) is attended once for all (cascade):
        # the rest of the plan then covers only the keys after it.
        shared_loc = common_cached_prefix(kv_loc, [prefix_lens[i] for i in members]) if self.plan_cascade else None
        p = 0 if shared_loc is None else int(shared_loc.numel())
        q_len = max(ext_lens[i] for i in members)
        n = len(members)
        unpadded = all(ext_lens[i] == q_len for i in members)
        contiguous = unpadded and all(starts[m] == starts[members[0]] + j * q_len for j, m in enumerate(members))
        no_prefix = all(prefix_lens[i] == p for i in members)
        ext = torch.tensor([ext_lens[i] for i in members], dtype=torch.int64, device=device)
        start = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        prefix = torch.tensor([prefix_lens[i] - p for i in members], dtype=torch.int64, device=device)
        qi = torch.arange(q_len, dtype=torch.int64, device=device)[None, :]  # [1, q_len]
        q_valid = qi < ext[:, None]  # [n, q_len]
        q_index = torch.where(q_valid, start[:, None] + qi, 0)
        q_start = starts[members[0]] if contiguous else None
        covers_all = contiguous and q_start == 0 and n * q_len == sum(ext_lens[:bs])
        if contiguous and no_prefix:
            # Keys (after any shared prefix) are exactly the group's new tokens: plain causal
            # attention over them, nothing to gather.
            out_tokens = None if covers_all else q_index.reshape(-1)
            out_rows = None if covers_all else torch.arange(n * q_len, device=device)
            return self.group_type(
                q_index, kv_loc, None, out_tokens, out_rows, q_start=q_start, keys_are_new=True, shared_loc=shared_loc
            )
        own_loc = kv_loc[:, p:]
        own_lens = torch.tensor([seq_lens[i] - p for i in members], dtype=torch.int64, device=device)
        kj = torch.arange(own_loc.shape[1], dtype=torch.int64, device=device)[None, :]
        valid = kj < own_lens[:, None]  # [n, kv_len]
        causal = kj[:, None, :] <= (prefix[:, None, None] + qi[:, :, None])  # [n, q_len, kv_len]
        mask = causal & valid[:, None, :]
        mask[:, :, 0] |= ~q_valid  # padded query rows see key 0 only, to stay finite
        out_tokens, out_rows = extend_outputs(q_index, q_valid, covers_all)
        return self.group_type(
            q_index,
            kv_loc,
            mask[:, None],
            out_tokens,
            out_rows,
            q_start=q_start,
            kv_flat=own_loc.masked_fill(~valid, 0).reshape(-1),
            shared_loc=shared_loc,
        )

    # ---- per layer -------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        self.store_kv(k, v, layer, batch)
        if not batch.forward_mode.is_decode():  # (a decode reads every key, its own too, from the pool)
            k, v = pool.stored_values(layer.layer_id, k, v)
        k_buf, v_buf = pool.kv_rows(layer.layer_id)
        meta: TorchNativeMetadata = batch.attn_metadata
        out: torch.Tensor | None = None
        for g in meta.groups if layer.sliding_window is None else self._window_groups(batch, layer.sliding_window):
            if g.one_token:
                og = self._one_token(q, k, v, k_buf, v_buf, layer, g)
            else:
                og = self._extend(q, k, v, k_buf, v_buf, layer, g)
            if g.out_tokens is None:
                return og  # this group produces every packed row, in order
            if out is None:
                out = q.new_empty(q.shape[0], layer.num_heads, layer.head_dim)
            assert g.out_rows is not None
            rows = og if g.shared_loc is not None else og.index_select(0, g.out_rows)  # cascade: real rows already
            out.index_copy_(0, g.out_tokens, rows)
        assert out is not None, "attention called on an empty batch"
        return out

    def _window_groups(self, batch: ForwardBatch, window: int) -> list[AttnGroup]:
        """The plan of the layers with this window (made once per forward, see ``window_plan``)."""
        meta: TorchNativeMetadata = batch.attn_metadata
        if window not in meta.windowed:
            meta.windowed[window] = plan_window_groups(
                batch,
                window,
                host_list(batch.seq_lens_cpu, batch.seq_lens),
                host_list(batch.extend_lens_cpu, batch.extend_lens),
                host_list(batch.prefix_lens_cpu, batch.prefix_lens),
                self.group_type,
            )
        return meta.windowed[window]

    @staticmethod
    def _group_queries(q: torch.Tensor, g: AttnGroup) -> torch.Tensor:
        """The group's padded queries ``[n * q_len, H, D]``: a view of the packed rows where they
        are a contiguous run, else gathered (padding reads row 0)."""
        if g.q_start is not None:
            return q[g.q_start : g.q_start + g.q_index.numel()]
        return q.index_select(0, g.q_index.view(-1))

    @staticmethod
    def _gather(rows: KVRows, flat_loc: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """``[n, Hkv, L, D]`` (a strided view) of the pool's values at ``flat_loc`` (``n * L`` slots) in
        ``dtype`` (a quantized cache's gathered rows dequantized: only those, never the whole cache)."""
        values = rows.gather(flat_loc, dtype)
        return values.view(n, -1, values.shape[1], values.shape[2]).transpose(1, 2)

    @classmethod
    def _folded_queries(cls, q: torch.Tensor, layer: AttentionLayerSpec, g: AttnGroup) -> torch.Tensor:
        """A one-token group's queries ``[n, Hkv, group, D]``: query head h uses KV head h // group."""
        hkv = layer.num_kv_heads
        return cls._group_queries(q, g).view(g.q_index.shape[0], hkv, layer.num_heads // hkv, layer.head_dim)

    def _one_token(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: KVRows,
        v_buf: KVRows,
        layer: AttentionLayerSpec,
        g: AttnGroup,
    ) -> torch.Tensor:
        """Rows ``[n, H, D]``: each member's single query against its keys, GQA folded."""
        qg = self._folded_queries(q, layer, g)
        n = qg.shape[0]
        assert g.kv_flat is not None
        kd, vd = self._gather(k_buf, g.kv_flat, n, qg.dtype), self._gather(v_buf, g.kv_flat, n, qg.dtype)
        if layer.logit_softcap is not None:  # (SDPA cannot cap: explicit scores, the fp32 key bias as it is)
            og, _ = softcapped_attention(qg, kd, vd, layer.scaling, layer.logit_softcap, mask=g.mask)
            return og.reshape(n, layer.num_heads, layer.head_dim)
        mask = None if g.mask is None else g.mask.to(qg.dtype)  # SDPA wants a float mask in q's dtype
        og = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask, scale=layer.scaling)
        return og.reshape(n, layer.num_heads, layer.head_dim)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: KVRows,
        v_buf: KVRows,
        layer: AttentionLayerSpec,
        g: AttnGroup,
    ) -> torch.Tensor:
        """Rows ``[n * q_len, H, D]`` of the padded group, request by request."""
        n, q_len = g.q_index.shape
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qg = self._group_queries(q, g).view(n, q_len, h, d).transpose(1, 2)  # [n, H, q_len, D]
        kg, vg = self._group_keys(k, v, k_buf, v_buf, layer, g)
        if layer.logit_softcap is not None:  # (SDPA cannot cap: explicit scores, the same mask)
            mask = None if g.keys_are_new else g.mask
            og, _ = softcapped_attention(
                qg, kg, vg, layer.scaling, layer.logit_softcap, mask=mask, is_causal=g.keys_are_new
            )
        elif g.keys_are_new:
            og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=layer.scaling, enable_gqa=h != hkv)
        else:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=layer.scaling, enable_gqa=h != hkv)
        return og.transpose(1, 2).reshape(n * q_len, h, d)

    def _group_keys(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: KVRows,
        v_buf: KVRows,
        layer: AttentionLayerSpec,
        g: AttnGroup,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An extend group's keys and values ``[n, Hkv, L, D]`` (after any shared prefix), in k's dtype:
        views of the new tokens when they are all there is, else gathered from the pool."""
        n, q_len = g.q_index.shape
        hkv, d = layer.num_kv_heads, layer.head_dim
        if g.keys_are_new:
            assert g.q_start is not None
            end = g.q_start + n * q_len
            kg = k[g.q_start : end].view(n, q_len, hkv, d).transpose(1, 2)
            vg = v[g.q_start : end].view(n, q_len, hkv, d).transpose(1, 2)
            return kg, vg
        assert g.kv_flat is not None
        return self._gather(k_buf, g.kv_flat, n, k.dtype), self._gather(v_buf, g.kv_flat, n, k.dtype)
