"""Attention over the paged KV pool with plain torch: planning plus SDPA.

Batched, not a loop per request per layer. ``init_forward_metadata`` plans once per
forward: requests are packed into a few *groups*; within a group every request's queries
are padded to the group's longest extend and its keys to the group's longest sequence, so
each layer does (at most) one gather from the pool and one SDPA call per group:

- decode: one group holding every request (queries padded to 1, keys to the max seq len);
- extend / mixed: requests extending by one token (the decode part of a mixed batch) form
  one group; the others are grouped greedily, longest first, so that the padded work of a
  group stays within 2x its real work (a long prompt is never padded against many short
  ones). A typical prefill batch is a single group.

Masks are boolean (True = may attend): key ``j`` of a request is visible to its new token
``i`` when ``j < seq_len`` and ``j <= prefix_len + i``. Padded query rows may see key 0 so
no row is fully masked (which would give NaN); their outputs are discarded. Padded key
positions read the pool's padding slot 0.

What the plan itself saves on every device:

- one-token groups fold the GQA group into the query axis (``[n, kv_heads, group, D]``
  against ``[n, kv_heads, L, D]``): every KV head's keys are read once for its whole
  query group;
- keys are gathered with ``index_select`` on flattened slots (advanced indexing with a
  2-D index is ~20x slower on CPU);
- a group whose queries are a contiguous, unpadded run of the packed tokens reads and
  writes them as views (no query gather, no output scatter); when it also has no cached
  prefix, its keys are the new tokens themselves (no pool gather) and the mask is
  ``is_causal``.

The CPU backend (``runtime.cpu.attention.CpuAttnBackend``, what the registry gives
for ``torch_native`` on CPU) extends this plan with a shared prompt prefix attended once
per group (``plan_cascade``: ``SharedPrefix`` and ``AttnGroup.shared_loc``) and a dense
copy of the decode batch's keys, and runs each group through the C kernels and GEMM
paths; this module never touches either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from runtime.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.forward_batch import ForwardBatch

# Padded work below this many (query, key) pairs is always acceptable in one group.
_GROUP_SLACK = 1 << 16
# A shared prefix shorter than this is not worth a separate cascade pass.
CASCADE_MIN_PREFIX = 32


@dataclass
class SharedPrefix:
    """Cascade plan of a one-token group: ``loc`` keys common to every member, then each one's own."""

    loc: torch.Tensor  # int64 [P]: KV slots of the shared prefix
    suffix_loc: torch.Tensor  # int64 [n * Ls]: each member's remaining slots, padded with slot 0
    suffix_len: int  # Ls
    suffix_mask: torch.Tensor | None  # fp32 key bias [n, 1, 1, Ls] (key_bias; None: no padding)


@dataclass
class AttnGroup:
    """One padded SDPA call: ``n`` requests, ``q_len`` padded queries, ``kv_len`` padded keys."""

    q_index: torch.Tensor  # int64 [n, q_len]: packed-token row of each padded query (0 for padding)
    kv_loc: torch.Tensor  # int64 [n, kv_len]: KV-pool slot of each padded key (0 for padding)
    mask: torch.Tensor | None  # bool [n, 1, q_len, kv_len] (one-token groups: fp32 key bias [n, 1, 1, kv_len], key_bias); None: no mask
    out_tokens: torch.Tensor | None  # int64 [t]: packed rows this group produces; None = all rows in order
    out_rows: torch.Tensor | None  # int64 [t]: matching rows of the flattened [n * q_len] output
    one_token: bool = False  # every member has exactly one query: GQA folded into the query axis
    q_start: int | None = None  # queries are packed rows [q_start, q_start + n * q_len), unpadded
    kv_flat: torch.Tensor | None = None  # int64 [n * kv_len]: kv_loc flattened for index_select
    keys_are_new: bool = False  # no cached prefix, no padding: K/V are the new tokens (causal)
    shared: SharedPrefix | None = None  # cascade plan (one-token groups, plan_cascade only)
    # The CPU backend's dense-key plan (runtime.cpu.decode_mirror.MirrorPlan; pure decode batches).
    mirror: Any = None
    # Extend groups (plan_cascade only): int64 [P] slots of a prefix every member has cached
    # (attended once, then merged); the rest of the plan (mask, kv_flat) covers the keys after it.
    shared_loc: torch.Tensor | None = None


@dataclass
class TorchNativeMetadata:
    groups: list[AttnGroup]
    # Windowed layers' plans by window, made when the first such layer runs (window_plan).
    windowed: dict[int, list[AttnGroup]] = field(default_factory=dict)


class TorchNativeAttnBackend(AttentionBackend):
    """``model_runner`` (optional) supplies the device ops (``model_runner.ops``, for the KV
    store); without one they are those of the KV pool's device and dtype. Keeps no state
    between forwards."""

    # Plan a prefix shared by every member of a group as its own pass (only a backend that
    # can run that pass, the CPU one, turns this on).
    plan_cascade = False
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
            for members in _pack_groups(multi, ext_lens, seq_lens):
                groups.append(self._extend_group(batch, members, starts, ext_lens, prefix_lens, seq_lens, bs))
        batch.attn_metadata = TorchNativeMetadata(groups)

    def _kv_locations(self, batch: ForwardBatch, members: list[int], seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
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
        group = one_token_group(kv_loc, valid, min(lens) == max(lens), members, starts, in_order)
        if self.plan_cascade:
            group.shared = _plan_shared_prefix(kv_loc, lens)
        return group

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
        shared_loc = _common_cached_prefix(kv_loc, [prefix_lens[i] for i in members]) if self.plan_cascade else None
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
            return AttnGroup(q_index, kv_loc, None, out_tokens, out_rows, q_start=q_start, keys_are_new=True,
                             shared_loc=shared_loc)
        own_loc = kv_loc[:, p:]
        own_lens = torch.tensor([seq_lens[i] - p for i in members], dtype=torch.int64, device=device)
        kj = torch.arange(own_loc.shape[1], dtype=torch.int64, device=device)[None, :]
        valid = kj < own_lens[:, None]  # [n, kv_len]
        causal = kj[:, None, :] <= (prefix[:, None, None] + qi[:, :, None])  # [n, q_len, kv_len]
        mask = causal & valid[:, None, :]
        mask[:, :, 0] |= ~q_valid  # padded query rows see key 0 only, to stay finite
        out_tokens, out_rows = extend_outputs(q_index, q_valid, covers_all)
        return AttnGroup(q_index, kv_loc, mask[:, None], out_tokens, out_rows, q_start=q_start,
                         kv_flat=own_loc.masked_fill(~valid, 0).reshape(-1), shared_loc=shared_loc)

    # ---- per layer -------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        self.store_kv(k, v, layer, batch)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
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

    @staticmethod
    def _window_groups(batch: ForwardBatch, window: int) -> list[AttnGroup]:
        """The plan of the layers with this window (made once per forward, see ``window_plan``)."""
        meta: TorchNativeMetadata = batch.attn_metadata
        if window not in meta.windowed:
            from runtime.attention.window_plan import plan_window_groups

            meta.windowed[window] = plan_window_groups(
                batch, window, host_list(batch.seq_lens_cpu, batch.seq_lens),
                host_list(batch.extend_lens_cpu, batch.extend_lens), host_list(batch.prefix_lens_cpu, batch.prefix_lens),
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
    def _gather(buf: torch.Tensor, flat_loc: torch.Tensor, n: int) -> torch.Tensor:
        """``[n, Hkv, L, D]`` (a strided view) of the pool rows at ``flat_loc`` (``n * L`` slots)."""
        return buf.index_select(0, flat_loc).view(n, -1, buf.shape[1], buf.shape[2]).transpose(1, 2)

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
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: AttentionLayerSpec,
        g: AttnGroup,
    ) -> torch.Tensor:
        """Rows ``[n, H, D]``: each member's single query against its keys, GQA folded."""
        qg = self._folded_queries(q, layer, g)
        n = qg.shape[0]
        assert g.kv_flat is not None
        kd, vd = self._gather(k_buf, g.kv_flat, n).to(qg.dtype), self._gather(v_buf, g.kv_flat, n).to(qg.dtype)
        mask = None if g.mask is None else g.mask.to(qg.dtype)  # SDPA wants a float mask in q's dtype
        og = F.scaled_dot_product_attention(qg, kd, vd, attn_mask=mask, scale=layer.scaling)
        return og.reshape(n, layer.num_heads, layer.head_dim)

    def _extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        layer: AttentionLayerSpec,
        g: AttnGroup,
    ) -> torch.Tensor:
        """Rows ``[n * q_len, H, D]`` of the padded group, request by request."""
        n, q_len = g.q_index.shape
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qg = self._group_queries(q, g).view(n, q_len, h, d).transpose(1, 2)  # [n, H, q_len, D]
        kg, vg = self._group_keys(k, v, k_buf, v_buf, layer, g)
        if g.keys_are_new:
            og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=layer.scaling, enable_gqa=h != hkv)
        else:
            og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=layer.scaling, enable_gqa=h != hkv)
        return og.transpose(1, 2).reshape(n * q_len, h, d)

    def _group_keys(
        self, k: torch.Tensor, v: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: AttentionLayerSpec,
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
        return self._gather(k_buf, g.kv_flat, n).to(k.dtype), self._gather(v_buf, g.kv_flat, n).to(k.dtype)


def packed_starts(ext_lens: list[int]) -> list[int]:
    """Each request's first row among the batch's packed new tokens."""
    starts = [0] * len(ext_lens)
    for i in range(1, len(ext_lens)):
        starts[i] = starts[i - 1] + ext_lens[i - 1]
    return starts


def one_token_group(
    kv_loc: torch.Tensor, valid: torch.Tensor, uniform: bool, members: list[int], starts: list[int] | None,
    in_order: bool,
) -> AttnGroup:
    """A one-token group over the keys ``kv_loc`` (``valid`` marks the real ones; ``uniform``:
    every member has the same number, known on the host, so no mask). ``in_order``: the
    members are the whole batch in order (queries and outputs are the packed rows as they are)."""
    device = kv_loc.device
    if in_order:
        q_index = torch.arange(len(members), dtype=torch.int64, device=device)[:, None]
        out_tokens = out_rows = None
    else:
        assert starts is not None
        out_tokens = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        q_index = out_tokens[:, None]
        out_rows = torch.arange(len(members), dtype=torch.int64, device=device)
    mask = None if uniform else key_bias(valid[:, None, None, :])
    return AttnGroup(q_index, kv_loc, mask, out_tokens, out_rows, one_token=True,
                     q_start=0 if in_order else None, kv_flat=kv_loc.reshape(-1))


def extend_outputs(
    q_index: torch.Tensor, q_valid: torch.Tensor, covers_all: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(out_tokens, out_rows)`` of an extend group: its real queries' packed rows and their rows
    in the flattened ``[n * q_len]`` output, request by request; ``(None, None)`` when the group's
    output is every packed row in order."""
    if covers_all:
        return None, None
    n, q_len = q_index.shape
    rows = torch.arange(n * q_len, dtype=torch.int64, device=q_index.device).view(n, q_len)
    return q_index[q_valid], rows[q_valid]


def _plan_shared_prefix(kv_loc: torch.Tensor, lens: list[int]) -> SharedPrefix | None:
    """The cascade plan when every member's first slots are the same (and long enough), else None."""
    n = kv_loc.shape[0]
    limit = min(lens) - 1  # every member keeps at least one key of its own
    if n < 2 or limit < CASCADE_MIN_PREFIX:
        return None
    same = (kv_loc[:, :limit] == kv_loc[:1, :limit]).all(dim=0)
    differ = (~same).nonzero()
    p = int(differ[0, 0]) if differ.numel() else limit
    if p < CASCADE_MIN_PREFIX:
        return None
    suffix_lens = [length - p for length in lens]
    ls = max(suffix_lens)
    suffix = kv_loc[:, p : p + ls].contiguous()
    return SharedPrefix(loc=kv_loc[0, :p].contiguous(), suffix_loc=suffix.reshape(-1), suffix_len=ls,
                        suffix_mask=length_mask(suffix_lens, ls, kv_loc.device))


def _common_cached_prefix(kv_loc: torch.Tensor, prefix_lens: list[int]) -> torch.Tensor | None:
    """int64 ``[P]`` slots that start every member's cached prefix (P >= CASCADE_MIN_PREFIX), else None.

    Only cached keys qualify (``P <= min(prefix_lens)``), so every new token of every
    member sees the whole shared part and the causal mask only concerns the rest.
    """
    limit = min(prefix_lens)
    if kv_loc.shape[0] < 2 or limit < CASCADE_MIN_PREFIX:
        return None
    same = (kv_loc[:, :limit] == kv_loc[:1, :limit]).all(dim=0)
    differ = (~same).nonzero()
    p = int(differ[0, 0]) if differ.numel() else limit
    return kv_loc[0, :p].contiguous() if p >= CASCADE_MIN_PREFIX else None


def length_mask(lens: list[int], width: int, device: torch.device) -> torch.Tensor | None:
    """Key bias ``[n, 1, 1, width]`` (see ``key_bias``): key j of request i is real when
    ``j < lens[i]``; None when all are."""
    if min(lens) == width:
        return None
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    return key_bias((torch.arange(width, device=device)[None, :] < lens_t[:, None])[:, None, None, :])


def key_bias(valid: torch.Tensor) -> torch.Tensor:
    """fp32 additive mask of one-token groups: 0 where ``valid`` (bool), -inf elsewhere.

    Built once per forward and added to every layer's scores (cheaper than a masked_fill
    per layer)."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))



def host_list(cached: list[int], tensor: torch.Tensor) -> list[int]:
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
