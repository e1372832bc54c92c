"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over packed tokens.

The four architectures differ only in switches read from ModelConfig (each family's entry in
``runtime.checkpoints.families``): Qwen2 has q/k/v biases, Qwen3 normalises q and k per head
before RoPE and may set head_dim explicitly, Llama 3 uses llama3 RoPE scaling, and any of them
may tie the LM head to the embedding. The MLP's activation and the norm form are the family's
layer choices (``runtime.engine.layers.choices``). A family that differs only in such choices
reuses these classes by subclassing, as SGLang does.

Tokens of every request in the batch are packed back to back (``[T, hidden]``, no
padding); attention goes through the backend, which owns all per-request structure.
Logits are computed only at each request's last new token, in fp32. Every device-specific
piece of work goes through the model's ``DeviceOps`` (``runtime.engine.ops``), handed to each
layer at construction.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.layers.choices import ROPE_ROTATIONS, norm_layer
from runtime.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from runtime.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from runtime.engine.layers.mlp import GatedMLP
from runtime.engine.layers.norm import NormLayer
from runtime.engine.layers.rotary import RotaryEmbedding
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.base import CausalLM, CheckpointTargets
from runtime.engine.ops import DecoderLayerWeights, DeviceOps, LayerStack, RopeInputs, default_ops
from runtime.engine.ops.layer_stack import LayerDescription

# checkpoint sub-module name -> (our merged module name, shard id)
_STACKED: dict[str, tuple[str, object]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_id: int,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        ops: DeviceOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.qkv_bias,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
            ops=ops,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * config.head_dim,
            config.hidden_size,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
            ops=ops,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_norm: NormLayer | None = None
        self.k_norm: NormLayer | None = None
        if config.qk_norm:
            self.q_norm = norm_layer(config, config.head_dim, dtype, ops)
            self.k_norm = norm_layer(config, config.head_dim, dtype, ops)
        self._rotate = ROPE_ROTATIONS[config.rope_style]
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=config.head_dim,
            scaling=config.head_dim**-0.5,  # (a family may scale otherwise: Gemma's attention)
            sliding_window=config.layer_windows[layer_id] if config.layer_windows else None,
        )

    def forward(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> torch.Tensor:
        """``rope`` is the forward's rotary inputs from ``DeviceOps.rope`` (shared by all layers)."""
        q, k, v = self.project(hidden)
        self._rotate(self.ops, q, k, rope)  # the family's rope style (in place)
        out = backend.forward(q, k, v, self.spec, batch)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])`` of ``hidden``, q and k normed per head where
        the family norms them; q and k are owned by this forward (rotated in place next)."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # new tensors
        return q, k, v


class LlamaDecoderLayer(nn.Module):
    # the attention a subclass's family uses (OLMoE: q/k norms over the whole projection)
    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> None:
        super().__init__()
        self.self_attn = self.attention_class(config, layer_id, tp_rank, tp_size, dtype, ops)
        self.mlp = self.make_mlp(config, layer_id, tp_rank, tp_size, dtype, ops)
        self.input_layernorm = norm_layer(config, config.hidden_size, dtype, ops)
        self.post_attention_layernorm = norm_layer(config, config.hidden_size, dtype, ops)
        self.norm_form, self.rope_style, self.rotary_dim = config.norm, config.rope_style, config.rotary_dim

    def make_mlp(
        self, config: ModelConfig, layer_id: int, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> nn.Module:
        """Layer ``layer_id``'s MLP: the dense gated MLP (a mixture of experts' family gives its sparse
        layers the sparse one)."""
        return GatedMLP(
            config.hidden_size,
            config.intermediate_size,
            config.hidden_act,
            tp_rank=tp_rank,
            tp_size=tp_size,
            dtype=dtype,
            ops=ops,
        )

    def forward(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual`` (None before the first layer) is owned by the layer stack and updated in place."""
        hidden, residual = self.attend(rope, hidden, residual, batch, backend)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def attend(
        self,
        rope: RopeInputs,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        backend: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(attention output, residual)``: the pending add into the residual stream (none before
        the first layer: the embeddings become it), the input norm and attention, as every family's
        layer begins."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn(rope, hidden, batch, backend), residual

    def describe(self) -> LayerDescription:
        """What this layer computes (``runtime.engine.ops.layer_stack``): pre-norm, a dense gated MLP,
        the family's choices of norm form, activation, rope style and share, q/k norm per head,
        soft-cap and window as its config made them."""
        mlp = self.mlp
        assert isinstance(mlp, GatedMLP), "a dense layer's MLP (a sparse layer's class declares its own)"
        mlp_bias = mlp.gate_up_proj.bias is not None or mlp.down_proj.bias is not None
        return self.describe_with_mlp(activation=mlp.activation, mlp="dense", mlp_bias=mlp_bias)

    def describe_with_mlp(self, **mlp_choices: Any) -> LayerDescription:
        """The pre-norm layer's attention, norm and rotary choices as built from its config, with the
        MLP's (``mlp_choices``: the ``LayerDescription`` fields of the MLP its class builds)."""
        attn = self.self_attn
        return LayerDescription(
            norm=self.norm_form,
            norm_placement="pre",
            rope_style=self.rope_style,
            rotary_dim=self.rotary_dim,
            head_dim=attn.head_dim,
            qk_norm="head" if attn.q_norm is not None else None,
            attn_softcap=attn.spec.logit_softcap,
            window=attn.spec.sliding_window,
            qkv_bias=attn.qkv_proj.bias is not None,
            o_bias=attn.o_proj.bias is not None,
            **mlp_choices,
        )

    def decode_weights(self) -> DecoderLayerWeights:
        """This layer's tensors and linears for a device's whole-layer kernels (the CPU's one-call
        decode stack, ``runtime.engine.cpu.decode_layers``), asked once the device accepted its
        ``describe()``: what ``forward`` computes with, named."""
        mlp = self.mlp
        assert isinstance(mlp, GatedMLP), "only a dense layer has the record's form"
        return self.decode_weights_with_mlp(gate_up=mlp.gate_up_proj, down=mlp.down_proj)

    def decode_weights_with_mlp(self, **mlp_fields: Any) -> DecoderLayerWeights:
        """The pre-norm layer's record with its MLP's (``mlp_fields``: the ``DecoderLayerWeights``
        fields of the MLP its class builds)."""
        attn = self.self_attn
        q_norm, k_norm = attn.q_norm, attn.k_norm
        if (q_norm is None) != (k_norm is None) or (
            q_norm is not None and k_norm is not None and q_norm.eps != k_norm.eps
        ):
            raise ValueError("a layer's q and k norms come as a pair with one eps")
        fields: dict[str, Any] = {"gate_up": None, "down": None, **mlp_fields}
        return DecoderLayerWeights(
            description=self.describe(),
            input_norm=self.input_layernorm.weight,
            input_norm_eps=self.input_layernorm.eps,
            post_norm=self.post_attention_layernorm.weight,
            post_norm_eps=self.post_attention_layernorm.eps,
            qkv=attn.qkv_proj,
            o=attn.o_proj,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            scaling=attn.spec.scaling,
            tp_size=attn.qkv_proj.tp_size,
            q_norm=q_norm.weight if q_norm is not None else None,
            k_norm=k_norm.weight if k_norm is not None else None,
            qk_norm_eps=q_norm.eps if q_norm is not None else 0.0,
            **fields,
        )


class LlamaModel(nn.Module):
    # the decoder layer a subclass's family stacks (Gemma: the sandwich-norm layer)
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps) -> None:
        super().__init__()
        self.ops = ops
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype, ops=ops
        )
        # shared by every layer; rotates the first rotary_dim dims of each head
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.context_len, config.rope, config.rotary_dim)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, tp_rank, tp_size, dtype, ops) for i in range(config.num_hidden_layers)
        )
        self.norm = norm_layer(config, config.hidden_size, dtype, ops)

    def forward(
        self,
        batch: ForwardBatch,
        backend: AttentionBackend,
        sample_rows: torch.Tensor,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, only at ``sample_rows`` of the packed tokens.

        ``layer_stack``: the device's way of running the decoder layers, chosen by the model
        runner (``DeviceOps.layer_stack``); None: ``run_layers``, one by one."""
        hidden = self.embed(batch.input_ids)  # a fresh tensor: becomes the residual buffer
        # once, not per layer; at the table's rows (a longrope's long rows for some tokens)
        rope = self.ops.rope(self.rotary_emb, self.rotary_emb.table_positions(batch), hidden.dtype)
        hidden, residual = (layer_stack or self.run_layers)(rope, hidden, batch, backend)
        return self.norm(hidden.index_select(0, sample_rows) + residual.index_select(0, sample_rows))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of ``input_ids`` (a family may scale them)."""
        return self.embed_tokens(input_ids)

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` after every decoder layer, one by one, for the embeddings ``hidden``."""
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden, residual = layer(rope, hidden, residual, batch, backend)
        assert residual is not None, "model has no layers"
        return hidden, residual


class LlamaForCausalLM(CausalLM):
    """Parameters are created uninitialised on the current default device; load_weights fills them.

    ``ops``: the device ops every layer uses (default: ``runtime.engine.ops.default_ops`` for the
    current default device and ``dtype``).
    """

    model_class: type[LlamaModel] = LlamaModel  # the decoder stack (a family's subclass may replace it)
    # checkpoint sub-module name -> (our merged module, shard id): a family whose checkpoints store
    # the merged matrices fused (Phi-3) has none, and loads each under its own name
    stacked_checkpoint_names: dict[str, tuple[str, object]] = _STACKED

    def __init__(
        self,
        config: ModelConfig,
        tp_rank: int = 0,
        tp_size: int = 1,
        dtype: torch.dtype = torch.float32,
        ops: DeviceOps | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        ops = ops or default_ops(dtype)
        self.model = self.model_class(config, tp_rank, tp_size, dtype, ops)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_rank=tp_rank, tp_size=tp_size, params_dtype=dtype, ops=ops
        )
        if config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    @torch.inference_mode()
    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, layer_stack: LayerStack | None = None
    ) -> torch.Tensor:
        """fp32 logits at ``batch.logit_rows()``: ``[bs, vocab_size]``, each request's last new token,
        unless the batch asks for prompt logprobs (``layer_stack``: see ``LlamaModel.forward``)."""
        rows = batch.logit_rows()
        return self.lm_head(self.model(batch, backend, rows, layer_stack))

    @torch.inference_mode()
    def hidden_states(
        self,
        batch: ForwardBatch,
        backend: AttentionBackend,
        rows: torch.Tensor,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        return self.model(batch, backend, rows, layer_stack)

    def attention_layers(self) -> list[AttentionLayerSpec]:
        return [self._layer(i).self_attn.spec for i in range(len(self.model.layers))]

    def _layer(self, index: int) -> LlamaDecoderLayer:
        layer = self.model.layers[index]
        assert isinstance(layer, LlamaDecoderLayer)  # (a ModuleList yields plain Modules to the type checker)
        return layer

    # ---- a device's layer stack (DeviceOps.layer_stack) -------------------------------

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers in order; each declares what it is (``LlamaDecoderLayer.describe``, or
        its subclass's own declaration: one that declares nothing is never run in one call)."""
        return list(self.model.layers)

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers one by one (``LlamaModel.run_layers``): what a layer stack falls back to."""
        return self.model.run_layers(rope, hidden, batch, backend)

    # ---- weights --------------------------------------------------------------------

    def checkpoint_targets(self) -> CheckpointTargets:
        """Every checkpoint tensor name this model needs -> (parameter, shard id)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        targets: CheckpointTargets = {}
        for name, param in params.items():
            if self.config.tie_word_embeddings and name == "lm_head.weight":
                continue  # same tensor as model.embed_tokens.weight
            module_path, _, leaf = name.rpartition(".")
            parent, _, module = module_path.rpartition(".")
            expanded = [
                (ckpt, shard) for ckpt, (ours, shard) in self.stacked_checkpoint_names.items() if ours == module
            ]
            if expanded:
                for ckpt, shard in expanded:
                    targets[f"{parent}.{ckpt}.{leaf}"] = (param, shard)
            else:
                targets[name] = (param, None)
        return targets
