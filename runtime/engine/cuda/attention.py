"""Attention through the Triton kernels over the paged KV pool: the default on cuda.

``init_forward_metadata`` plans once per forward and every layer reuses the plan:

- decode: ``kv_indptr``/``kv_indices`` over each request's full sequence (the new token's
  slot is already in ``req_to_token``), and ``num_kv_splits`` per request for split-K;
- extend / mixed: ``kv_indptr``/``kv_indices`` over each request's cached prefix only,
  ``qo_indptr`` over its new tokens (the kernel reads those from the packed k/v).

``kv_indices`` is built on the device by a Triton kernel from ``req_to_token``; the host
only needs the batch's host-side length lists (no device sync when they are filled).

Windowed layers (``AttentionLayerSpec.sliding_window = W``) get plans of their own, made once
per forward for each window: decode reads each request's last ``min(seq_len, W)`` keys
(``kv_start_idx`` of the indices kernel), extend the last ``W - 1`` cached keys at most,
and the extend kernel masks each query's window. Slots are translated into the KV pool's
SWA slots when the pool keeps windowed layers apart (``translate_swa``).

Soft-capped layers (``AttentionLayerSpec.logit_softcap``, Gemma 2) pass their cap to the kernels
(``logit_cap``, a compile-time constant: one specialisation per cap value, captured into a CUDA
graph like any other); the plans do not depend on it.

A quantized pool (``--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2``, or bf16 under an fp32 model) is
read by the same kernels, dequantizing as they load (``runtime.engine.cuda.kv_quant``); the store
(``TritonOps.store_kv``) quantizes. An extend's new tokens attend to their stored values
(``MHATokenToKVPool.stored_values``), as torch_native's do and as every later step reads them.

Under CUDA graphs (decode only) the plan lives in buffers allocated once by
``init_cuda_graph_state``: capture hands the kernels views of them, replay rewrites them
in place with the same planning kernels as the eager path. Padded rows of a graph batch
are ordinary requests of length 1 to these kernels.

On cpu the kernels run under Triton's interpreter: constructing the backend switches it
on when ``triton`` has not been imported yet, else it must already be on (see
``runtime.engine.cuda.triton_common``). The kernel modules are imported here, after that check.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.cuda.triton_common import interpreter_requested, prepare_triton_for_device
from runtime.engine.forward_batch import ForwardBatch

DEFAULT_MAX_KV_SPLITS = 8
# Under Triton's interpreter (CPU tests) every program of the (bs, heads, max_kv_splits) grid runs
# one after another in Python, the empty splits too, and get_num_kv_splits plans 1-2 parts on a
# CPU anyway: two split slots keep split-K exercised at a quarter of the interpreted grid.
INTERPRETED_MAX_KV_SPLITS = 2


@dataclass
class TritonAttnMetadata:
    """One forward's plan; tensors live on the model's device and die with the batch."""

    is_decode: bool
    kv_indptr: torch.Tensor  # int32 [bs + 1]
    kv_indices: torch.Tensor  # int32 [kv_indptr[bs]]: KV slots (decode: whole sequence; extend: prefix)
    qo_indptr: torch.Tensor | None = None  # int32 [bs + 1]: extend only
    max_len_extend: int = 0  # extend only
    num_kv_splits: torch.Tensor | None = None  # int32 [bs]: decode only
    # Decode scratch, shared by every layer of the forward (allocated by the first layer).
    attn_logits: torch.Tensor | None = None  # fp32 [bs, H, max_kv_splits, Dv]
    attn_lse: torch.Tensor | None = None  # fp32 [bs, H, max_kv_splits]
    # Windowed layers' key ranges by window (kv_indptr, kv_indices, num_kv_splits: see _WindowPlan).
    windowed: dict[int, "_WindowPlan"] = field(default_factory=dict)


@dataclass
class _WindowPlan:
    """The keys windowed layers read: decode, each request's last W; extend, its last W - 1 cached."""

    kv_indptr: torch.Tensor  # int32 [bs + 1]
    kv_indices: torch.Tensor  # int32: slots (SWA-pool slots when the pool keeps those layers apart)
    num_kv_splits: torch.Tensor | None = None  # int32 [bs]: decode only


@dataclass
class _GraphWindowBuffers:
    """A window's ``_WindowPlan`` buffers for CUDA graphs (decode only: its split counts too)."""

    kv_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indices: torch.Tensor  # int32 [min(max_kv_tokens, max_bs * W)]
    num_kv_splits: torch.Tensor  # int32 [max_bs]


@dataclass
class _GraphPlanBuffers:
    """The decode plan's fixed buffers for CUDA graphs (sized for the largest captured batch)."""

    kv_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indices: torch.Tensor  # int32 [max_kv_tokens]
    num_kv_splits: torch.Tensor  # int32 [max_bs]
    attn_logits: torch.Tensor  # fp32 [max_bs, H, max_kv_splits, Dv]
    attn_lse: torch.Tensor  # fp32 [max_bs, H, max_kv_splits]
    windowed: dict[int, _GraphWindowBuffers] = field(default_factory=dict)  # the same per window


class TritonAttnBackend(AttentionBackend):
    """Same constructor as TorchNativeAttnBackend: ``cls(model_runner)``.

    The runner (when given) supplies the device and the head counts used to plan
    ``num_kv_splits``; without one they are read from the batch's KV pool.
    """

    supports_cuda_graph = True

    def __init__(self, model_runner: Any = None, max_kv_splits: int | None = None) -> None:
        if max_kv_splits is None:
            max_kv_splits = INTERPRETED_MAX_KV_SPLITS if interpreter_requested() else DEFAULT_MAX_KV_SPLITS
        if max_kv_splits < 1:
            raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")
        self.model_runner = model_runner
        self.max_kv_splits = max_kv_splits
        self.num_heads: int | None = getattr(model_runner, "num_heads", None)
        self.num_kv_heads: int | None = getattr(model_runner, "num_kv_heads", None)
        self.head_dim: int | None = getattr(model_runner, "head_dim", None)
        layer_windows = getattr(getattr(model_runner, "model_config", None), "layer_windows", ()) or ()
        self.windows: list[int] = sorted({w for w in layer_windows if w is not None})  # planned up front
        device = getattr(model_runner, "device", None)
        self._kernels: Any = None
        self._graph_state: _GraphPlanBuffers | None = None
        if device is not None:
            self._load_kernels(torch.device(device))

    def _load_kernels(self, device: torch.device) -> Any:
        if self._kernels is None:
            prepare_triton_for_device(device)
            from runtime.engine.cuda import attention_kernels

            self._kernels = attention_kernels
        return self._kernels

    # ---- planning (once per forward) -------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.req_pool_indices.device
        ops = self._load_kernels(device)
        req_to_token = batch.req_to_token_pool.req_to_token
        if batch.forward_mode.is_decode():
            kv_lens, kv_lens_cpu = batch.seq_lens, _host_list(batch.seq_lens_cpu, batch.seq_lens)
        else:
            kv_lens, kv_lens_cpu = batch.prefix_lens, _host_list(batch.prefix_lens_cpu, batch.prefix_lens)
        kv_indptr = _indptr(kv_lens, device)
        kv_indices = torch.empty(sum(kv_lens_cpu), dtype=torch.int32, device=device)
        ops.create_kv_indices(req_to_token, batch.req_pool_indices, kv_lens, kv_indptr, None, kv_indices)

        if batch.forward_mode.is_decode():
            num_kv_splits = self._num_kv_splits(batch)
            batch.attn_metadata = TritonAttnMetadata(True, kv_indptr, kv_indices, num_kv_splits=num_kv_splits)
        else:
            ext_lens_cpu = _host_list(batch.extend_lens_cpu, batch.extend_lens)
            batch.attn_metadata = TritonAttnMetadata(
                False,
                kv_indptr,
                kv_indices,
                qo_indptr=_indptr(batch.extend_lens, device),
                max_len_extend=max(ext_lens_cpu, default=0),
            )
        for window in self.windows:
            self._window_plan(batch, window)

    def _window_plan(self, batch: ForwardBatch, window: int) -> _WindowPlan:
        """The key ranges of layers with this window (made once per forward, kept in the metadata)."""
        meta: TritonAttnMetadata = batch.attn_metadata
        if window in meta.windowed:
            return meta.windowed[window]
        device = batch.req_pool_indices.device
        if meta.is_decode:  # the query at seq_len - 1 sees keys from seq_len - W on
            ends, ends_cpu = batch.seq_lens, _host_list(batch.seq_lens_cpu, batch.seq_lens)
            reach = window
        else:  # the first new token (at prefix_len) sees cached keys from prefix_len - W + 1 on
            ends, ends_cpu = batch.prefix_lens, _host_list(batch.prefix_lens_cpu, batch.prefix_lens)
            reach = window - 1
        used = sum(min(e, reach) for e in ends_cpu)
        plan = _WindowPlan(
            torch.zeros(len(ends_cpu) + 1, dtype=torch.int32, device=device),
            torch.empty(used, dtype=torch.int32, device=device),
        )
        lens = self._fill_window_plan(batch, ends, reach, used, plan)
        plan.num_kv_splits = self._num_kv_splits(batch, lens) if meta.is_decode else None
        meta.windowed[window] = plan
        return plan

    def _fill_window_plan(
        self, batch: ForwardBatch, ends: torch.Tensor, reach: int, used: int, plan: _WindowPlan
    ) -> torch.Tensor:
        """Write, in place, ``plan``'s ranges of each request's last ``reach`` keys before ``ends``
        (``used`` slots in all); returns their lengths. Shared by the eager plan and graph replay."""
        starts = (ends - reach).clamp(min=0)
        lens = ends - starts
        plan.kv_indptr[1:].copy_(torch.cumsum(lens, dim=0))
        self._kernels.create_kv_indices(
            batch.req_to_token_pool.req_to_token, batch.req_pool_indices, lens, plan.kv_indptr, starts, plan.kv_indices
        )
        _translate_swa(batch, plan.kv_indices[:used])
        return lens

    def _num_kv_splits(self, batch: ForwardBatch, kv_lens: torch.Tensor | None = None) -> torch.Tensor:
        num_kv_heads = self.num_kv_heads or batch.token_to_kv_pool.kv_heads
        num_heads = self.num_heads or num_kv_heads
        lens = batch.seq_lens if kv_lens is None else kv_lens
        return self._kernels.get_num_kv_splits(lens, num_heads, num_kv_heads, self.max_kv_splits, lens.device)

    # ---- planning under CUDA graphs (decode) -----------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_kv_tokens: int) -> None:
        device = getattr(self.model_runner, "device", None)
        if device is None or self.num_heads is None or self.head_dim is None:
            raise RuntimeError("CUDA graph state needs a model runner (device, num_heads, head_dim)")
        self._load_kernels(torch.device(device))
        i32 = dict(dtype=torch.int32, device=device)
        scratch = (max_bs, self.num_heads, self.max_kv_splits, self.head_dim)
        self._graph_state = _GraphPlanBuffers(
            kv_indptr=torch.zeros(max_bs + 1, **i32),
            kv_indices=torch.zeros(max_kv_tokens, **i32),
            num_kv_splits=torch.ones(max_bs, **i32),
            attn_logits=torch.zeros(scratch, dtype=torch.float32, device=device),
            attn_lse=torch.zeros(scratch[:3], dtype=torch.float32, device=device),
            windowed={
                w: _GraphWindowBuffers(
                    torch.zeros(max_bs + 1, **i32),
                    torch.zeros(min(max_kv_tokens, max_bs * w), **i32),
                    torch.ones(max_bs, **i32),
                )
                for w in self.windows
            },
        )

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        state = self._graph_state
        if state is None:
            raise RuntimeError("init_cuda_graph_state must run before capture")
        if not batch.forward_mode.is_decode():
            raise ValueError("the triton backend captures decode batches only")
        bs = batch.batch_size
        batch.attn_metadata = TritonAttnMetadata(
            True,
            state.kv_indptr[: bs + 1],
            state.kv_indices,  # whole buffer: the kernels only read kv_indptr's ranges of it
            num_kv_splits=state.num_kv_splits[:bs],
            attn_logits=state.attn_logits[:bs],
            attn_lse=state.attn_lse[:bs],
            windowed={
                w: _WindowPlan(plan.kv_indptr[: bs + 1], plan.kv_indices, plan.num_kv_splits[:bs])
                for w, plan in state.windowed.items()
            },
        )
        self.init_forward_metadata_replay_cuda_graph(batch)  # valid contents for the warm-up runs

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        meta: TritonAttnMetadata = batch.attn_metadata
        seq_lens = _host_list(batch.seq_lens_cpu, batch.seq_lens)
        total = sum(seq_lens)
        if total > meta.kv_indices.shape[0]:
            raise ValueError(f"{total} KV tokens exceed the graph plan's {meta.kv_indices.shape[0]}")
        meta.kv_indptr[1:].copy_(torch.cumsum(batch.seq_lens, dim=0))
        self._kernels.create_kv_indices(
            batch.req_to_token_pool.req_to_token,
            batch.req_pool_indices,
            batch.seq_lens,
            meta.kv_indptr,
            None,
            meta.kv_indices,
        )
        assert meta.num_kv_splits is not None
        meta.num_kv_splits.copy_(self._num_kv_splits(batch))
        for window, plan in meta.windowed.items():
            lens = self._fill_window_plan(batch, batch.seq_lens, window, sum(min(n, window) for n in seq_lens), plan)
            assert plan.num_kv_splits is not None
            plan.num_kv_splits.copy_(self._num_kv_splits(batch, lens))

    # ---- per layer -------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        self.store_kv(k, v, layer, batch)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        meta: TritonAttnMetadata = batch.attn_metadata
        ops = self._kernels
        kv_indptr, kv_indices, num_kv_splits = meta.kv_indptr, meta.kv_indices, meta.num_kv_splits
        if layer.sliding_window is not None:
            plan = self._window_plan(batch, layer.sliding_window)
            kv_indptr, kv_indices, num_kv_splits = plan.kv_indptr, plan.kv_indices, plan.num_kv_splits
        # The pool's format and this layer's fp8 scales (fixed after load: plain arguments of each
        # layer's launches, captured into a CUDA graph as they are).
        lid = layer.layer_id
        quant = dict(kv_format=pool.format, k_scale=pool.k_scales[lid], v_scale=pool.v_scales[lid])
        q = _last_dim_contiguous(q.reshape(-1, layer.num_heads, layer.head_dim))
        out = q.new_empty(q.shape[0], layer.num_heads, layer.head_dim)
        if meta.is_decode:
            bs = q.shape[0]
            scratch_shape = (bs, layer.num_heads, self.max_kv_splits, layer.head_dim)
            if meta.attn_logits is None or tuple(meta.attn_logits.shape) != scratch_shape:
                meta.attn_logits = torch.empty(scratch_shape, dtype=torch.float32, device=q.device)
                meta.attn_lse = torch.empty(scratch_shape[:3], dtype=torch.float32, device=q.device)
            ops.decode_attention_fwd(
                q,
                k_buf,
                v_buf,
                out,
                kv_indptr,
                kv_indices,
                meta.attn_logits,
                meta.attn_lse,
                num_kv_splits,
                self.max_kv_splits,
                layer.scaling,
                logit_cap=layer.logit_softcap or 0.0,
                **quant,
            )
        else:
            # The new tokens attend to their stored values, as every later step reads them (the same
            # rule as torch_native's: a prompt's answer does not depend on how its prefix got cached).
            k, v = pool.stored_values(lid, k, v)
            k = _last_dim_contiguous(k.reshape(-1, layer.num_kv_heads, layer.head_dim))
            v = _last_dim_contiguous(v.reshape(-1, layer.num_kv_heads, layer.head_dim))
            ops.extend_attention_fwd(
                q,
                k,
                v,
                out,
                k_buf,
                v_buf,
                meta.qo_indptr,
                kv_indptr,
                kv_indices,
                meta.max_len_extend,
                layer.scaling,
                layer.sliding_window,
                logit_cap=layer.logit_softcap or 0.0,
                **quant,
            )
        return out


def _indptr(lens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Exclusive prefix sum ``[0, l0, l0+l1, ...]`` as int32 on ``device``."""
    indptr = torch.zeros(int(lens.shape[0]) + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(lens, dim=0)
    return indptr


def _translate_swa(batch: ForwardBatch, kv_indices: torch.Tensor) -> None:
    """Full-pool slots -> the pool's SWA slots, in place, when the pool keeps windowed layers apart."""
    translate = getattr(batch.token_to_kv_pool, "translate_swa", None)
    if translate is not None and kv_indices.numel():
        kv_indices.copy_(translate(kv_indices))


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _host_list(cached: list[int], tensor: torch.Tensor) -> list[int]:
    """The batch's host copy when the builder filled it, else one device->host copy."""
    return list(cached) if len(cached) == int(tensor.shape[0]) else [int(x) for x in tensor.tolist()]
