"""The model protocol: everything the rest of the engine may ask of a model.

The model runner, the weight loader, the attention backends (through the runner) and a device's
layer stack (the CPU's one-call decode stack) talk to a model only through ``CausalLM``; none of
them reads a model's attribute names or names a model class. A family's module in this folder
subclasses it (or subclasses another family's model, as SGLang reuses ``LlamaForCausalLM``) and
the registry (``registry.py``) maps the family's name to it.

What a model owes:
- ``forward``: fp32 logits at the batch's logit rows, running its decoder layers through the
  layer stack the runner hands it (a device's own, or None: its layers one by one);
- ``attention_layers``: each attention layer's ``AttentionLayerSpec`` on this rank, which the runner
  sizes the KV pool and the backends' scratch from;
- ``checkpoint_targets``: every checkpoint tensor name it needs -> (parameter, shard id), so a
  missing tensor is named before serving starts; ``load_weights`` fills them (given here once for
  every model: each parameter's own ``weight_loader`` does the sharding);
- ``decoder_layers``: its decoder layers in order, each declaring what it is made of
  (``runtime.engine.ops.layer_stack.LayerDescription``), for a device's whole-layer kernels (none,
  the default: the device never runs them in one call);
- ``run_layers``: the decoder layers one by one, what a layer stack falls back to.

What an embedding server (``--is-embedding``) asks besides: ``hidden_states``, the final hidden
states at chosen rows (what the pooler reduces, ``runtime.engine.pooling``), and ``classify``, a
sequence-classification model's label scores of its pooled rows. An encoder (``is_encoder``: BERT,
XLM-RoBERTa) serves through the same protocol: its ``forward`` has no logits to give.
"""

from __future__ import annotations

import abc
import logging
from typing import Iterable, Sequence

import torch
from torch import nn

from runtime.engine.attention.base import AttentionBackend, AttentionLayerSpec
from runtime.engine.forward_batch import ForwardBatch
from runtime.engine.layers.linear import LazyWeight, replicated_weight_loader
from runtime.engine.model_config import ModelConfig
from runtime.engine.ops import LayerStack, RopeInputs

logger = logging.getLogger(__name__)

# checkpoint tensor name -> (the parameter it fills, the shard of it: a merged layer's part, or None)
CheckpointTargets = dict[str, tuple[nn.Parameter, object]]


class CausalLM(nn.Module, abc.ABC):
    """A causal language model over packed tokens, built for one TP rank with its parameters
    uninitialised; ``load_weights`` fills them."""

    config: ModelConfig
    # Every token attends to every token of its own request (attention never reads the KV pool), so
    # the model serves embeddings only: the scheduler neither chunks nor reuses prefixes for it.
    is_encoder: bool = False

    @abc.abstractmethod
    def forward(
        self, batch: ForwardBatch, backend: AttentionBackend, layer_stack: LayerStack | None = None
    ) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]`` at ``batch.logit_rows()``."""

    @abc.abstractmethod
    def attention_layers(self) -> list[AttentionLayerSpec]:
        """Every attention layer's spec on this rank (heads after the TP split), in layer order."""

    @abc.abstractmethod
    def checkpoint_targets(self) -> CheckpointTargets:
        """Every checkpoint tensor name this model needs -> (parameter, shard id)."""

    @abc.abstractmethod
    def run_layers(
        self, rope: RopeInputs, hidden: torch.Tensor, batch: ForwardBatch, backend: AttentionBackend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` after every decoder layer, one by one, for the embeddings ``hidden``."""

    def hidden_states(
        self,
        batch: ForwardBatch,
        backend: AttentionBackend,
        rows: torch.Tensor,
        layer_stack: LayerStack | None = None,
    ) -> torch.Tensor:
        """The final hidden states ``[len(rows), hidden]`` (after the final norm, before any head) at
        ``rows`` of the packed tokens: what an embedding is pooled from."""
        raise NotImplementedError(f"{type(self).__name__} does not give its hidden states")

    def classify(self, pooled: torch.Tensor) -> torch.Tensor | None:
        """A sequence-classification model's fp32 label scores ``[n, num_labels]`` of ``pooled``
        (each request's first-token hidden state); None: the model has no such head."""
        return None

    def rope_tables(self, rope: RopeInputs, dtype: torch.dtype) -> tuple[RopeInputs, ...]:
        """The forward's rotary inputs for a device's whole-layer kernels: ``rope`` first, then the
        other tables some layers rotate with (``DecoderLayerWeights.rope_table``); the default: one."""
        return (rope,)

    def decoder_layers(self) -> Sequence[nn.Module]:
        """The decoder layers in order, for a device's whole-layer kernels, which take a layer only
        where its own class declares what it is (``ops.layer_stack.declared_description``). None
        (the default): a model that declares nothing never runs in one call."""
        return ()

    def checkpoint_name(self, name: str) -> str:
        """The target name of checkpoint tensor ``name`` (a family whose checkpoints nest the model
        under a prefix, a multimodal one's text model, maps it here); the default: itself."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, LazyWeight]]) -> set[str]:
        """Load ``(name, tensor)`` pairs; returns the target names that were loaded.

        Tensors the model has no use for (rotary ``inv_freq`` buffers, the LM head of a tied
        checkpoint) are skipped; the caller checks that every target was loaded.
        """
        targets = self.checkpoint_targets()
        loaded: set[str] = set()
        for name, weight in weights:
            name = self.checkpoint_name(name)
            target = targets.get(name)
            if target is None:
                logger.debug("checkpoint tensor %s is not used by this model", name)
                continue
            param, shard = target
            loader = getattr(param, "weight_loader", replicated_weight_loader)
            loader(param, weight, name, shard)
            loaded.add(name)
        return loaded
