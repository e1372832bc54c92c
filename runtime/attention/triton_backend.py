"""Attention through the Triton kernels over the paged KV pool: the default on cuda.

``init_forward_metadata`` plans once per forward and every layer reuses the plan:

- decode: ``kv_indptr``/``kv_indices`` over each request's full sequence (the new token's
  slot is already in ``req_to_token``), and ``num_kv_splits`` per request for split-K;
- extend / mixed: ``kv_indptr``/``kv_indices`` over each request's cached prefix only,
  ``qo_indptr`` over its new tokens (the kernel reads those from the packed k/v).

``kv_indices`` is built on the device by a Triton kernel from ``req_to_token``; the host
only needs the batch's host-side length lists (no device sync when they are filled).

On cpu the kernels run under Triton's interpreter: constructing the backend switches it
on when ``triton`` has not been imported yet, else it must already be on (see
``triton_ops.common``). The kernel modules are imported here, after that check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runtime.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.attention.triton_ops.common import prepare_triton_for_device
from runtime.forward_batch import ForwardBatch

DEFAULT_MAX_KV_SPLITS = 8


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


class TritonAttnBackend(AttentionBackend):
    """Same constructor as TorchNativeAttnBackend: ``cls(model_runner)``.

    The runner (when given) supplies the device and the head counts used to plan
    ``num_kv_splits``; without one they are read from the batch's KV pool.
    """

    def __init__(self, model_runner: Any = None, max_kv_splits: int = DEFAULT_MAX_KV_SPLITS) -> None:
        if max_kv_splits < 1:
            raise ValueError(f"max_kv_splits must be >= 1, got {max_kv_splits}")
        self.model_runner = model_runner
        self.max_kv_splits = max_kv_splits
        self.num_heads: int | None = getattr(model_runner, "num_heads", None)
        self.num_kv_heads: int | None = getattr(model_runner, "num_kv_heads", None)
        device = getattr(model_runner, "device", None)
        self._kernels: Any = None
        if device is not None:
            self._load_kernels(torch.device(device))

    def _load_kernels(self, device: torch.device) -> Any:
        if self._kernels is None:
            prepare_triton_for_device(device)
            from runtime.attention import triton_ops

            self._kernels = triton_ops
        return self._kernels

    # ---- planning (once per forward) -------------------------------------------------

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        device = batch.req_pool_indices.device
        ops = self._load_kernels(device)
        bs = batch.batch_size
        req_to_token = batch.req_to_token_pool.req_to_token
        if batch.forward_mode.is_decode():
            kv_lens, kv_lens_cpu = batch.seq_lens, _host_list(batch.seq_lens_cpu, batch.seq_lens)
        else:
            kv_lens, kv_lens_cpu = batch.prefix_lens, _host_list(batch.prefix_lens_cpu, batch.prefix_lens)
        kv_indptr = _indptr(kv_lens, device)
        kv_indices = torch.empty(sum(kv_lens_cpu), dtype=torch.int32, device=device)
        ops.create_kv_indices(req_to_token, batch.req_pool_indices, kv_lens, kv_indptr, None, kv_indices)

        if batch.forward_mode.is_decode():
            num_kv_heads = self.num_kv_heads or batch.token_to_kv_pool.kv_heads
            num_heads = self.num_heads or num_kv_heads
            num_kv_splits = ops.get_num_kv_splits(batch.seq_lens, num_heads, num_kv_heads, self.max_kv_splits, device)
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

    # ---- per layer -------------------------------------------------------------------

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayerSpec, batch: ForwardBatch
    ) -> torch.Tensor:
        pool = batch.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        meta: TritonAttnMetadata = batch.attn_metadata
        ops = self._kernels
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
                meta.kv_indptr,
                meta.kv_indices,
                meta.attn_logits,
                meta.attn_lse,
                meta.num_kv_splits,
                self.max_kv_splits,
                layer.scaling,
            )
        else:
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
                meta.kv_indptr,
                meta.kv_indices,
                meta.max_len_extend,
                layer.scaling,
            )
        return out


def _indptr(lens: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Exclusive prefix sum ``[0, l0, l0+l1, ...]`` as int32 on ``device``."""
    indptr = torch.zeros(int(lens.shape[0]) + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(lens, dim=0)
    return indptr


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _host_list(cached: list[int], tensor: torch.Tensor) -> list[int]:
    """The batch's host copy when the builder filled it, else one device->host copy."""
    return list(cached) if len(cached) == int(tensor.shape[0]) else [int(x) for x in tensor.tolist()]
