"""Qwen2-MoE and Qwen3-MoE: the Llama decoder whose MLP is sparse in most layers.

Each family's attention is its dense sibling's (Qwen2-MoE: q/k/v biases; Qwen3-MoE: per-head q/k
norms, read from the family table by the Llama attention). What is theirs: a layer's MLP is the
sparse block (``runtime.engine.layers.moe``, with Qwen2-MoE's gated shared expert where the config
sizes one) unless the config keeps it dense (``mlp_only_layers``, ``decoder_sparse_step``: read into
``MoeConfig.sparse_layers`` by the families' own config, ``moe_config``), in which case it is the dense
gated MLP of ``intermediate_size``.
Mixtral and OLMoE reuse these classes (``mixtral``, ``olmoe``).

The sparse layers are not of the pre-norm dense form a device's one-call decode stack reads, so the
layers run one by one on every device (each expert's projections still take the device's prepacked
or kept-quantized weights through ``DeviceOps.moe_experts``).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.layers.moe import SparseMoeMLP
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from runtime.engine.models.moe_config import MoeFamilyConfig
from runtime.engine.ops import DecoderLayerWeights, DeviceOps


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with the sparse MLP where the config makes the layer sparse."""

    def make_mlp(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> nn.Module:
        moe = config.family_config_as(MoeFamilyConfig).moe
        if moe is not None and moe.sparse_layers[layer_id]:
            return SparseMoeMLP(config, moe, tp_rank, tp_size, dtype, ops)
        return super().make_mlp(config, layer_id, tp_rank, tp_size, dtype, ops)


class MoeModel(LlamaModel):
    layer_class = MoeDecoderLayer


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE / Qwen3-MoE (see the module docstring)."""

    model_class = MoeModel

    def decode_weights(self) -> list[DecoderLayerWeights] | None:
        return None  # sparse MLPs: not the one-call stack's dense form
