"""The torch-native attention backend on CPU: the plan of ``runtime.engine.attention.torch_native``
plus the CPU's fast paths for running it.

What keeps it fast (each measured on the 200M bench model, see bench/model_step.py):

- a one-token group whose requests all start with the same KV slots (a shared prompt
  prefix served from the radix cache) attends to that prefix once for the whole group
  (one GEMM per KV head, every request's queries against one copy of the prefix keys) and to
  each request's own suffix separately, then merges the two softmaxes by their
  log-sum-exp ("cascade" attention): the prefix is read once per layer instead of once
  per request;
- consecutive decode steps of the same requests keep a dense copy of each request's keys
  (``runtime.engine.cpu.decode_mirror``): a step appends the new token to it instead of gathering
  every cached key from the pool again, and attention reads contiguous per-head rows;
- an extend group whose members all have the same cached prefix (the shared-prefix
  prefill after the first request warmed the cache) attends to that prefix in one call
  for all of its queries and to the new tokens causally, merged the same way;
- one-token groups do not use the flash kernel (its per-block setup dominates with a
  handful of queries): bf16, and fp32 on AVX2 / AVX-512 builds, go through the C decode
  kernel of ``runtime.engine.cpu.attention_kernels``, other cases through two batched matmuls
  around an fp32 softmax; the mirror keeps K transposed for both. A shared prefix is
  attended as one GEMM per KV head with every request's queries, or, with the C kernels
  (``attn_kernels.prefix_supported``), by ``attn_kernels.prefix_attention`` on a packed copy
  the mirror makes once per rebuild, after which the decode kernel continues each softmax
  over the request's own keys (no merge);
- half-precision prompts of equal length with no cached prefix (up to 4096 tokens, in
  runs of query positions that skip most of the causal upper triangle), and every shared
  prefix of a prefill, are attended with bf16 GEMMs around the C row softmax (``softmax_rows``);
  fp32 prompts of equal length go through the fp32 causal kernel instead of the flash kernel,
  and a shared prefix of an fp32 prefill through the fp32 prefix kernel, where they apply;
- the forward's new K/V go into the pool through ``CpuOps.store_kv`` (the C row copy).
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.engine.attention import torch_native
from runtime.engine.attention.base import AttentionLayerSpec
from runtime.engine.attention.plan import AttnGroup, TorchNativeMetadata, host_list
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.cpu.attention_plan import CpuAttnGroup, MirrorPlan, plan_shared_prefix
from runtime.engine.cpu.decode_mirror import MIRROR_MAX_POOL_FRACTION, DecodeKVMirror, MirrorStep
from runtime.engine.forward_batch import ForwardBatch, ForwardMode


class CpuAttnBackend(torch_native.TorchNativeAttnBackend):
    """The registry's ``torch_native`` on CPU: the same plan as ``TorchNativeAttnBackend``, run
    through the CPU's paths.

    The only state kept between forwards is the decode-key mirror, which every forward
    re-validates against ``req_to_token`` before it is trusted.
    """

    plan_cascade = True
    group_type = CpuAttnGroup
    kv_copy_fraction = MIRROR_MAX_POOL_FRACTION

    def __init__(self, model_runner: Any = None) -> None:
        super().__init__(model_runner)
        self.mirror = DecodeKVMirror()
        self.verify_plan: MirrorPlan | None = None  # this forward's, when it is a verify the copies take
        # Windowed layers (their own plan, window_plan) never read the mirror, the cascade or the
        # unmasked prefill paths: only the full-attention layers count as the mirror's readers.
        windows = getattr(getattr(model_runner, "model_config", None), "layer_windows", ()) or ()
        self.mirrored_layers: int | None = sum(w is None for w in windows) if windows else None

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.verify_plan = None
        if batch.forward_mode == ForwardMode.VERIFY and self.mirrored_layers in (None, len(batch.token_to_kv_pool.k_buffer)):
            # the copies take the step's tokens as appends (a step the one-call path then declines runs
            # as the extend planned below, and the next forward finds them stale and rebuilds)
            self.verify_plan = self.mirror.plan_verify(batch)
        elif not batch.forward_mode.is_decode():
            self.mirror.reset()  # an extend may reuse freed slots: trust nothing mirrored before it
        super().init_forward_metadata(batch)
        if batch.forward_mode.is_decode():
            (group,) = batch.attn_metadata.groups
            assert isinstance(group, CpuAttnGroup)
            if self.mirrored_layers != 0:
                group.mirror = self.mirror.plan(batch, group, host_list(batch.seq_lens_cpu, batch.seq_lens),
                                                self.mirrored_layers)

    def _decode_group(
        self,
        batch: ForwardBatch,
        members: list[int],
        seq_lens: list[int],
        in_order: bool,
        starts: list[int] | None = None,
    ) -> AttnGroup:
        """The plain one-token group plus its cascade plan (a prefix every member shares)."""
        group = super()._decode_group(batch, members, seq_lens, in_order, starts)
        assert isinstance(group, CpuAttnGroup)
        if self.plan_cascade:
            group.shared = plan_shared_prefix(group.kv_loc, [seq_lens[i] for i in members])
        return group

    def claim_decode_step(self, batch: ForwardBatch, num_layers: int) -> MirrorStep | None:
        """This decode (or verify) forward's mirror, for a caller that runs all ``num_layers`` layers'
        KV writes and attention through the kernels itself (``runtime.engine.cpu.decode_layers``: the same
        kernels ``forward`` would call), marked as updated; None where ``forward`` must run per layer
        (a rebuild, windowed layers, a batch that is not one in-order decode group, a verify the
        copies could not take)."""
        meta: TorchNativeMetadata | None = batch.attn_metadata
        if batch.forward_mode == ForwardMode.VERIFY:
            return None if self.verify_plan is None else self.mirror.claim_append_step(self.verify_plan, num_layers)
        if meta is None or not batch.forward_mode.is_decode() or self.mirrored_layers not in (None, num_layers):
            return None  # (windowed layers read their own plan)
        if len(meta.groups) != 1:
            return None
        (g,) = meta.groups
        assert isinstance(g, CpuAttnGroup)
        if g.mirror is None or g.out_tokens is not None or g.q_start != 0:
            return None
        return self.mirror.claim_append_step(g.mirror, num_layers)

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
        assert isinstance(g, CpuAttnGroup)  # (group_type: every group this backend plans)
        qg = self._folded_queries(q, layer, g)
        n = qg.shape[0]
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        append: attn_kernels.KeyAppend | None = None
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
        if packed is not None and attn_kernels.supports(qg, kd_t, vd, mask):
            # Cascade in two kernels: the shared prefix for every query at once, then each
            # request's own keys continuing the same softmax (no merge pass).
            init = attn_kernels.prefix_attention(qg, packed, layer.scaling)
            og, _ = attn_kernels.decode_attention(qg, kd_t, vd, mask, layer.scaling, width or kd_t.shape[-1], False,
                                                 append, init)
        elif prefix is not None:
            kp, vp = prefix[0].transpose(-1, -2).to(qg.dtype), prefix[1].to(qg.dtype)
            og = _cascade(qg, kp, vp, kd_t, vd, mask, layer.scaling, width, append)
        else:
            og, _ = _few_query_attention(qg, kd_t, vd, mask, layer.scaling, with_lse=False, width=width, append=append)
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
        """Rows ``[n * q_len, H, D]`` of the padded group, request by request.

        Cascade groups (``shared_loc``) return only the real rows, in ``out_tokens`` order.
        """
        n, q_len = g.q_index.shape
        matmul_prefill = g.keys_are_new and _matmul_prefill_applies(q, q_len, layer.head_dim)
        if g.shared_loc is None and not matmul_prefill:
            return super()._extend(q, k, v, k_buf, v_buf, layer, g)  # the plain SDPA of the plan
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qs = self._group_queries(q, g)
        qg = qs.view(n, q_len, h, d).transpose(1, 2)  # [n, H, q_len, D]
        kg, vg = self._group_keys(k, v, k_buf, v_buf, layer, g)
        if g.shared_loc is None:
            return _causal_prefill_attention(qs.view(n, q_len, h, d), kg, vg, layer.scaling)[0]
        # Cascade: own keys (causal, returning the log-sum-exp) ...
        if matmul_prefill:
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
        if attn_kernels.prefix_supported(real.dtype, real.device, d):
            # the prefix kernel: a tile of query rows of a KV head against each key load
            packed = attn_kernels.pack_prefix(k_buf.index_select(0, g.shared_loc).to(real.dtype),
                                              v_buf.index_select(0, g.shared_loc).to(real.dtype))
            o_pre, lse_pre = attn_kernels.prefix_attention(real.view(t, hkv, group, d), packed, layer.scaling)
            merged = _merge(o_pre.to(real.dtype), lse_pre, o_own.reshape(t, hkv, group, d),
                            lse_own.reshape(t, hkv, group))
            return merged.reshape(t, h, d)
        q_all = real.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(1, hkv, t * group, d)
        kp = k_buf.index_select(0, g.shared_loc).to(qg.dtype).unsqueeze(0).transpose(1, 2)
        vp = v_buf.index_select(0, g.shared_loc).to(qg.dtype).unsqueeze(0).transpose(1, 2)
        o_pre, lse_pre = _attend_shared_keys(q_all, kp, vp, layer.scaling)
        # (reshape: views where the layouts allow, which they do on the bf16 paths)
        merged = _merge(o_pre.reshape(hkv, t, group, d).permute(1, 0, 2, 3),
                        lse_pre.reshape(hkv, t, group).permute(1, 0, 2),
                        o_own.reshape(t, hkv, group, d), lse_own.reshape(t, hkv, group))
        return merged.reshape(t, h, d)


_MATMUL_PREFILL_DTYPES = (torch.bfloat16, torch.float16)
# Longer prompts keep SDPA (the matmul path splits them into runs of query positions, each
# a GEMM against the keys before its end; far longer prompts make many small GEMMs).
_MATMUL_PREFILL_MAX_LEN = 4096
# Score bytes per chunk in _matmul_causal_attention and _attend_shared_keys (cache-sized).
_PREFILL_SCORE_BYTES = 4 << 20
# _matmul_causal_attention splits prompts at least this long into at least two runs of query
# positions, so the first run's scores skip the keys after it (a quarter of the work).
_PREFILL_SPLIT_MIN_LEN = 256


def _matmul_prefill_applies(q: torch.Tensor, q_len: int, head_dim: int) -> bool:
    """Whether prompts of ``q_len`` new tokens (no padding) go through ``_causal_prefill_attention``:
    half precision up to ``_MATMUL_PREFILL_MAX_LEN`` tokens, fp32 where its causal kernel runs
    (``attn_kernels.causal_attention``: faster than the flash kernel at every length measured)."""
    if q.dtype == torch.float32:
        return attn_kernels.prefix_supported(q.dtype, q.device, head_dim)
    return q.dtype in _MATMUL_PREFILL_DTYPES and q_len <= _MATMUL_PREFILL_MAX_LEN


def _causal_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, with_lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal self-attention of ``n`` equal-length prompts over their new tokens, as matmuls.

    ``q`` ``[n, L, H, D]``, ``k``/``v`` ``[n, Hkv, L, D]``; returns ``(out [n * L, H, D],
    lse [n * L, H] fp32 or None)`` (``with_lse``: for a cascade's merge with a cached
    prefix attended separately). bf16 with a head dim that is a multiple of 64 on an
    AVX-512 CPU, and fp32 on AVX2 / AVX-512 builds, go to ``attn_kernels.causal_attention``
    (the same work in one pass, fp32 scores: in bf16 ~2.3x faster at 64 x 128 tokens, ~1.8x
    at 512-2048). Otherwise
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
    fused = attn_kernels.causal_attention(q, k.transpose(1, 2), v.transpose(1, 2), scale, with_lse)
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
    append: attn_kernels.KeyAppend | None = None,
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
    width: int | None = None, append: attn_kernels.KeyAppend | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[n, Hkv, group, D]`` queries (a decode step, GQA folded) against keys ``k_t``
    ``[n, Hkv, D, L]`` (transposed: a view of ``[..., D, cap]`` rows is a strided batched
    matmul operand, while the transpose of a ``[..., L, D]`` view is first copied) and
    values ``[n, Hkv, L, D]``.

    Two batched matmuls around an fp32 softmax, as transformers' eager attention computes
    it: with a handful of queries per (request, KV head) the CPU flash kernel's per-block
    setup dominates, and this is ~2.3x faster on the bench model's decode (64 requests,
    4 KV heads x 4 queries, 160 keys: 0.49 vs 1.15 ms per layer). bf16 on CPU, and fp32 on
    AVX2 / AVX-512 builds, go to the C kernel of ``attn_kernels`` instead when it is available
    (~0.45 ms in bf16, fp32 scores).

    ``mask`` is an fp32 key bias ``[n, 1, 1, L]`` (``_key_bias``: 0 for a real key, -inf
    for padding) or None; ``width``: keys at ``width`` and beyond are all padding (the
    kernel skips them); ``append`` (``kernel_append``, only given when the kernel runs): the
    new keys the kernel stores first. Returns ``(out [n, Hkv, group, D], lse [n, Hkv, group]
    fp32 or None)``.
    """
    if attn_kernels.supports(qg, k_t, v, mask):
        return attn_kernels.decode_attention(qg, k_t, v, mask, scale, width or k_t.shape[-1], with_lse, append)
    assert append is None, "a deferred mirror append needs the decode kernel"

    scores = torch.matmul(qg, k_t).float().mul_(scale)  # [n, Hkv, group, L]
    if mask is not None:
        scores.add_(mask)
    if not with_lse:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v), None
    lse = torch.logsumexp(scores, dim=-1)
    probs = scores.sub_(lse.unsqueeze(-1)).exp_()
    return torch.matmul(probs.to(v.dtype), v), lse
