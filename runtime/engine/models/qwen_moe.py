"""Qwen2-MoE and Qwen3-MoE: the Llama decoder whose MLP is sparse in most layers.

Each family's attention is its dense sibling's (Qwen2-MoE: q/k/v biases; Qwen3-MoE: per-head q/k
norms, read from the family table by the Llama attention). What is theirs: a layer's MLP is the
sparse block (``runtime.engine.layers.moe``, with Qwen2-MoE's gated shared expert where the config
sizes one) unless the config keeps it dense (``mlp_only_layers``, ``decoder_sparse_step``: read into
``MoeConfig.sparse_layers`` by the families' own config, ``moe_config``), in which case it is the dense
gated MLP of ``intermediate_size``.
Mixtral and OLMoE reuse these classes (``mixtral``, ``olmoe``).

Each layer declares its MLP (``MoeDecoderLayer.describe``: routed experts, or dense) and names
its router and experts' linears for a device's whole-layer kernels (``decode_weights``: the CPU's
one-call decode stack runs the routed experts in C, ``csrc/moe_mlp.c``, on the same plans the
layers' ``DeviceOps.moe_experts`` reads, prepacked or kept quantized).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime.engine.layers.moe import SparseMoeMLP
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from runtime.engine.models.moe_config import MoeFamilyConfig
from runtime.engine.ops import DeviceOps
from runtime.engine.ops.layer_stack import DecoderLayerWeights, LayerDescription


class MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with the sparse MLP where the config makes the layer sparse."""

    def make_mlp(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> nn.Module:
        moe = config.family_config_as(MoeFamilyConfig).moe
        if moe is not None and moe.sparse_layers[layer_id]:
            return SparseMoeMLP(config, moe, tp_rank, tp_size, dtype, ops)
        return super().make_mlp(config, layer_id, tp_rank, tp_size, dtype, ops)

    def describe(self) -> LayerDescription:
        """A dense layer's description (``LlamaDecoderLayer.describe``), or for a sparse one the
        routed experts: top-k, whether their weights are renormalised, a shared expert."""
        mlp = self.mlp
        if not isinstance(mlp, SparseMoeMLP):
            return LlamaDecoderLayer.describe(self)
        return self.describe_with_mlp(
            activation=mlp.activation,
            mlp="experts",
            experts_top_k=mlp.moe.top_k,
            experts_renormalize=mlp.moe.renormalize,
            shared_expert=mlp.shared_expert is not None,
        )

    def decode_weights(self) -> DecoderLayerWeights:
        """A dense layer's record, or for a sparse one its router and experts' linears."""
        mlp = self.mlp
        if not isinstance(mlp, SparseMoeMLP):
            return LlamaDecoderLayer.decode_weights(self)
        return self.decode_weights_with_mlp(experts=mlp.routed_experts())


class MoeModel(LlamaModel):
    layer_class = MoeDecoderLayer


class QwenMoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE / Qwen3-MoE (see the module docstring)."""

    model_class = MoeModel
