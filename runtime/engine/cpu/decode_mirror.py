"""The decode-key mirror: dense per-request copies of the running decode batch's keys.

Consecutive decode steps of the same requests would otherwise gather every cached key
from the paged pool again, every layer, every step. The mirror keeps K transposed
``[n, kv_heads, D, cap]`` and V ``[n, kv_heads, cap, D]`` per layer (the layouts the CPU
decode kernel and the score matmul read as they are); a step appends the new token to it.

Memory: the copies may take up to ``MIRROR_MAX_POOL_FRACTION`` of the KV pool's bytes (at
least ``MIRROR_MIN_BUDGET_BYTES``). The model runner counts that share in its KV sizing
(``kv_copy_fraction`` of the CPU backend), so a pool sized from a memory budget leaves room
for its mirror inside that budget.

A quantized pool (``--kv-cache-dtype int8|fp8_*``) keeps quantized copies: the codes, one byte per
value, in the same two layouts, and for int8 each key's fp32 scales ``[n, kv_heads, cap]`` (fp8's
scale is the layer's). They are the pool's bytes moved, never dequantized: a rebuild gathers them
in C (``kv_quant_kernels.mirror_gather``) and an append copies the rows the pool stored at the
step's ``out_cache_loc`` slots, so the copies always equal the pool; the decode kernel
(``attention_kernels_q8``) widens them in registers. The budget counts their bytes. A dense
copy in the model's dtype would undo the saving: twice (bf16) the bytes each step reads, and
memory the sizing never gave it.

The cascade (a decode group's shared prompt prefix) with a quantized pool: the prefix is gathered
and dequantized into the model's dtype once per rebuild, into the copies the prefix kernel reads
(``pack_prefix``), and each request's own keys stay quantized. Per step that reads P keys of the
model's dtype once for the whole group, where copying the prefix into every request's quantized
row would read n * P bytes a step and hold n copies; a per-step dequantization of the prefix
would be a pass over cache rows the step does not need to make. Where the prefix kernel does not
run for the model's dtype and head dim (``attn_kernels.prefix_supported``: bf16 needs AVX-512 and
a head dim that is a multiple of 64) the cascade is off for a quantized pool and each request's
row holds its whole keys, so every step stays in the quantized kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memory.kv_format import KVCacheFormat, KVRows
from runtime.engine.attention.plan import host_list, key_bias, length_mask
from runtime.engine.cpu import attention_kernels as attn_kernels
from runtime.engine.cpu import attention_kernels_q8 as attn_q8
from runtime.engine.cpu import kernels as cpu_kernels
from runtime.engine.cpu import mirror_codes
from runtime.engine.cpu.attention_kernels_q8 import PoolAppend, QuantizedKeys
from runtime.engine.cpu.attention_plan import CpuAttnGroup, MirrorPlan, plan_shared_prefix
from runtime.engine.forward_batch import ForwardBatch

# Dense decode-key copies are kept only while all layers' K and V take at most this
# fraction of the KV pool's own memory (or MIRROR_MIN_BUDGET_BYTES, whichever is larger).
MIRROR_MAX_POOL_FRACTION = 1.0
MIRROR_MIN_BUDGET_BYTES = 64 << 20
# Their capacity (keys per request) grows in steps of this many tokens: attention reads all
# ``cap`` columns (masked), so a larger step wastes work, a smaller one rebuilds more often.
MIRROR_CAP_STEP = 32


@dataclass
class WindowStep:
    """A decode step's windowed layers' keys (``runtime.engine.attention.window_plan``: each request's
    last W keys), for a caller that attends over them itself: their slots in the windowed layers'
    pool, the key bias, and the step's new tokens' slots there."""

    slots: torch.Tensor = field(repr=False)  # int64 [n * L]: each request's window keys' slots (0-padded)
    length: int  # L
    mask: torch.Tensor | None = field(repr=False)  # fp32 key bias [n, 1, 1, L] (None: every key real)
    out_loc: torch.Tensor = field(repr=False)  # int64 [n]: the new tokens' slots in that pool


@dataclass
class MirrorStep:
    """An append step's copies, for a caller that runs every layer's decode kernel itself
    (``runtime.engine.cpu.decode_layers``): the kernel stores each layer's new K/V at ``plan.append_pos``.
    Each list is per layer id; a windowed layer's entries are None (it reads ``window``'s keys)."""

    plan: MirrorPlan = field(repr=False)
    k: list[torch.Tensor | None] = field(repr=False)  # per layer: K^T [n, Hkv, D, cap]
    v: list[torch.Tensor | None] = field(repr=False)  # per layer: V [n, Hkv, cap, D]
    prefix: list[attn_kernels.PackedPrefix | None] | None = field(repr=False)  # per layer when plan.prefix_len
    # a quantized mirror: its format (k and v then hold codes) and, for int8, each layer's key scales
    kv_format: KVCacheFormat | None = None
    k_scales: list[torch.Tensor] | None = field(default=None, repr=False)  # per layer: [n, Hkv, cap] fp32
    v_scales: list[torch.Tensor] | None = field(default=None, repr=False)
    window: WindowStep | None = None  # the windowed layers' keys (None: no layer is windowed)


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
        self.prefix_packed: list[attn_kernels.PackedPrefix | None] = []  # for attn_kernels.prefix_attention
        self.format: KVCacheFormat | None = None  # a quantized pool's: k and v hold its codes
        self.k_scales: list[torch.Tensor | None] = []  # int8: each key's scales [n, Hkv, cap] fp32
        self.v_scales: list[torch.Tensor | None] = []
        self.rows: torch.Tensor | None = None  # req_to_token rows of the mirrored requests, in batch order
        self.own_lens: list[int] = []  # own keys mirrored per request (after the shared prefix)
        self.own_slots: torch.Tensor | None = None  # int64 [n, W]: their pool slots (0-padded)
        self.prefix_slots: torch.Tensor | None = None  # int64 [P]
        self.cap = 0
        self.num_layers = 0
        self.mirrored_layers = 0  # layers that read the copies (the full-attention ones)
        self.layers_done = 0  # layers of the last planned forward whose copies are up to date

    def reset(self) -> None:
        """Forget the mirrored requests (buffers are dropped too: nothing may read them)."""
        self.rows = self.own_slots = self.prefix_slots = None
        self.own_lens = []
        self.k, self.v, self.prefix_k, self.prefix_v, self.prefix_packed = [], [], [], [], []
        self.k_scales, self.v_scales = [], []
        self.layers_done = 0

    def plan(
        self, batch: ForwardBatch, group: CpuAttnGroup, seq_lens: list[int], mirrored_layers: int | None = None
    ) -> MirrorPlan | None:
        """This decode forward's plan (records the state it leaves behind), or None when over budget.

        ``mirrored_layers``: how many layers read the copies each forward (the full-attention
        ones; windowed layers read their last W keys from the pool); default every layer."""
        pool = batch.token_to_kv_pool
        kv_loc = group.kv_loc
        device = kv_loc.device
        p = int(group.shared.loc.numel()) if group.shared is not None and mirror_codes.cascades(pool) else 0
        own_lens = [length - p for length in seq_lens]
        width = max(own_lens)
        own = kv_loc[:, p : p + width]
        prefix_slots = kv_loc[0, :p]
        num_layers = len(pool.k_buffer)  # copies are indexed by layer id
        mirrored = num_layers if mirrored_layers is None else mirrored_layers
        starts = [length - 1 for length in own_lens]  # the new key's index in each row
        append = self._can_append(batch, own, starts, p, prefix_slots, num_layers, width, mirrored)
        if append:
            mask = length_mask(own_lens, self.cap, device)
            pos = torch.tensor(starts, dtype=torch.int64, device=device)
            result: MirrorPlan | None = MirrorPlan(False, width, p, None, None, pos, mask, None, batch.out_cache_loc)
        else:
            result = self._rebuild_plan(batch, own, p, prefix_slots, own_lens, num_layers, mirrored)
            if result is None:
                return None
        self._record(batch, own, own_lens, prefix_slots, num_layers, mirrored)
        return result

    def _rebuild_plan(
        self,
        batch: ForwardBatch,
        own: torch.Tensor,
        p: int,
        prefix_slots: torch.Tensor,
        own_lens: list[int],
        num_layers: int,
        mirrored: int,
    ) -> MirrorPlan | None:
        """A plan that gathers every key from the pool (the copies re-made at a capacity for
        ``own_lens``); None (and the copies dropped) when they would exceed their memory budget."""
        pool = batch.token_to_kv_pool
        n, width = own.shape[0], max(own_lens)
        cap = -(-(width + MIRROR_CAP_STEP) // MIRROR_CAP_STEP) * MIRROR_CAP_STEP
        mask = length_mask(own_lens, cap, own.device)
        buf = pool.k_buffer[0]
        fmt: KVCacheFormat | None = pool.format if pool.format.quantized else None
        pool_bytes = 2 * sum(b.numel() for b in pool.k_buffer) * buf.element_size()
        if mirror_codes.nbytes_of_copies(n, cap, p, pool.kv_heads, pool.head_dim, mirrored, pool.format) > max(
            MIRROR_MAX_POOL_FRACTION * pool_bytes, MIRROR_MIN_BUDGET_BYTES
        ):
            self.reset()
            return None
        if (
            cap != self.cap
            or self.rows is None
            or self.rows.numel() != n
            or len(self.k) != num_layers
            or fmt != self.format
        ):
            self.k, self.v = [None] * num_layers, [None] * num_layers  # reallocated layer by layer
            self.k_scales, self.v_scales = [None] * num_layers, [None] * num_layers
        self.prefix_k, self.prefix_v = [None] * num_layers, [None] * num_layers
        self.prefix_packed = [None] * num_layers
        self.cap = cap
        self.format = fmt
        return MirrorPlan(
            True, width, p, own[:, :width].contiguous().reshape(-1), prefix_slots.contiguous(), None, mask
        )

    def _record(
        self,
        batch: ForwardBatch,
        own: torch.Tensor,
        own_lens: list[int],
        prefix_slots: torch.Tensor,
        num_layers: int,
        mirrored: int,
    ) -> None:
        """What a planned forward leaves in the copies (trusted once it updated every layer)."""
        self.rows = batch.req_pool_indices.clone()
        self.own_lens = own_lens
        self.own_slots = own.clone()
        self.prefix_slots = prefix_slots.clone()
        self.num_layers = num_layers
        self.mirrored_layers = mirrored
        self.layers_done = 0

    def plan_verify(self, batch: ForwardBatch, mirrored_layers: int | None = None) -> MirrorPlan | None:
        """A verify forward's append plan (speculative decoding: each request's input token and
        drafts as rows that share its copies), recording the state it leaves; None (and the copies
        dropped) where they cannot take it (over budget, windowed layers).

        Where the copies hold every key before each request's new tokens (the previous forward was
        a decode or verify of the same requests that updated every layer) the step only appends:
        the keys of drafts the last step rejected lie past each request's length and are
        overwritten. Otherwise the copies are first gathered again from the pool, every layer now
        (a decode step does that inside its forward). Every new token's key is stored, so the next
        step finds the accepted ones in place."""
        pool = batch.token_to_kv_pool
        num_layers = len(pool.k_buffer)
        mirrored = num_layers if mirrored_layers is None else mirrored_layers
        if mirrored != num_layers:
            self.reset()
            return None
        prefix_lens = host_list(batch.prefix_lens_cpu, batch.prefix_lens)
        seq_lens = host_list(batch.seq_lens_cpu, batch.seq_lens)
        device = batch.req_pool_indices.device
        kv_loc = batch.req_to_token_pool.req_to_token[batch.req_pool_indices, : max(seq_lens)].to(torch.int64)
        real = torch.arange(kv_loc.shape[1], device=device)[None, :] < torch.tensor(seq_lens, device=device)[:, None]
        kv_loc.masked_fill_(~real, 0)  # (stale entries past a request's length are not slots to gather)
        p = self.prefix_slots.numel() if self.prefix_slots is not None else 0
        starts = [length - p for length in prefix_lens]  # each request's first new key in its row
        own_lens = [length - p for length in seq_lens]
        own, prefix_slots = kv_loc[:, p : p + max(own_lens)], kv_loc[0, :p]
        if (
            min(starts) < 0
            or not torch.equal(kv_loc[:, :p], prefix_slots.expand(len(starts), p))
            or not self._can_append(batch, own, starts, p, prefix_slots, num_layers, max(own_lens), mirrored)
        ):
            shared = plan_shared_prefix(kv_loc, [length + 1 for length in prefix_lens])  # (keeps every new token own)
            p = int(shared.loc.numel()) if shared is not None and mirror_codes.cascades(pool) else 0
            starts = [length - p for length in prefix_lens]
            own_lens = [length - p for length in seq_lens]
            own, prefix_slots = kv_loc[:, p : p + max(own_lens)], kv_loc[0, :p]
            rebuild = self._rebuild_plan(batch, own, p, prefix_slots, own_lens, num_layers, mirrored)
            if rebuild is None:
                return None
            self.layers_done = 0
            for layer in range(num_layers):  # (the new tokens' columns gather stale keys: the step overwrites them)
                k_rows, v_rows = pool.kv_rows(layer)
                if self.format is not None:
                    self.quantized_keys(layer, rebuild, k_rows, v_rows)
                else:
                    k_buf, v_buf = k_rows.buffer, v_rows.buffer
                    self.keys(layer, rebuild, k_buf[:0], v_buf[:0], k_buf, v_buf)
        ext_lens = host_list(batch.extend_lens_cpu, batch.extend_lens)
        kv_row = torch.repeat_interleave(
            torch.arange(len(starts), device=device), torch.tensor(ext_lens, device=device)
        )
        pos = torch.tensor(
            [start + j for start, e in zip(starts, ext_lens) for j in range(e)], dtype=torch.int64, device=device
        )
        mask = key_bias((torch.arange(self.cap, device=device)[None, :] <= pos[:, None])[:, None, None, :])
        self._record(batch, own, own_lens, prefix_slots, num_layers, mirrored)
        return MirrorPlan(False, max(own_lens), p, None, None, pos, mask, kv_row, batch.out_cache_loc)

    def _can_append(
        self,
        batch: ForwardBatch,
        own: torch.Tensor,
        starts: list[int],
        p: int,
        prefix_slots: torch.Tensor,
        num_layers: int,
        width: int,
        mirrored: int,
    ) -> bool:
        """Whether the copies hold every key before each request's first new key (own index
        ``starts[b]``) for the same requests and slots, so that the forward only appends. Keys at
        or past a start (a verify step's rejected drafts, whose slots were freed) are overwritten."""
        if self.rows is None or self.own_slots is None or self.prefix_slots is None:
            return False
        if self.layers_done != self.mirrored_layers or mirrored != self.mirrored_layers:
            return False  # the last forward did not update every mirrored layer
        if num_layers != self.num_layers or width > self.cap or len(self.k) != num_layers:
            return False  # the last forward did not finish, or the copies are too small
        if p != self.prefix_slots.numel() or len(starts) != len(self.own_lens):
            return False
        if any(start < 0 or start > length for start, length in zip(starts, self.own_lens)):
            return False
        if not torch.equal(batch.req_pool_indices, self.rows) or not torch.equal(prefix_slots, self.prefix_slots):
            return False
        cols = min(self.own_slots.shape[1], own.shape[1])
        kept = torch.arange(cols, device=own.device)[None, :] < torch.tensor(starts, device=own.device)[:, None]
        return bool(((own[:, :cols] == self.own_slots[:, :cols]) | ~kept).all())

    def claim_append_step(
        self,
        plan: MirrorPlan,
        num_layers: int,
        windowed: list[bool] | None = None,
        window: WindowStep | None = None,
    ) -> MirrorStep | None:
        """This append step's copies of all ``num_layers`` layers (every one mirrored but the
        ``windowed`` ones, whose keys ``window`` plans; none run yet, each shared prefix packed),
        marked up to date: the caller runs the kernels that append and attend for every layer.
        None (nothing marked) where the step is not such a step."""
        if plan.rebuild or plan.append_pos is None or plan.mask is None or self.layers_done:
            return None
        skip = windowed or [False] * num_layers
        mirrored = skip.count(False)
        if len(skip) != num_layers or (window is not None) != (mirrored != num_layers):
            return None
        if mirrored != self.mirrored_layers or len(self.k) != num_layers or len(self.v) != num_layers:
            return None
        k = [None if w else t for w, t in zip(skip, self.k)]
        v = [None if w else t for w, t in zip(skip, self.v)]
        if any(t is None for w, t in zip(skip, k) if not w) or any(t is None for w, t in zip(skip, v) if not w):
            return None
        prefix = None
        if plan.prefix_len:
            prefix = [None if w else p for w, p in zip(skip, self.prefix_packed)]
            if len(prefix) != num_layers or any(p is None for w, p in zip(skip, prefix) if not w):
                return None
        k_scales = v_scales = None
        if self.format is not None and self.format.name == "int8":
            k_scales = [t for t in self.k_scales if t is not None]
            v_scales = [t for t in self.v_scales if t is not None]
            if len(k_scales) != num_layers or len(v_scales) != num_layers:
                return None
        self.layers_done = mirrored
        return MirrorStep(plan, k, v, prefix, self.format, k_scales, v_scales, window)

    def packed_prefix(self, layer_id: int) -> attn_kernels.PackedPrefix | None:
        """Layer ``layer_id``'s shared prefix packed for ``attn_kernels.prefix_attention``, if made."""
        return self.prefix_packed[layer_id] if layer_id < len(self.prefix_packed) else None

    def kernel_append(
        self, layer_id: int, plan: MirrorPlan, qg: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> attn_kernels.KeyAppend | None:
        """An append step's new K/V as the decode kernel's job (it stores them while it reads
        those rows anyway), when the kernel will run on this layer's copies and can store them;
        else None and ``keys`` copies them."""
        if plan.rebuild or plan.append_pos is None or layer_id >= len(self.k):
            return None
        dense_k, dense_v = self.k[layer_id], self.v[layer_id]
        if dense_k is None or dense_v is None or not attn_kernels.supports(qg, dense_k, dense_v, plan.mask):
            return None
        append = attn_kernels.KeyAppend(k_new, v_new, plan.append_pos)
        return append if attn_kernels.append_supported(append, dense_k) else None

    def pool_append(
        self, layer_id: int, plan: MirrorPlan, qg: torch.Tensor, k_rows: KVRows, v_rows: KVRows
    ) -> PoolAppend | None:
        """``kernel_append`` for quantized copies: the rows the pool stored this step as the quantized
        kernel's job, when it will run on this layer's copies; else None and ``quantized_keys`` copies them."""
        if plan.rebuild or plan.append_pos is None or plan.new_loc is None or layer_id >= len(self.k):
            return None
        if self.format is None or self.k[layer_id] is None or self.v[layer_id] is None:
            return None
        keys = self._codes(layer_id, k_rows, v_rows)
        if not attn_q8.supports(qg, keys, plan.mask):
            return None
        append = PoolAppend(k_rows.buffer, v_rows.buffer, plan.new_loc, plan.append_pos)
        return append if attn_q8.append_supported(append, keys, qg.shape[0]) else None

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
            if not cpu_kernels.mirror_gather(k_buf, v_buf, plan.own_flat, w, dense_k, dense_v):
                dense_k[..., :w].copy_(k_buf.index_select(0, plan.own_flat).view(n, w, hkv, d).permute(0, 2, 3, 1))
                dense_v[:, :, :w].copy_(v_buf.index_select(0, plan.own_flat).view(n, w, hkv, d).transpose(1, 2))
            if plan.prefix_len:
                self._keep_prefix(
                    layer_id, k_buf.index_select(0, plan.prefix_loc), v_buf.index_select(0, plan.prefix_loc)
                )
        elif not defer_append:
            assert dense_k is not None and dense_v is not None and plan.append_pos is not None
            rows = torch.arange(n, device=dense_k.device)  # request b's new key goes to column append_pos[b]
            dense_k[rows, :, :, plan.append_pos] = k_new.to(dense_k.dtype)
            dense_v[rows, :, plan.append_pos] = v_new.to(dense_v.dtype)
        assert dense_k is not None and dense_v is not None
        self.layers_done += 1
        return dense_k, dense_v, self._prefix(layer_id, plan)

    def _keep_prefix(self, layer_id: int, k_pre: torch.Tensor, v_pre: torch.Tensor) -> None:
        """A rebuild's copies of the shared prefix's keys ``[P, Hkv, D]`` (values, the model's dtype):
        K^T and V for the torch paths, packed for the prefix kernel where it runs."""
        self.prefix_k[layer_id] = k_pre.unsqueeze(0).permute(0, 2, 3, 1).contiguous()
        self.prefix_v[layer_id] = v_pre.unsqueeze(0).transpose(1, 2).contiguous()
        if attn_kernels.prefix_supported(k_pre.dtype, k_pre.device, k_pre.shape[-1]):
            self.prefix_packed[layer_id] = attn_kernels.pack_prefix(k_pre, v_pre)

    def _prefix(self, layer_id: int, plan: MirrorPlan) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not plan.prefix_len:
            return None
        pk, pv = self.prefix_k[layer_id], self.prefix_v[layer_id]
        assert pk is not None and pv is not None
        return pk, pv

    def quantized_keys(
        self, layer_id: int, plan: MirrorPlan, k_rows: KVRows, v_rows: KVRows, defer_append: bool = False
    ) -> tuple[QuantizedKeys, tuple[torch.Tensor, torch.Tensor] | None]:
        """``keys`` for a quantized pool (``k_rows``/``v_rows``: the layer's, ``pool.kv_rows``): its
        copies brought up to date (a rebuild gathers the pool's codes, an append copies the rows the
        pool stored at ``plan.new_loc``; ``defer_append``: the kernel copies them), as
        ``QuantizedKeys``, with the shared prefix's K^T and V (dequantized once per rebuild) or None."""
        codes_k, codes_v = self.k[layer_id], self.v[layer_id]
        if plan.rebuild:
            assert plan.mask is not None and plan.own_flat is not None and plan.prefix_loc is not None
            if codes_k is None or codes_v is None:
                keys = mirror_codes.new_copies(k_rows, v_rows, plan.mask.shape[0], self.cap)
                self.k[layer_id], self.v[layer_id] = keys.k, keys.v
                self.k_scales[layer_id], self.v_scales[layer_id] = keys.k_scales, keys.v_scales
            else:
                keys = self._codes(layer_id, k_rows, v_rows)
            mirror_codes.gather(keys, k_rows, v_rows, plan.own_flat, plan.width)
            if plan.prefix_len:
                self._keep_prefix(layer_id, k_rows.gather(plan.prefix_loc), v_rows.gather(plan.prefix_loc))
        else:
            keys = self._codes(layer_id, k_rows, v_rows)
            if not defer_append:
                assert plan.append_pos is not None and plan.new_loc is not None
                mirror_codes.append(keys, k_rows, v_rows, plan.new_loc, plan.append_pos, plan.kv_row)
        self.layers_done += 1
        return keys, self._prefix(layer_id, plan)

    def _codes(self, layer_id: int, k_rows: KVRows, v_rows: KVRows) -> QuantizedKeys:
        """Layer ``layer_id``'s quantized copies as they are."""
        codes_k, codes_v = self.k[layer_id], self.v[layer_id]
        assert codes_k is not None and codes_v is not None
        return QuantizedKeys(
            k_rows.format,
            codes_k,
            codes_v,
            self.k_scales[layer_id],
            self.v_scales[layer_id],
            k_rows.scale,
            v_rows.scale,
        )
