"""OLMoE: the sparse Llama decoder (``qwen_moe``) with q/k norms over the whole projection.

Every layer is sparse; the top-k weights are not renormalised unless ``norm_topk_prob`` says so (the
family table's ``MoeKeys``). Its attention differs from Llama's in two ways, both before RoPE: q and
k are each RMS-normed over the whole projection (every head's dims together: ``q_norm`` has
``num_heads * head_dim`` weights), and q, k and v may be clamped to ``+-clip_qkv`` after that
(the family's own config, ``olmoe_config.OlmoeConfig``).

Under tensor parallelism a rank holds only some heads, so the norm gathers the rank's q (or k)
from every rank, norms the whole projection with the full weight and keeps this rank's part: the
same values as one rank computes (the KV heads a rank shares with others when ``tp_size`` exceeds
them are counted once).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from runtime.engine.distributed import tensor_model_parallel_all_gather
from runtime.engine.layers.norm import RMSNorm
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.llama import LlamaAttention
from runtime.engine.models.olmoe_config import OlmoeConfig
from runtime.engine.models.qwen_moe import MoeDecoderLayer, MoeModel, QwenMoeForCausalLM
from runtime.engine.ops import DeviceOps
from runtime.engine.ops.layer_stack import LayerDescription


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole q or k projection (``heads * head_dim`` features) for a TP rank holding
    ``local_size`` of them from ``local_start``; ``replicas``: how many consecutive ranks hold the
    same heads (KV heads shared when ``tp_size`` exceeds their number)."""

    def __init__(
        self,
        config: ModelConfig,
        full_size: int,
        local: tuple[int, int],
        tp_size: int,
        replicas: int,
        dtype: torch.dtype,
        ops: DeviceOps,
    ) -> None:
        super().__init__(full_size, config.rms_norm_eps, params_dtype=dtype, ops=ops)
        self.local_start, self.local_size = local
        self.tp_size, self.replicas = tp_size, replicas

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        assert residual is None, "a q/k norm has no residual stream"
        if self.tp_size == 1:
            return self.ops.rms_norm(x, self.weight, self.eps)
        parts = tensor_model_parallel_all_gather(x.contiguous(), self.tp_size, dim=-1)
        whole = parts.view(x.shape[0], self.tp_size, self.local_size)[:, :: self.replicas].reshape(x.shape[0], -1)
        normed = self.ops.rms_norm(whole, self.weight, self.eps)
        return normed[:, self.local_start : self.local_start + self.local_size]


class OlmoeAttention(LlamaAttention):
    """Llama attention with OLMoE's whole-projection q/k norms and optional q/k/v clamp."""

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, dtype, ops)
        qkv, d = self.qkv_proj, config.head_dim
        kv_replicas = max(1, tp_size // config.num_key_value_heads)
        q_local, kv_local = (tp_rank * qkv.q_size, qkv.q_size), (qkv.kv_head_start * d, qkv.kv_size)
        self.q_norm = ProjectionRMSNorm(config, config.num_attention_heads * d, q_local, tp_size, 1, dtype, ops)
        self.k_norm = ProjectionRMSNorm(
            config, config.num_key_value_heads * d, kv_local, tp_size, kv_replicas, dtype, ops
        )
        self.clip = config.family_config_as(OlmoeConfig).clip_qkv

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        assert self.q_norm is not None and self.k_norm is not None
        q = self.q_norm(qkv[:, :q_size])  # new tensors
        k = self.k_norm(qkv[:, q_size : q_size + kv_size])
        v = qkv[:, q_size + kv_size :]
        if self.clip is not None:
            for x in (q, k, v):
                x.clamp_(min=-self.clip, max=self.clip)
        shape = (t, -1, self.head_dim)
        return q.reshape(shape), k.reshape(shape), v.view(shape)


class OlmoeDecoderLayer(MoeDecoderLayer):
    attention_class = OlmoeAttention

    def describe(self) -> LayerDescription:
        """The sparse layer's description with OLMoE's q/k norms over the whole projection and its clamp."""
        attn = self.self_attn
        assert isinstance(attn, OlmoeAttention)
        return replace(MoeDecoderLayer.describe(self), qk_norm="projection", qkv_clip=attn.clip)


class OlmoeModel(MoeModel):
    layer_class = OlmoeDecoderLayer


class OlmoeForCausalLM(QwenMoeForCausalLM):
    """OLMoE (see the module docstring)."""

    model_class = OlmoeModel
