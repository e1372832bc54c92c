"""Gemma 2: the Llama decoder with Gemma's choices and its sandwich norms.

What differs from Llama, and where each difference lives:
- the family's layer choices (``runtime.checkpoints.families``): gated GELU (tanh approximation)
  and the unit-offset RMSNorm ``x / rms(x) * (1 + w)``, built by the shared layers;
- each layer norms the attention and MLP outputs again before they join the residual stream
  (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the MLP has its own input
  norm (``pre_feedforward_layernorm``): ``GemmaDecoderLayer``;
- the embeddings are scaled by sqrt(hidden) (rounded to the model's dtype first, as transformers
  does): ``GemmaModel.embed``;
- the softmax scale is ``query_pre_attn_scalar ** -0.5`` and attention scores and final logits are
  soft-capped (the family's own config, ``gemma_config.GemmaConfig``): ``GemmaAttention``'s spec
  carries the scale and the first cap (every backend applies it), ``Gemma2ForCausalLM.forward`` the
  second;
- windowed and full layers alternate (the family's window rule in ``model_config``); a family may
  give its windowed layers their own RoPE (Gemma 3): ``GemmaModel.run_layers`` hands each layer its
  type's rotary inputs.

Each layer declares what it is (``GemmaDecoderLayer.describe``: four norms, Gemma's norm form and
activation, any soft-cap and window), and a device's whole-layer kernels take only the choices they
implement: the CPU's one-call decode stack takes Gemma 3's (its per-layer rotary tables from
``rope_tables``, its windowed layers' keys read from their pool), not Gemma 2's soft-capped attention.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from runtime.engine.attention.base import AttentionBackend
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.layers.choices import norm_layer
from runtime.engine.layers.rotary import RotaryEmbedding
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.gemma_config import GemmaConfig
from runtime.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from runtime.engine.ops import DeviceOps, LayerStack, RopeInputs
from runtime.engine.ops.layer_stack import DecoderLayerWeights, LayerDescription


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma's softmax scale and attention-score soft-cap in its spec."""

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, dtype, ops)
        gemma = config.family_config_as(GemmaConfig)
        self.spec = replace(
            self.spec, scaling=gemma.attention_scaling(config.head_dim), logit_softcap=gemma.attn_logit_softcap
        )


class GemmaDecoderLayer(LlamaDecoderLayer):
    """The Llama layer with Gemma's extra norms around attention and MLP outputs."""

    attention_class = GemmaAttention

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> None:
        super().__init__(config, layer_id, tp_rank, tp_size, dtype, ops)
        self.pre_feedforward_layernorm = norm_layer(config, config.hidden_size, dtype, ops)
        self.post_feedforward_layernorm = norm_layer(config, config.hidden_size, dtype, ops)
        gemma = config.family_config_as(GemmaConfig)
        # the model's rotary inputs this layer takes (GemmaModel.rope_tables: 1, the windowed layers' own)
        self.rope_table = 1 if gemma.rope_local is not None and gemma.local_layers[layer_id] else 0

    def forward(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As ``LlamaDecoderLayer.forward``: the stream is ``residual + hidden`` (``residual`` None
        before the first layer), and each add into ``residual`` happens in place inside a norm."""
        hidden, residual = self.attend(rope, hidden, residual, batch, backend)
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual

    def describe(self) -> LayerDescription:
        """The Llama layer's description with Gemma's four norms per layer (the sandwich placement)."""
        return replace(LlamaDecoderLayer.describe(self), norm_placement="sandwich")

    def decode_weights(self) -> DecoderLayerWeights:
        """The Llama layer's record with the two MLP norms and the layer's rotary table (``forward``:
        ``post_attention_layernorm`` norms the attention output alone, ``pre_feedforward_layernorm``
        the residual stream after its add, ``post_feedforward_layernorm`` the MLP's output)."""
        pre, post = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre.eps != self.post_attention_layernorm.eps or post.eps != pre.eps:
            raise ValueError("a Gemma layer's attention and MLP norms share one eps")
        record = LlamaDecoderLayer.decode_weights(self)
        return replace(record, pre_mlp_norm=pre.weight, post_mlp_norm=post.weight, rope_table=self.rope_table)


class GemmaModel(LlamaModel):
    """Gemma's decoder stack: scaled embeddings, sandwich-norm layers, per-layer-type RoPE."""

    layer_class = GemmaDecoderLayer

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps) -> None:
        super().__init__(config, tp_rank, tp_size, dtype, ops)
        # sqrt(hidden) as transformers applies it: an fp32 value rounded to the model's dtype
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32).to(dtype))
        gemma = config.family_config_as(GemmaConfig)
        self.rotary_local: RotaryEmbedding | None = None
        if gemma.rope_local is not None:
            self.rotary_local = RotaryEmbedding(config.head_dim, config.context_len, gemma.rope_local)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def rope_tables(self, rope: RopeInputs, dtype: torch.dtype) -> tuple[RopeInputs, ...]:
        """``(rope,)``, or ``(rope, the windowed layers' own)`` where the config gives them one (each
        layer's ``rope_table`` says which it takes)."""
        if self.rotary_local is None:
            return (rope,)
        return rope, self.ops.rope(self.rotary_local, rope.positions, dtype)

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers one by one, each with its type's rotary inputs (``rope_tables``, made once here)."""
        tables = self.rope_tables(rope, hidden.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            hidden, residual = layer(tables[layer.rope_table], hidden, residual, batch, backend)
        assert residual is not None, "model has no layers"
        return hidden, residual


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (and, through its subclass, Gemma 3 text): see the module docstring."""

    model_class = GemmaModel

    def rope_tables(self, rope: RopeInputs, dtype: torch.dtype) -> tuple[RopeInputs, ...]:
        model = self.model
        assert isinstance(model, GemmaModel)
        return model.rope_tables(rope, dtype)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, layer_stack: LayerStack | None = None
    ) -> torch.Tensor:
        """fp32 logits at ``batch.logit_rows()``, soft-capped where the config says
        (``cap * tanh(logits / cap)``, the operations transformers does)."""
        logits = super().forward(batch, backend, layer_stack)
        cap = self.config.family_config_as(GemmaConfig).final_logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits / cap) * cap
