"""The encoders: BERT and XLM-RoBERTa (``BertModel``, ``XLMRobertaModel`` and their
``*ForSequenceClassification`` cross-encoders) over packed tokens, for ``--is-embedding``.

What an encoder is, against the decoders of this folder:
- every token attends to every token of its own request, before and after it (the backend's
  ``forward_encoder``: no KV is read or kept, so the scheduler neither chunks a request nor reuses a
  prefix for it); it gives hidden states (``hidden_states``) and label scores (``classify``), never
  logits: ``forward`` refuses;
- embeddings: word + token type (``ForwardBatch.token_type_ids``; None: type 0) + absolute position
  (``batch.positions``, shifted by the family's first position: XLM-RoBERTa's starts past its
  padding id), then LayerNorm, added in transformers' order so fp32 sums are its own;
- post-norm layers: ``LN(h + o(attention(h)))``, then ``LN(h + down(gelu(up(h))))``, every linear
  with its bias; q/k/v are one column-parallel matmul (the checkpoint's ``query``/``key``/``value``
  loaded as its shards) and, like the MLP, split over TP ranks as Llama's are; the LayerNorms and
  the position and token-type tables are replicated;
- the last layer's output is the final hidden state (no norm after it). Its attention needs every
  token, but the rest of it only the rows asked for, so the last layer computes only those.

The linears run through the device ops (the CPU's prepacked plans); the norms and GELU are the ops'
``layer_norm`` / ``gelu``. Checkpoints name tensors as transformers does, under ``bert.`` /
``roberta.`` in a classifier's (stripped here); a base model's pooler and ``position_ids`` buffers are
not read.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.layers.choices import norm_layer
from runtime.engine.layers.embedding import VocabParallelEmbedding
from runtime.engine.layers.linear import QKVParallelLinear, RowParallelLinear
from runtime.engine.layers.mlp import PlainMLP
from runtime.engine.layers.norm import LayerNorm
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.base import CausalLM, CheckpointTargets
from runtime.engine.models.bert_config import BertConfig
from runtime.engine.models.bert_heads import BertClassifierHead, ClassifierHead, RobertaClassifierHead
from runtime.engine.ops import DeviceOps, LayerStack, RopeInputs, default_ops

# checkpoint tensor name -> (our parameter's name, shard id): the embeddings', and each layer's under
# "encoder.layer.{i}." (ours under "layers.{i}."): q/k/v are the shards of one merged projection
_EMBEDDING_NAMES: dict[str, tuple[str, object]] = {
    "embeddings.word_embeddings.weight": ("embeddings.word_embeddings.weight", None),
    "embeddings.position_embeddings.weight": ("embeddings.position_embeddings.weight", None),
    "embeddings.token_type_embeddings.weight": ("embeddings.token_type_embeddings.weight", None),
    "embeddings.LayerNorm.weight": ("embeddings.norm.weight", None),
    "embeddings.LayerNorm.bias": ("embeddings.norm.bias", None),
}
_LAYER_NAMES: dict[str, tuple[str, object]] = {
    **{
        f"attention.self.{name}.{leaf}": (f"qkv_proj.{leaf}", shard)
        for shard, name in enumerate(("query", "key", "value"))
        for leaf in ("weight", "bias")
    },
    "attention.output.dense.weight": ("o_proj.weight", None),
    "attention.output.dense.bias": ("o_proj.bias", None),
    "attention.output.LayerNorm.weight": ("attention_norm.weight", None),
    "attention.output.LayerNorm.bias": ("attention_norm.bias", None),
    "intermediate.dense.weight": ("mlp.up_proj.weight", None),
    "intermediate.dense.bias": ("mlp.up_proj.bias", None),
    "output.dense.weight": ("mlp.down_proj.weight", None),
    "output.dense.bias": ("mlp.down_proj.bias", None),
    "output.LayerNorm.weight": ("output_norm.weight", None),
    "output.LayerNorm.bias": ("output_norm.bias", None),
}


def _layer_norm(config: ModelConfig, own: BertConfig, dtype: torch.dtype, ops: DeviceOps) -> LayerNorm:
    """A LayerNorm over the hidden size, of the family's norm form (the table's ``layer_norm``)."""
    norm = norm_layer(config, config.hidden_size, dtype, ops, own.layer_norm_eps)
    assert isinstance(norm, LayerNorm), f"an encoder's norm form is layer_norm, not {config.norm}"
    return norm


class EncoderEmbeddings(nn.Module):
    def __init__(
        self, config: ModelConfig, own: BertConfig, tp_rank: int, tp_size: int, dtype: torch.dtype, ops: DeviceOps
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, tp_rank, tp_size, dtype, ops)
        # (replicated: one rank's whole table)
        self.position_embeddings = VocabParallelEmbedding(config.max_position_embeddings, hidden, 0, 1, dtype, ops)
        self.token_type_embeddings = VocabParallelEmbedding(own.type_vocab_size, hidden, 0, 1, dtype, ops)
        self.norm = _layer_norm(config, own, dtype, ops)
        self.position_offset = own.position_offset

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None
    ) -> torch.Tensor:
        """``LN(word + type + position)`` of the packed tokens, ``[T, hidden]``."""
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        hidden = hidden + self.position_embeddings(positions + self.position_offset)
        out = self.norm(hidden)
        assert isinstance(out, torch.Tensor)
        return out


class EncoderLayer(nn.Module):
    """One post-norm encoder layer (BERT's ``BertLayer``)."""

    def __init__(
        self,
        config: ModelConfig,
        own: BertConfig,
        layer_id: int,
        tp_rank: int,
        tp_size: int,
        dtype: torch.dtype,
        ops: DeviceOps,
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=True,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
            ops=ops,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            hidden,
            bias=True,
            tp_rank=tp_rank,
            tp_size=tp_size,
            params_dtype=dtype,
            ops=ops,
        )
        self.attention_norm = _layer_norm(config, own, dtype, ops)
        self.mlp = PlainMLP(
            hidden, config.intermediate_size, config.hidden_act, tp_rank=tp_rank, tp_size=tp_size, dtype=dtype, ops=ops
        )
        self.output_norm = _layer_norm(config, own, dtype, ops)
        self.num_heads, self.num_kv_heads, self.head_dim = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, head_dim
        self.spec = AttentionLayerSpec(
            layer_id=layer_id,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=head_dim,
            scaling=head_dim**-0.5,
        )

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        backend: AttentionBackend,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The layer's output for the packed tokens ``hidden [T, hidden]`` (not written); ``rows``: only
        at those rows of them (attention still reads every token)."""
        t = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size :].view(t, self.num_kv_heads, self.head_dim)
        attended = backend.forward_encoder(q, k, v, self.spec, batch).reshape(t, self.num_heads * self.head_dim)
        if rows is not None:
            attended, hidden = attended.index_select(0, rows), hidden.index_select(0, rows)
        # LN(o + h): the fresh projection takes the sum in place (the norm's residual), h is not written
        hidden, _ = self.attention_norm(hidden, self.o_proj(attended))
        hidden, _ = self.output_norm(hidden, self.mlp(hidden))
        return hidden


class BertModel(CausalLM):
    """A BERT encoder (and, for a ``BertForSequenceClassification`` checkpoint, its classifier head),
    built for one TP rank with its parameters uninitialised; ``load_weights`` fills them."""

    is_encoder = True
    # the prefix a classifier's checkpoint nests the encoder under (stripped: ``checkpoint_name``)
    checkpoint_prefix = "bert."
    head_class: type[ClassifierHead] = BertClassifierHead

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
        self.tp_rank, self.tp_size = tp_rank, tp_size
        ops = ops or default_ops(dtype)
        own = config.family_config_as(BertConfig)
        self.embeddings = EncoderEmbeddings(config, own, tp_rank, tp_size, dtype, ops)
        self.layers = nn.ModuleList(
            EncoderLayer(config, own, i, tp_rank, tp_size, dtype, ops) for i in range(config.num_hidden_layers)
        )
        self.head = self.head_class(config.hidden_size, own.num_labels, dtype, ops) if own.classifier else None

    def encoder_layers(self) -> Sequence[EncoderLayer]:
        layers = list(self.layers)
        assert all(isinstance(layer, EncoderLayer) for layer in layers)
        return layers  # type: ignore[return-value]  # (checked above; a ModuleList yields plain Modules)

    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, layer_stack: LayerStack | None = None
    ) -> torch.Tensor:
        raise NotImplementedError(
            f"{type(self).__name__} is an encoder: it has no LM head and gives no logits "
            "(serve it with --is-embedding: hidden_states and classify)"
        )

    @torch.inference_mode()
    def hidden_states(
        self,
        batch: ForwardBatch,
        backend: AttentionBackend,
        rows: torch.Tensor,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        """The last layer's output ``[len(rows), hidden]`` at ``rows`` of the packed tokens. Each request
        must be whole in ``batch`` (no cached prefix). ``layer_stack`` is not used: a device's stack runs
        decode steps, which an encoder never takes."""
        hidden = self.embeddings(batch.input_ids, batch.positions, batch.token_type_ids)
        layers = self.encoder_layers()
        for index, layer in enumerate(layers):
            hidden = layer(hidden, batch, backend, rows if index == len(layers) - 1 else None)
        return hidden

    @torch.inference_mode()
    def classify(self, pooled: torch.Tensor) -> torch.Tensor | None:
        """The classifier head's fp32 label scores ``[n, num_labels]`` of the first-token hidden states
        ``pooled``; None: a plain encoder (no head)."""
        return None if self.head is None else self.head(pooled)

    def attention_layers(self) -> list[AttentionLayerSpec]:
        return [layer.spec for layer in self.encoder_layers()]

    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer for the embeddings ``hidden`` (``rope`` unused: positions are embedded); a post-norm
        stack keeps no residual stream, so the residual given back is zeros (``hidden + residual`` is
        the output, as the protocol reads it)."""
        for layer in self.encoder_layers():
            hidden = layer(hidden, batch, backend)
        return hidden, torch.zeros_like(hidden)

    # ---- weights --------------------------------------------------------------------

    def checkpoint_name(self, name: str) -> str:
        return name.removeprefix(self.checkpoint_prefix)

    def checkpoint_targets(self) -> CheckpointTargets:
        """Every checkpoint tensor name (transformers', the prefix stripped) -> (our parameter, shard)."""
        params = dict(self.named_parameters())
        names = dict(_EMBEDDING_NAMES)
        for index in range(len(self.layers)):
            ours, theirs = f"layers.{index}.", f"encoder.layer.{index}."
            names.update({theirs + ckpt: (ours + name, shard) for ckpt, (name, shard) in _LAYER_NAMES.items()})
        if self.head is not None:
            names.update({ckpt: ("head." + name, None) for ckpt, name in self.head.checkpoint_names().items()})
        return {ckpt: (params[name], shard) for ckpt, (name, shard) in names.items()}


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa (bge-m3, multilingual-e5; a ``XLMRobertaForSequenceClassification`` reranker): BERT's
    layers, positions from past the padding id (its own config), ``roberta.`` in a classifier's
    checkpoint, and RoBERTa's classification head."""

    checkpoint_prefix = "roberta."
    head_class = RobertaClassifierHead
