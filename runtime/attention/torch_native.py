"""Attention over the paged KV pool with plain torch (SDPA): the default on CPU.

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

What keeps it fast on CPU (each measured on the 200M bench model, see bench/model_step.py):

- one-token groups fold the GQA group into the query axis (``[n, kv_heads, group, D]``
  against ``[n, kv_heads, L, D]``): every KV head's keys are read once for its whole
  query group;
- keys are gathered with ``index_select`` on flattened slots (advanced indexing with a
  2-D index is ~20x slower on CPU);
- a group whose queries are a contiguous, unpadded run of the packed tokens reads and
  writes them as views (no query gather, no output scatter); when it also has no cached
  prefix, its keys are the new tokens themselves (no pool gather) and the mask is
  ``is_causal``;
- a one-token group whose requests all start with the same KV slots (a shared prompt
  prefix served from the radix cache) attends to that prefix once for the whole group
  (one GEMM per KV head, every request's queries against one copy of the prefix keys) and to
  each request's own suffix separately, then merges the two softmaxes by their
  log-sum-exp ("cascade" attention): the prefix is read once per layer instead of once
  per request;
- consecutive decode steps of the same requests keep a dense copy of each request's keys
  (``DecodeKVMirror``, K transposed ``[n, kv_heads, D, cap]`` and V ``[n, kv_heads, cap, D]``
  per layer): a step appends the new token to it instead of gathering every cached key
  from the pool again, and attention reads contiguous per-head rows;
- an extend group whose members all have the same cached prefix (the shared-prefix
  prefill after the first request warmed the cache) attends to that prefix in one call
  for all of its queries and to the new tokens causally, merged the same way;
- one-token groups do not use the flash kernel (its per-block setup dominates with a
  handful of queries): bf16 goes through the C decode kernel of ``runtime.cpu_kernels``,
  other dtypes through two batched matmuls around an fp32 softmax; the mirror keeps K
  transposed for both. A shared prefix is attended as one GEMM per KV head with every
  request's queries, or, in bf16 with the C kernels, by ``cpu_kernels.prefix_attention``
  on a pair-packed copy the mirror makes once per rebuild, after which the decode kernel
  continues each softmax over the request's own keys (no merge);
- half-precision prompts of equal length with no cached prefix (up to 4096 tokens, in
  runs of query positions that skip most of the causal upper triangle), and every shared
  prefix of a prefill, are attended with bf16 GEMMs around the C row softmax (``softmax_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from runtime import cpu_kernels
from runtime.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.forward_batch import ForwardBatch

# Padded work below this many (query, key) pairs is always acceptable in one group.
_GROUP_SLACK = 1 << 16
# A shared prefix shorter than this is not worth a separate cascade pass.
CASCADE_MIN_PREFIX = 32
# Dense decode-key copies are kept only while all layers' K and V take at most this
# fraction of the KV pool's own memory (or MIRROR_MIN_BUDGET_BYTES, whichever is larger).
MIRROR_MAX_POOL_FRACTION = 1.0
MIRROR_MIN_BUDGET_BYTES = 64 << 20
# Their capacity (keys per request) grows in steps of this many tokens: attention reads all
# ``cap`` columns (masked), so a larger step wastes work, a smaller one rebuilds more often.
MIRROR_CAP_STEP = 32


@dataclass
class SharedPrefix:
    """Cascade plan of a one-token group: ``loc`` keys common to every member, then each one's own."""

    loc: torch.Tensor  # int64 [P]: KV slots of the shared prefix
    suffix_loc: torch.Tensor  # int64 [n * Ls]: each member's remaining slots, padded with slot 0
    suffix_len: int  # Ls
    suffix_mask: torch.Tensor | None  # fp32 key bias [n, 1, 1, Ls] (_key_bias; None: no padding)


@dataclass
class AttnGroup:
    """One padded SDPA call: ``n`` requests, ``q_len`` padded queries, ``kv_len`` padded keys."""

    q_index: torch.Tensor  # int64 [n, q_len]: packed-token row of each padded query (0 for padding)
    kv_loc: torch.Tensor  # int64 [n, kv_len]: KV-pool slot of each padded key (0 for padding)
    mask: torch.Tensor | None  # bool [n, 1, q_len, kv_len] (one-token groups: fp32 key bias [n, 1, 1, kv_len], _key_bias); None: no mask
    out_tokens: torch.Tensor | None  # int64 [t]: packed rows this group produces; None = all rows in order
    out_rows: torch.Tensor | None  # int64 [t]: matching rows of the flattened [n * q_len] output
    one_token: bool = False  # every member has exactly one query: GQA folded into the query axis
    q_start: int | None = None  # queries are packed rows [q_start, q_start + n * q_len), unpadded
    kv_flat: torch.Tensor | None = None  # int64 [n * kv_len]: kv_loc flattened for index_select
    keys_are_new: bool = False  # no cached prefix, no padding: K/V are the new tokens (causal)
    shared: SharedPrefix | None = None  # cascade plan (one-token groups only)
    mirror: "MirrorPlan | None" = None  # dense-key plan (pure decode batches only)
    # Extend groups: int64 [P] slots of a prefix every member has cached (attended once, then
    # merged); the rest of the plan (mask, kv_flat) covers the keys after it.
    shared_loc: torch.Tensor | None = None


@dataclass
class TorchNativeMetadata:
    groups: list[AttnGroup]


class TorchNativeAttnBackend(AttentionBackend):
    """``model_runner`` is accepted for a uniform constructor.

    The only state kept between forwards is the decode-key mirror, which every forward
    re-validates against ``req_to_token`` before it is trusted.
    """

    def __init__(self, model_runner: Any = None) -> None:
        self.model_runner = model_runner
        self.mirror = DecodeKVMirror()

    # ---- planning (once per forward) -------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        seq_lens = _host_list(batch.seq_lens_cpu, batch.seq_lens)
        ext_lens = _host_list(batch.extend_lens_cpu, batch.extend_lens)
        prefix_lens = _host_list(batch.prefix_lens_cpu, batch.prefix_lens)
        bs = len(seq_lens)
        if batch.forward_mode.is_decode():
            group = self._decode_group(batch, list(range(bs)), seq_lens, in_order=True)
            group.mirror = self.mirror.plan(batch, group, seq_lens)
            groups = [group]
        else:
            self.mirror.reset()  # an extend may reuse freed slots: trust nothing mirrored before it
            starts = [0] * bs
            for i in range(1, bs):
                starts[i] = starts[i - 1] + ext_lens[i - 1]
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
        device = batch.req_pool_indices.device
        kv_loc, valid = self._kv_locations(batch, members, seq_lens)
        lens = [seq_lens[i] for i in members]
        if in_order:
            q_index = torch.arange(len(members), dtype=torch.int64, device=device)[:, None]
            out_tokens = out_rows = None
        else:
            assert starts is not None
            tokens = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
            q_index = tokens[:, None]
            out_tokens = tokens
            out_rows = torch.arange(len(members), dtype=torch.int64, device=device)
        mask = None if min(lens) == max(lens) else _key_bias(valid[:, None, None, :])
        group = AttnGroup(q_index, kv_loc, mask, out_tokens, out_rows, one_token=True,
                          q_start=0 if in_order else None, kv_flat=kv_loc.reshape(-1))
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
        shared_loc = _common_cached_prefix(kv_loc, [prefix_lens[i] for i in members])
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
        out_tokens = q_index[q_valid]  # row-major: request by request, token by token
        out_rows = (torch.arange(n, device=device)[:, None] * q_len + qi).expand(n, q_len)[q_valid]
        if covers_all:
            out_tokens = out_rows = None  # the group's output is every packed row, in order
        return AttnGroup(q_index, kv_loc, mask[:, None], out_tokens, out_rows, q_start=q_start,
                         kv_flat=own_loc.masked_fill(~valid, 0).reshape(-1), shared_loc=shared_loc)

    # ---- per layer -------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        if not cpu_kernels.store_kv(k_buf, v_buf, batch.out_cache_loc, k, v):
            pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        meta: TorchNativeMetadata = batch.attn_metadata
        out: torch.Tensor | None = None
        for g in meta.groups:
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
    def _gather(buf: torch.Tensor, flat_loc: torch.Tensor, n: int) -> torch.Tensor:
        """``[n, Hkv, L, D]`` (a strided view) of the pool rows at ``flat_loc`` (``n * L`` slots)."""
        return buf.index_select(0, flat_loc).view(n, -1, buf.shape[1], buf.shape[2]).transpose(1, 2)

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
        n = g.q_index.shape[0]
        hkv, group, d = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads, layer.head_dim
        qs = q[g.q_start : g.q_start + n] if g.q_start is not None else q.index_select(0, g.q_index.view(-1))
        qg = qs.view(n, hkv, group, d)  # query head h uses KV head h // group
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        append: cpu_kernels.KeyAppend | None = None
        if g.mirror is not None:
            append = self.mirror.kernel_append(layer.layer_id, g.mirror, qg, k, v)
            kd_t, vd, prefix = self.mirror.keys(layer.layer_id, g.mirror, k, v, k_buf, v_buf,
                                                defer_append=append is not None)
            mask = g.mirror.mask
        elif g.shared is not None:
            plan = g.shared
            prefix = (self._gather(k_buf, plan.loc, 1).transpose(-1, -2), self._gather(v_buf, plan.loc, 1))
            kd_t, vd = self._gather(k_buf, plan.suffix_loc, n).transpose(-1, -2), self._gather(v_buf, plan.suffix_loc, n)
            mask = plan.suffix_mask
        else:
            assert g.kv_flat is not None
            kd_t, vd = self._gather(k_buf, g.kv_flat, n).transpose(-1, -2), self._gather(v_buf, g.kv_flat, n)
            mask = g.mask
        kd_t, vd = kd_t.to(qg.dtype), vd.to(qg.dtype)
        width = g.mirror.width if g.mirror is not None else None  # the mirror's keys past it are padding
        packed = self.mirror.packed_prefix(layer.layer_id) if g.mirror is not None and prefix is not None else None
        if packed is not None and cpu_kernels.supports(qg, kd_t, vd, mask):
            # Cascade in two kernels: the shared prefix for every query at once, then each
            # request's own keys continuing the same softmax (no merge pass).
            init = cpu_kernels.prefix_attention(qg, packed, layer.scaling)
            og, _ = cpu_kernels.decode_attention(qg, kd_t, vd, mask, layer.scaling, width or kd_t.shape[-1], False,
                                                 append, init)
        elif prefix is not None:
            kp, vp = prefix[0].transpose(-1, -2).to(qg.dtype), prefix[1].to(qg.dtype)
            og = _cascade(qg, kp, vp, kd_t, vd, mask, layer.scaling, width, append)
        else:
            og, _ = _few_query_attention(qg, kd_t, vd, mask, layer.scaling, with_lse=False, width=width, append=append)
        return og.reshape(n, layer.num_heads, d)

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
        """Rows ``[n * q_len, H, D]`` of the padded group, request by request.

        Cascade groups (``shared_loc``) return only the real rows, in ``out_tokens`` order.
        """
        n, q_len = g.q_index.shape
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        gqa = h != hkv
        if g.q_start is not None:
            qs = q[g.q_start : g.q_start + n * q_len]
        else:
            qs = q.index_select(0, g.q_index.view(-1))
        qg = qs.view(n, q_len, h, d).transpose(1, 2)  # [n, H, q_len, D]
        if g.keys_are_new:
            assert g.q_start is not None
            end = g.q_start + n * q_len
            kg = k[g.q_start : end].view(n, q_len, hkv, d).transpose(1, 2).to(qg.dtype)
            vg = v[g.q_start : end].view(n, q_len, hkv, d).transpose(1, 2).to(qg.dtype)
        else:
            assert g.kv_flat is not None
            kg = self._gather(k_buf, g.kv_flat, n).to(qg.dtype)
            vg = self._gather(v_buf, g.kv_flat, n).to(qg.dtype)
        if g.shared_loc is None:
            if g.keys_are_new and _matmul_prefill_applies(qg, q_len):
                return _causal_prefill_attention(qs.view(n, q_len, h, d), kg, vg, layer.scaling)[0]
            if g.keys_are_new:
                og = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=layer.scaling, enable_gqa=gqa)
            else:
                og = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=layer.scaling, enable_gqa=gqa)
            return og.transpose(1, 2).reshape(n * q_len, h, d)
        # Cascade: own keys (causal, returning the log-sum-exp) ...
        if g.keys_are_new and _matmul_prefill_applies(qg, q_len):
            o_own, lse_own = _causal_prefill_attention(qs.view(n, q_len, h, d), kg, vg, layer.scaling, with_lse=True)
            assert lse_own is not None
        else:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            if g.keys_are_new:
                o_own, lse_own = flash(qg, kg, vg, is_causal=True, scale=layer.scaling)
            else:
                assert g.mask is not None
                add_mask = torch.zeros(g.mask.shape, dtype=qg.dtype, device=qg.device).masked_fill_(~g.mask, float("-inf"))
                o_own, lse_own = flash(qg, kg, vg, attn_mask=add_mask, scale=layer.scaling)
            o_own = o_own.transpose(1, 2).reshape(n * q_len, h, d)
            lse_own = lse_own.transpose(1, 2).reshape(n * q_len, h)
        padded = g.out_rows is not None and not g.keys_are_new
        if padded:  # keep the real rows, in out_tokens order
            assert g.out_rows is not None and g.out_tokens is not None
            o_own, lse_own = o_own.index_select(0, g.out_rows), lse_own.index_select(0, g.out_rows)
        # ... and every real query of the group against the shared prefix at once.
        real = q.index_select(0, g.out_tokens) if padded else qs
        t = real.shape[0]
        group = h // hkv
        q_all = real.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(1, hkv, t * group, d)
        kp = k_buf.index_select(0, g.shared_loc).to(qg.dtype).unsqueeze(0).transpose(1, 2)
        vp = v_buf.index_select(0, g.shared_loc).to(qg.dtype).unsqueeze(0).transpose(1, 2)
        o_pre, lse_pre = _attend_shared_keys(q_all, kp, vp, layer.scaling)
        # (reshape: views where the layouts allow, which they do on the bf16 paths)
        merged = _merge(o_pre.reshape(hkv, t, group, d).permute(1, 0, 2, 3),
                        lse_pre.reshape(hkv, t, group).permute(1, 0, 2),
                        o_own.reshape(t, hkv, group, d), lse_own.reshape(t, hkv, group))
        return merged.reshape(t, h, d)


# Half-precision CPU prefill attention goes through batched matmuls (oneDNN bf16/fp16
# GEMMs) instead of the CPU flash kernel; fp32 keeps SDPA.
_MATMUL_PREFILL_DTYPES = (torch.bfloat16, torch.float16)
# Longer prompts keep SDPA (the matmul path splits them into runs of query positions, each
# a GEMM against the keys before its end; far longer prompts make many small GEMMs).
_MATMUL_PREFILL_MAX_LEN = 4096
# Score bytes per chunk in _matmul_causal_attention and _attend_shared_keys (cache-sized).
_PREFILL_SCORE_BYTES = 4 << 20
# _matmul_causal_attention splits prompts at least this long into at least two runs of query
# positions, so the first run's scores skip the keys after it (a quarter of the work).
_PREFILL_SPLIT_MIN_LEN = 256


def _matmul_prefill_applies(q: torch.Tensor, q_len: int) -> bool:
    """Whether prompts of ``q_len`` new tokens (no padding) go through ``_causal_prefill_attention``."""
    return q.device.type == "cpu" and q.dtype in _MATMUL_PREFILL_DTYPES and q_len <= _MATMUL_PREFILL_MAX_LEN


def _causal_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal self-attention of ``n`` equal-length prompts over their new tokens, as matmuls.

    ``q`` ``[n, L, H, D]``, ``k``/``v`` ``[n, Hkv, L, D]``; returns ``(out [n * L, H, D],
    lse [n * L, H] fp32 or None)`` (``with_lse``: for a cascade's merge with a cached
    prefix attended separately). bf16 with a head dim that is a multiple of 64 on an
    AVX-512 CPU goes to ``cpu_kernels.causal_attention`` (the same work in one pass, fp32
    scores: ~2.3x faster at 64 x 128 tokens, ~1.8x at 512-2048). Otherwise
    (``_matmul_causal_attention``) each KV head's query group is folded position-major into
    one ``[L * group, D]`` operand (one GEMM per request and KV head, no repeated keys), the
    bf16 scores go through the causal row softmax of ``cpu_kernels`` in place (torch ops in
    fp32 where it is unavailable). Work is cut into cache-sized chunks: several requests at
    a time for short prompts, runs of query positions for long ones (each run only reads the
    keys up to its last position, so the causal upper triangle is mostly skipped). On the
    bench model (64 prompts x 128 tokens, 16 heads, 4 KV heads, bf16, 2 cores) this takes
    ~12 ms per layer where the CPU flash kernel takes ~40 ms; precision is that of
    transformers' eager attention (bf16 scores and probabilities, fp32 softmax).
    """
    fused = cpu_kernels.causal_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale, with_lse)
    return fused if fused is not None else _matmul_causal_attention(q, k, v, scale, with_lse)


def _matmul_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_causal_prefill_attention`` as bf16 matmuls around the row softmax (see there)."""
    n, length, h, d = q.shape
    hkv = k.shape[1]
    group = h // hkv
    out = q.new_empty(n, length, h, d)
    lse_out = torch.empty(n, length, hkv, group, dtype=torch.float32, device=q.device) if with_lse else None
    row_bytes = hkv * group * length * 2  # bf16 scores of one query position against every key
    runs = max(-(-row_bytes * length // _PREFILL_SCORE_BYTES), 2 if length >= _PREFILL_SPLIT_MIN_LEN else 1)
    run_len = -(-length // runs)
    per_chunk = max(1, _PREFILL_SCORE_BYTES // (row_bytes * run_len))  # requests per chunk
    q_fold = q.view(n, length, hkv, group, d).permute(0, 2, 1, 3, 4)  # [n, Hkv, L, group, D]
    for start in range(0, n, per_chunk):
        end = min(n, start + per_chunk)
        c = end - start
        for first in range(0, length, run_len):
            last = min(length, first + run_len)  # positions [first, last) see keys [0, last)
            m = (last - first) * group
            qg = q_fold[start:end, :, first:last].reshape(c, hkv, m, d)  # row = position * group + head
            scores = torch.matmul(qg, k[start:end, :, :last].transpose(-1, -2))  # [c, Hkv, m, last]
            if cpu_kernels.softmax_supported(scores):  # in place: scores become probs
                lse = cpu_kernels.softmax_rows(scores, scale, causal_period=m, rows_per_position=group,
                                               first_position=first, with_lse=with_lse)
                probs = scores
            else:
                position = first + torch.arange(m, device=q.device) // group
                hidden = torch.arange(last, device=q.device)[None, :] > position[:, None]
                logits = scores.float().mul_(scale).masked_fill_(hidden, float("-inf"))
                lse = torch.logsumexp(logits, dim=-1) if with_lse else None
                probs = torch.softmax(logits, dim=-1).to(v.dtype)
            o = torch.matmul(probs, v[start:end, :, :last])  # [c, Hkv, m, D]
            out[start:end, first:last].view(c, last - first, hkv, group, d).copy_(
                o.view(c, hkv, last - first, group, d).transpose(1, 2))
            if lse_out is not None:
                assert lse is not None
                lse_out[start:end, first:last] = lse.view(c, hkv, last - first, group).transpose(1, 2)
    return out.view(n * length, h, d), None if lse_out is None else lse_out.view(n * length, h)


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
                        suffix_mask=_length_mask(suffix_lens, ls, kv_loc.device))


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


def _merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Softmax over the union of two key sets from each set's output and log-sum-exp.

    ``o_*`` ``[..., D]`` in the model dtype, ``lse_*`` ``[...]`` fp32; computed in fp32.
    bf16 ``[T, A, B, D]`` operands (any strides) go through ``cpu_kernels.merge_attention``,
    which reads them in place and returns a contiguous result.
    """
    merged = cpu_kernels.merge_attention(o_a, lse_a, o_b, lse_b)
    if merged is not None:
        return merged
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).unsqueeze(-1)
    return (o_a.float() * w_a + o_b.float() * w_b).to(o_a.dtype)


def _length_mask(lens: list[int], width: int, device: torch.device) -> torch.Tensor | None:
    """Key bias ``[n, 1, 1, width]`` (see ``_key_bias``): key j of request i is real when
    ``j < lens[i]``; None when all are."""
    if min(lens) == width:
        return None
    lens_t = torch.tensor(lens, dtype=torch.int64, device=device)
    return _key_bias((torch.arange(width, device=device)[None, :] < lens_t[:, None])[:, None, None, :])


def _key_bias(valid: torch.Tensor) -> torch.Tensor:
    """fp32 additive mask of one-token groups: 0 where ``valid`` (bool), -inf elsewhere.

    Built once per forward and added to every layer's scores (cheaper than a masked_fill
    per layer)."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))


def _attend_prefix(
    qg: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every member's queries ``[n, Hkv, group, D]`` against one shared prefix ``[1, Hkv, P, D]``.

    The members' queries become one long query axis per KV head, so the prefix keys are
    read once. Returns ``(out [n, Hkv, group, D], lse [n, Hkv, group])``.
    """
    n, hkv, group, d = qg.shape
    q_all = qg.transpose(0, 1).reshape(1, hkv, n * group, d)
    out_p, lse_p = _attend_shared_keys(q_all, kp, vp, scale)
    return out_p.view(hkv, n, group, d).transpose(0, 1), lse_p.view(hkv, n, group).transpose(0, 1)


def _attend_shared_keys(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Many queries ``[1, Hkv, M, D]`` against one key set ``[1, Hkv, P, D]`` (no mask):
    ``(out [1, Hkv, M, D], lse [1, Hkv, M] fp32)``.

    bf16 on CPU: bf16 score GEMMs, ``cpu_kernels.softmax_rows`` in place, then the value
    GEMM, a few thousand query rows at a time (~2x faster than the flash kernel on the
    shared-prefix prefill: 8064 queries x 512 keys per KV head). Otherwise the flash op.
    """
    m, p = q.shape[2], k.shape[2]
    if not cpu_kernels.softmax_applies(q.device, q.dtype, p):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        return flash(q, k.contiguous(), v, scale=scale)[:2]  # (the flash op wants unit-stride rows)
    hkv = q.shape[1]
    out = q.new_empty(q.shape)
    lse = torch.empty(1, hkv, m, dtype=torch.float32, device=q.device)
    step = max(1, _PREFILL_SCORE_BYTES // (hkv * p * 2))
    k_t = k.transpose(-1, -2)
    for start in range(0, m, step):
        end = min(m, start + step)
        scores = torch.matmul(q[:, :, start:end], k_t)  # bf16 [1, Hkv, rows, P], contiguous
        lse[:, :, start:end] = cpu_kernels.softmax_rows(scores, scale, with_lse=True)
        out[:, :, start:end] = torch.matmul(scores, v)
    return out, lse


def _cascade(
    qg: torch.Tensor,
    kp: torch.Tensor,
    vp: torch.Tensor,
    ks_t: torch.Tensor,
    vs: torch.Tensor,
    suffix_mask: torch.Tensor | None,
    scale: float,
    suffix_width: int | None = None,
    append: cpu_kernels.KeyAppend | None = None,
) -> torch.Tensor:
    """``[n, Hkv, group, D]`` queries: softmax over (shared prefix ++ own suffix), in two passes.

    ``kp``/``vp`` ``[1, Hkv, P, D]`` are the shared prefix, ``ks_t`` ``[n, Hkv, D, Ls]``
    (transposed) and ``vs`` ``[n, Hkv, Ls, D]`` each request's own keys (``suffix_mask``,
    a key bias ``[n, 1, 1, Ls]``, masks the padding).
    Each call returns its log-sum-exp; the two partial outputs are combined with weights
    ``exp(lse_part - lse_total)``.
    """
    out_p, lse_p = _attend_prefix(qg, kp, vp, scale)
    out_s, lse_s = _few_query_attention(qg, ks_t, vs, suffix_mask, scale, with_lse=True, width=suffix_width,
                                        append=append)
    assert lse_s is not None
    return _merge(out_p, lse_p, out_s, lse_s).contiguous()


def _few_query_attention(
    qg: torch.Tensor, k_t: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, with_lse: bool,
    width: int | None = None, append: cpu_kernels.KeyAppend | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n, Hkv, group, D]`` queries (a decode step, GQA folded) against keys ``k_t``
    ``[n, Hkv, D, L]`` (transposed: a view of ``[..., D, cap]`` rows is a strided batched
    matmul operand, while the transpose of a ``[..., L, D]`` view is first copied) and
    values ``[n, Hkv, L, D]``.

    Two batched matmuls around an fp32 softmax, as transformers' eager attention computes
    it: with a handful of queries per (request, KV head) the CPU flash kernel's per-block
    setup dominates, and this is ~2.3x faster on the bench model's decode (64 requests,
    4 KV heads x 4 queries, 160 keys: 0.49 vs 1.15 ms per layer). bf16 on CPU goes to
    the C kernel of ``cpu_kernels`` instead when it is available (~0.45 ms, fp32 scores).

    ``mask`` is an fp32 key bias ``[n, 1, 1, L]`` (``_key_bias``: 0 for a real key, -inf
    for padding) or None; ``width``: keys at ``width`` and beyond are all padding (the
    kernel skips them); ``append`` (``kernel_append``, only given when the kernel runs): the
    new keys the kernel stores first. Returns ``(out [n, Hkv, group, D], lse [n, Hkv, group]
    fp32 or None)``.
    """
    if cpu_kernels.supports(qg, k_t, v, mask):
        return cpu_kernels.decode_attention(qg, k_t, v, mask, scale, width or k_t.shape[-1], with_lse, append)
    assert append is None, "a deferred mirror append needs the decode kernel"

    scores = torch.matmul(qg, k_t).float().mul_(scale)  # [n, Hkv, group, L]
    if mask is not None:
        scores.add_(mask)
    if not with_lse:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v), None
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs.to(v.dtype), v), lse


@dataclass
class MirrorPlan:
    """How one decode forward's keys reach the mirror's dense copies."""

    rebuild: bool  # True: gather every key from the pool; False: append the new token only
    width: int  # W: own keys per request this step (the dense part's used width)
    prefix_len: int  # P: keys shared by every request ahead of the dense part (cascade); 0 if none
    own_flat: torch.Tensor | None  # rebuild: int64 [n * W] pool slots of each request's own keys (0-padded)
    prefix_loc: torch.Tensor | None  # rebuild: int64 [P] pool slots of the shared prefix
    append_pos: torch.Tensor | None  # append: int64 [n]: the new key's index in each request's row
    mask: torch.Tensor | None  # fp32 key bias [n, 1, 1, cap] (_key_bias): 0 for each request's real keys


class DecodeKVMirror:
    """Dense copies of the running decode batch's keys per layer: K ``[n, Hkv, D, cap]`` (transposed,
    the layout the score matmul reads) and V ``[n, Hkv, cap, D]``.

    Owner: the torch-native backend; the pool stays the source of truth. A decode step of
    exactly the previous step's requests (same req_to_token rows, each one token longer,
    the same slots for every key already mirrored, and no extend forward in between)
    appends the new token's K/V; any other forward rebuilds the copies from the pool
    (the gather every step would do anyway) or, after an extend, drops them. Requests
    with a common shared prefix (cascade) keep that prefix once (K^T ``[1, Hkv, D, P]``,
    V ``[1, Hkv, P, D]``).
    The copies take at most ``MIRROR_MAX_POOL_FRACTION`` of the pool's memory (at least
    ``MIRROR_MIN_BUDGET_BYTES`` are allowed); a batch that would need more is served by
    gathering from the pool every step.
    """

    def __init__(self) -> None:
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.prefix_k: list[torch.Tensor | None] = []
        self.prefix_v: list[torch.Tensor | None] = []
        self.prefix_packed: list[cpu_kernels.PackedPrefix | None] = []  # for cpu_kernels.prefix_attention
        self.rows: torch.Tensor | None = None  # req_to_token rows of the mirrored requests, in batch order
        self.own_lens: list[int] = []  # own keys mirrored per request (after the shared prefix)
        self.own_slots: torch.Tensor | None = None  # int64 [n, W]: their pool slots (0-padded)
        self.prefix_slots: torch.Tensor | None = None  # int64 [P]
        self.cap = 0
        self.num_layers = 0
        self.layers_done = 0  # layers of the last planned forward whose copies are up to date

    def reset(self) -> None:
        """Forget the mirrored requests (buffers are dropped too: nothing may read them)."""
        self.rows = self.own_slots = self.prefix_slots = None
        self.own_lens = []
        self.k, self.v, self.prefix_k, self.prefix_v, self.prefix_packed = [], [], [], [], []
        self.layers_done = 0

    def plan(self, batch: ForwardBatch, group: AttnGroup, seq_lens: list[int]) -> MirrorPlan | None:
        """This decode forward's plan (records the state it leaves behind), or None when over budget."""
        pool = batch.token_to_kv_pool
        kv_loc = group.kv_loc
        device = kv_loc.device
        n = kv_loc.shape[0]
        p = int(group.shared.loc.numel()) if group.shared is not None else 0
        own_lens = [length - p for length in seq_lens]
        width = max(own_lens)
        own = kv_loc[:, p : p + width]
        prefix_slots = kv_loc[0, :p]
        num_layers = len(pool.k_buffer)
        _, hkv, d = pool.k_buffer[0].shape
        append = self._can_append(batch, own, own_lens, p, prefix_slots, num_layers, width)
        if append:
            mask = _length_mask(own_lens, self.cap, device)
            pos = torch.tensor(self.own_lens, dtype=torch.int64, device=device)  # the new key's index
            result = MirrorPlan(False, width, p, None, None, pos, mask)
        else:
            cap = -(-(width + MIRROR_CAP_STEP) // MIRROR_CAP_STEP) * MIRROR_CAP_STEP
            mask = _length_mask(own_lens, cap, device)
            buf = pool.k_buffer[0]
            # (the prefix counted twice: a packed copy is kept for cpu_kernels.prefix_attention)
            nbytes = 2 * num_layers * (n * cap + 2 * p) * hkv * d * buf.element_size()
            pool_bytes = 2 * num_layers * buf.numel() * buf.element_size()
            if nbytes > max(MIRROR_MAX_POOL_FRACTION * pool_bytes, MIRROR_MIN_BUDGET_BYTES):
                self.reset()
                return None
            if cap != self.cap or self.rows is None or self.rows.numel() != n or len(self.k) != num_layers:
                self.k, self.v = [None] * num_layers, [None] * num_layers  # reallocated layer by layer
            self.prefix_k, self.prefix_v = [None] * num_layers, [None] * num_layers
            self.prefix_packed = [None] * num_layers
            self.cap = cap
            result = MirrorPlan(True, width, p, own.contiguous().reshape(-1), prefix_slots.contiguous(), None, mask)
        self.rows = batch.req_pool_indices.clone()
        self.own_lens = own_lens
        self.own_slots = own.clone()
        self.prefix_slots = prefix_slots.clone()
        self.num_layers = num_layers
        self.layers_done = 0
        return result

    def _can_append(
        self,
        batch: ForwardBatch,
        own: torch.Tensor,
        own_lens: list[int],
        p: int,
        prefix_slots: torch.Tensor,
        num_layers: int,
        width: int,
    ) -> bool:
        if self.rows is None or self.own_slots is None or self.prefix_slots is None:
            return False
        if self.layers_done != self.num_layers or num_layers != self.num_layers or width > self.cap:
            return False  # the last forward did not finish, or the copies are too small
        if own_lens != [length + 1 for length in self.own_lens] or p != self.prefix_slots.numel():
            return False
        if not torch.equal(batch.req_pool_indices, self.rows) or not torch.equal(prefix_slots, self.prefix_slots):
            return False
        prev_w = self.own_slots.shape[1]
        lens = torch.tensor(self.own_lens, dtype=torch.int64, device=own.device)
        mirrored = torch.arange(prev_w, device=own.device)[None, :] < lens[:, None]
        return bool(((own[:, :prev_w] == self.own_slots) | ~mirrored).all())

    def packed_prefix(self, layer_id: int) -> cpu_kernels.PackedPrefix | None:
        """Layer ``layer_id``'s shared prefix packed for ``cpu_kernels.prefix_attention``, if made."""
        return self.prefix_packed[layer_id] if layer_id < len(self.prefix_packed) else None

    def kernel_append(
        self, layer_id: int, plan: MirrorPlan, qg: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> cpu_kernels.KeyAppend | None:
        """An append step's new K/V as the decode kernel's job (it stores them while it reads
        those rows anyway), when the kernel will run on this layer's copies and can store them;
        else None and ``keys`` copies them."""
        if plan.rebuild or plan.append_pos is None or layer_id >= len(self.k):
            return None
        dense_k, dense_v = self.k[layer_id], self.v[layer_id]
        if dense_k is None or dense_v is None or not cpu_kernels.supports(qg, dense_k, dense_v, plan.mask):
            return None
        append = cpu_kernels.KeyAppend(k_new, v_new, plan.append_pos)
        return append if cpu_kernels.append_supported(append, dense_k) else None

    def keys(
        self,
        layer_id: int,
        plan: MirrorPlan,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_buf: torch.Tensor,
        v_buf: torch.Tensor,
        defer_append: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Bring layer ``layer_id``'s copies up to date; ``(K^T, V, prefix)`` views for attention.

        ``defer_append``: an append step leaves the new token's K/V for the caller to store
        (the decode kernel does it while it reads those rows: ``kernel_append``).

        K^T is ``[n, Hkv, D, cap]``, V ``[n, Hkv, cap, D]``: the whole buffers, keys past each
        request's length masked by the plan (a narrower view would make the CPU batched matmul
        copy its operand every call, which costs more than the masked columns). Prefix is
        ``(K^T [1, Hkv, D, P], V [1, Hkv, P, D])`` or None.
        """
        n = plan.mask.shape[0] if plan.mask is not None else k_new.shape[0]
        _, hkv, d = k_buf.shape
        dense_k, dense_v = self.k[layer_id], self.v[layer_id]
        if plan.rebuild:
            if dense_k is None or dense_v is None:
                # Zeroed, not empty: keys past a request's length are masked, but a NaN bit
                # pattern there would still poison its softmax (NaN + -inf is NaN).
                dense_k = torch.zeros(n, hkv, d, self.cap, dtype=k_buf.dtype, device=k_buf.device)
                dense_v = torch.zeros(n, hkv, self.cap, d, dtype=k_buf.dtype, device=k_buf.device)
                self.k[layer_id], self.v[layer_id] = dense_k, dense_v
            assert plan.own_flat is not None and plan.prefix_loc is not None
            w = plan.width
            dense_k[..., :w].copy_(k_buf.index_select(0, plan.own_flat).view(n, w, hkv, d).permute(0, 2, 3, 1))
            dense_v[:, :, :w].copy_(v_buf.index_select(0, plan.own_flat).view(n, w, hkv, d).transpose(1, 2))
            if plan.prefix_len:
                k_pre, v_pre = k_buf.index_select(0, plan.prefix_loc), v_buf.index_select(0, plan.prefix_loc)
                self.prefix_k[layer_id] = k_pre.unsqueeze(0).permute(0, 2, 3, 1).contiguous()
                self.prefix_v[layer_id] = v_pre.unsqueeze(0).transpose(1, 2).contiguous()
                if cpu_kernels.prefix_supported(k_buf.dtype, k_buf.device, d):
                    self.prefix_packed[layer_id] = cpu_kernels.pack_prefix(k_pre, v_pre)
        elif not defer_append:
            assert dense_k is not None and dense_v is not None and plan.append_pos is not None
            rows = torch.arange(n, device=dense_k.device)  # request b's new key goes to column append_pos[b]
            dense_k[rows, :, :, plan.append_pos] = k_new.to(dense_k.dtype)
            dense_v[rows, :, plan.append_pos] = v_new.to(dense_v.dtype)
        assert dense_k is not None and dense_v is not None
        self.layers_done += 1
        prefix = None
        if plan.prefix_len:
            pk, pv = self.prefix_k[layer_id], self.prefix_v[layer_id]
            assert pk is not None and pv is not None
            prefix = (pk, pv)
        return dense_k, dense_v, prefix


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
