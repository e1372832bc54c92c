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
  every cached key from the pool again, and attention reads contiguous per-head rows (a
  quantized pool's copies hold its codes: ``_quantized_mirror``);
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

Soft-capped logits (``AttentionLayerSpec.logit_softcap``, Gemma 2): the C kernels (decode, prefix,
causal, row softmax) and the flash op do not cap, so a capped layer takes none of them. It keeps
the same plan, the same groups and the same key sources (the mirror, whose appends it then stores
in torch, a one-token group's shared prefix, an extend group's cascade), and computes each part
in torch with the cap (``runtime.engine.attention.softcap``; the cascade's two parts merged by
log-sum-exp as before). Once a capped layer has run, ``claim_decode_step`` declines, so the
one-call decode stack (``runtime.engine.cpu.decode_layers``, whose C attention does not cap) never
runs such a model.

This module is the backend: it plans the groups, keeps the mirror and picks a path per group.
The attention computations themselves (where each applies, and how it runs) are the stateless
functions of ``runtime.engine.cpu.attention_fastpaths``.
"""

from __future__ import annotations

from typing import Any

import torch

from memory.kv_format import KVRows
from runtime.engine.attention import torch_native
from runtime.engine.attention.base import AttentionLayerSpec
from runtime.engine.attention.plan import AttnGroup, TorchNativeMetadata, host_list
from runtime.engine.attention.softcap import softcapped_attention
from runtime.engine.cpu import attention_fastpaths as fastpaths
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_q8 as attn_q8
from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.cpu.attention_plan import CpuAttnGroup, MirrorPlan, plan_shared_prefix
from runtime.engine.cpu.decode_mirror import MIRROR_MAX_POOL_FRACTION, DecodeKVMirror, MirrorStep, WindowStep
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
        self.layer_windows: tuple[int | None, ...] = tuple(windows)
        self.mirrored_layers: int | None = sum(w is None for w in windows) if windows else None
        # Whether a layer with soft-capped logits has run through this backend (noted where a group
        # reads the cap, not per layer call): the one-call decode stack's C attention cannot cap, so
        # from then on ``claim_decode_step`` declines (every decode follows the prefill that ran
        # each layer here).
        self.softcap_seen = False

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self.verify_plan = None
        if batch.forward_mode == ForwardMode.VERIFY and self.mirrored_layers in (
            None,
            len(batch.token_to_kv_pool.k_buffer),
        ):
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
                group.mirror = self.mirror.plan(
                    batch, group, host_list(batch.seq_lens_cpu, batch.seq_lens), self.mirrored_layers
                )

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
        (a rebuild, a batch that is not one in-order decode group, a verify the copies could not take,
        a model with soft-capped logits, windowed layers of a quantized pool or of several windows).
        A model with windowed layers: the step also carries their plan (``MirrorStep.window``: the
        keys ``_one_token`` would gather for them), and their entries of the copies are None."""
        if self.softcap_seen:
            return None  # (the kernels of the one call do not cap)
        meta: TorchNativeMetadata | None = batch.attn_metadata
        if batch.forward_mode == ForwardMode.VERIFY:
            return None if self.verify_plan is None else self.mirror.claim_append_step(self.verify_plan, num_layers)
        if meta is None or not batch.forward_mode.is_decode() or len(meta.groups) != 1:
            return None
        (g,) = meta.groups
        assert isinstance(g, CpuAttnGroup)
        if g.mirror is None or g.out_tokens is not None or g.q_start != 0:
            return None
        if self.mirrored_layers in (None, num_layers):
            return self.mirror.claim_append_step(g.mirror, num_layers)
        window = self._window_step(batch, num_layers)
        if window is None:
            return None
        windowed = [w is not None for w in self.layer_windows]
        return self.mirror.claim_append_step(g.mirror, num_layers, windowed, window)

    def _window_step(self, batch: ForwardBatch, num_layers: int) -> WindowStep | None:
        """The windowed layers' keys for a decode step the one call runs (one window, a plain pool, one
        in-order group): the plan's slots and key bias, and the new tokens' slots in their pool."""
        windows = {w for w in self.layer_windows if w is not None}
        pool = batch.token_to_kv_pool
        if len(self.layer_windows) != num_layers or len(windows) != 1 or pool.format.quantized:
            return None
        (group,) = self._window_groups(batch, windows.pop())
        if group.out_tokens is not None or group.q_start != 0 or group.kv_flat is None:
            return None
        translate = getattr(pool, "translate_swa", None)
        loc = batch.out_cache_loc
        return WindowStep(group.kv_flat, group.kv_loc.shape[1], group.mask, translate(loc) if translate else loc)

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
        """Rows ``[n, H, D]``: each member's single query against its keys, GQA folded (a capped
        layer: the same keys, the torch paths with the cap, the mirror's append stored in torch)."""
        assert isinstance(g, CpuAttnGroup)  # (group_type: every group this backend plans)
        qg = self._folded_queries(q, layer, g)
        n = qg.shape[0]
        softcap = layer.logit_softcap
        if softcap is not None:
            self.softcap_seen = True
        prefix: tuple[torch.Tensor, torch.Tensor] | None = None
        append: attn_kernels.KeyAppend | None = None
        if g.mirror is not None and self.mirror.format is not None:
            og = self._quantized_mirror(qg, k_buf, v_buf, layer, g.mirror)
            return og.reshape(n, layer.num_heads, layer.head_dim)
        if g.mirror is not None:
            if softcap is None:
                append = self.mirror.kernel_append(layer.layer_id, g.mirror, qg, k, v)
            kd_t, vd, prefix = self.mirror.keys(
                layer.layer_id, g.mirror, k, v, k_buf.buffer, v_buf.buffer, defer_append=append is not None
            )
            mask = g.mirror.mask
        elif g.shared is not None:
            plan = g.shared
            prefix = (
                self._gather(k_buf, plan.loc, 1, qg.dtype).transpose(-1, -2),
                self._gather(v_buf, plan.loc, 1, qg.dtype),
            )
            kd_t, vd = (
                self._gather(k_buf, plan.suffix_loc, n, qg.dtype).transpose(-1, -2),
                self._gather(v_buf, plan.suffix_loc, n, qg.dtype),
            )
            mask = plan.suffix_mask
        else:
            assert g.kv_flat is not None
            gathered = self._gather_dense(k_buf, v_buf, g.kv_flat, n, qg.dtype)
            kd_t, vd = gathered or (
                self._gather(k_buf, g.kv_flat, n, qg.dtype).transpose(-1, -2),
                self._gather(v_buf, g.kv_flat, n, qg.dtype),
            )
            mask = g.mask
        kd_t, vd = kd_t.to(qg.dtype), vd.to(qg.dtype)
        width = g.mirror.width if g.mirror is not None else None  # the mirror's keys past it are padding
        packed = self.mirror.packed_prefix(layer.layer_id) if g.mirror is not None and prefix is not None else None
        if packed is not None and softcap is None and attn_kernels.supports(qg, kd_t, vd, mask):
            # Cascade in two kernels: the shared prefix for every query at once, then each
            # request's own keys continuing the same softmax (no merge pass).
            init = attn_kernels.prefix_attention(qg, packed, layer.scaling)
            og, _ = attn_kernels.decode_attention(
                qg, kd_t, vd, mask, layer.scaling, width or kd_t.shape[-1], False, append, init
            )
        elif prefix is not None:
            kp, vp = prefix[0].transpose(-1, -2).to(qg.dtype), prefix[1].to(qg.dtype)
            og = fastpaths.cascade_attention(qg, kp, vp, kd_t, vd, mask, layer.scaling, width, append, softcap)
        else:
            og, _ = fastpaths.few_query_attention(
                qg, kd_t, vd, mask, layer.scaling, with_lse=False, width=width, append=append, softcap=softcap
            )
        return og.reshape(n, layer.num_heads, layer.head_dim)

    @staticmethod
    def _gather_dense(
        k_buf: KVRows, v_buf: KVRows, flat_loc: torch.Tensor, n: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A plain pool's keys at ``flat_loc`` (``n * L`` slots) as contiguous K^T ``[n, Hkv, D, L]`` and V
        ``[n, Hkv, L, D]`` (the mirror's gather kernel), which the decode kernel reads as they are: a
        windowed layer's path, the same gather and kernel the one-call stack runs for it. None where
        the pool is quantized or of another dtype, or the kernel does not apply."""
        k, v = k_buf.buffer, v_buf.buffer
        if k_buf.format.quantized or k.dtype != dtype or flat_loc.numel() % max(n, 1):
            return None
        width = flat_loc.numel() // n
        dense_k = k.new_empty(n, k.shape[1], k.shape[2], width)
        dense_v = v.new_empty(n, v.shape[1], width, v.shape[2])
        return (dense_k, dense_v) if cpu_kernels.mirror_gather(k, v, flat_loc, width, dense_k, dense_v) else None

    def _quantized_mirror(
        self, qg: torch.Tensor, k_rows: KVRows, v_rows: KVRows, layer: AttentionLayerSpec, plan: MirrorPlan
    ) -> torch.Tensor:
        """A one-token group's attention over a quantized mirror (``[n, Hkv, group, D]``): the quantized
        kernel (it copies the step's stored rows in, widens the codes in registers, and continues a
        shared prefix's softmax from the prefix kernel); a capped layer, or operands it does not take,
        the copies' values dequantized in torch (a pass over them), then the paths of the model's dtype."""
        softcap = layer.logit_softcap
        append = self.mirror.pool_append(layer.layer_id, plan, qg, k_rows, v_rows) if softcap is None else None
        keys, prefix = self.mirror.quantized_keys(layer.layer_id, plan, k_rows, v_rows, defer_append=append is not None)
        packed = self.mirror.packed_prefix(layer.layer_id) if prefix is not None else None
        if softcap is None and (prefix is None or packed is not None) and attn_q8.supports(qg, keys, plan.mask):
            init = attn_kernels.prefix_attention(qg, packed, layer.scaling) if packed is not None else None
            og, _ = attn_q8.decode_attention(qg, keys, plan.mask, layer.scaling, plan.width, False, append, init)
            return og
        assert append is None  # (pool_append asks what the kernel takes)
        kd_t, vd = keys.dequantized(qg.dtype)
        if prefix is not None:
            kp, vp = prefix[0].transpose(-1, -2).to(qg.dtype), prefix[1].to(qg.dtype)
            return fastpaths.cascade_attention(
                qg, kp, vp, kd_t, vd, plan.mask, layer.scaling, plan.width, None, layer.logit_softcap
            )
        og, _ = fastpaths.few_query_attention(
            qg, kd_t, vd, plan.mask, layer.scaling, with_lse=False, width=plan.width, softcap=layer.logit_softcap
        )
        return og

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
        """Rows ``[n * q_len, H, D]`` of the padded group, request by request.

        Cascade groups (``shared_loc``) return only the real rows, in ``out_tokens`` order. A capped
        layer takes no kernel: the plan's explicit-score path, or the cascade's two parts in torch.
        """
        n, q_len = g.q_index.shape
        softcap = layer.logit_softcap
        if softcap is not None:
            self.softcap_seen = True
        matmul_prefill = (
            softcap is None and g.keys_are_new and fastpaths.matmul_prefill_applies(q, q_len, layer.head_dim)
        )
        if g.shared_loc is None and not matmul_prefill:
            return super()._extend(q, k, v, k_buf, v_buf, layer, g)  # the plain SDPA of the plan (capped: explicit)
        h, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        qs = self._group_queries(q, g)
        qg = qs.view(n, q_len, h, d).transpose(1, 2)  # [n, H, q_len, D]
        kg, vg = self._group_keys(k, v, k_buf, v_buf, layer, g)
        if g.shared_loc is None:
            return fastpaths.causal_prefill_attention(qs.view(n, q_len, h, d), kg, vg, layer.scaling)[0]
        # Cascade: own keys (causal, returning the log-sum-exp) ...
        if matmul_prefill:
            o_own, lse_own = fastpaths.causal_prefill_attention(
                qs.view(n, q_len, h, d), kg, vg, layer.scaling, with_lse=True
            )
            assert lse_own is not None
        elif softcap is not None:
            own_mask = None if g.keys_are_new else g.mask
            o_capped, lse_capped = softcapped_attention(
                qg, kg, vg, layer.scaling, softcap, mask=own_mask, is_causal=g.keys_are_new, with_lse=True
            )
            assert lse_capped is not None
            o_own = o_capped.transpose(1, 2).reshape(n * q_len, h, d)
            lse_own = lse_capped.transpose(1, 2).reshape(n * q_len, h)
        else:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            if g.keys_are_new:
                o_own, lse_own = flash(qg, kg, vg, is_causal=True, scale=layer.scaling)
            else:
                assert g.mask is not None
                add_mask = torch.zeros(g.mask.shape, dtype=qg.dtype, device=qg.device).masked_fill_(
                    ~g.mask, float("-inf")
                )
                o_own, lse_own = flash(qg, kg, vg, attn_mask=add_mask, scale=layer.scaling)
            o_own = o_own.transpose(1, 2).reshape(n * q_len, h, d)
            lse_own = lse_own.transpose(1, 2).reshape(n * q_len, h)
        padded = g.out_rows is not None and not g.keys_are_new
        real = qs  # the group's real queries
        if padded:  # keep the real rows (outputs and queries), in out_tokens order
            assert g.out_rows is not None and g.out_tokens is not None
            o_own, lse_own = o_own.index_select(0, g.out_rows), lse_own.index_select(0, g.out_rows)
            real = q.index_select(0, g.out_tokens)
        # ... and every real query of the group against the shared prefix at once.
        t = real.shape[0]
        group = h // hkv
        if softcap is None and attn_kernels.prefix_supported(real.dtype, real.device, d):
            # the prefix kernel: a tile of query rows of a KV head against each key load
            packed = attn_kernels.pack_prefix(
                k_buf.gather(g.shared_loc, real.dtype), v_buf.gather(g.shared_loc, real.dtype)
            )
            o_pre, lse_pre = attn_kernels.prefix_attention(real.view(t, hkv, group, d), packed, layer.scaling)
            merged = fastpaths.merge_partial_attention(
                o_pre.to(real.dtype), lse_pre, o_own.reshape(t, hkv, group, d), lse_own.reshape(t, hkv, group)
            )
            return merged.reshape(t, h, d)
        q_all = real.reshape(t, hkv, group, d).permute(1, 0, 2, 3).reshape(1, hkv, t * group, d)
        kp = k_buf.gather(g.shared_loc, qg.dtype).unsqueeze(0).transpose(1, 2)
        vp = v_buf.gather(g.shared_loc, qg.dtype).unsqueeze(0).transpose(1, 2)
        o_pre, lse_pre = fastpaths.attend_shared_keys(q_all, kp, vp, layer.scaling, softcap)
        # (reshape: views where the layouts allow, which they do on the bf16 paths)
        merged = fastpaths.merge_partial_attention(
            o_pre.reshape(hkv, t, group, d).permute(1, 0, 2, 3),
            lse_pre.reshape(hkv, t, group).permute(1, 0, 2),
            o_own.reshape(t, hkv, group, d),
            lse_own.reshape(t, hkv, group),
        )
        return merged.reshape(t, h, d)
