"""What reading a config.json shares between the common config and each family's own.

A checkpoint's config is read in two parts (no torch in either: the tokenizer process and
``launch.py`` read configs before any torch import): ``runtime.engine.model_config`` reads what
every model has into ``ModelConfig``, and a family with keys of its own (Gemma's soft-caps, a
mixture of experts' experts, OLMoE's q/k/v clamp) reads them into its ``FamilyConfig``, a frozen
dataclass in its config module beside its model (``runtime.engine.models.*_config``), which
``ModelConfig.family_config`` holds. This module is what both parts import: the refusal
(``UnsupportedModelError``), what a family reader is handed (``ConfigReading``), the base of the
families' configs, the per-layer windows as a config declares them, and ``MoeConfig``, the
settings of the sparse MLP layer (``runtime.engine.layers.moe``) that the mixtures' reader makes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from runtime.checkpoints.families import Family, WindowRule


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its features) is not implemented."""


@dataclass(frozen=True)
class ConfigReading:
    """What a family's reader is told beside the config's keys: which family and folder it reads
    (the family table's entry, and the folder its errors name), the layer count, and the ranks that
    split a mixture of experts' experts (``--ep-size``)."""

    family: Family
    folder: Path
    num_layers: int
    ep_size: int = 1


@dataclass(frozen=True)
class FamilyConfig(abc.ABC):
    """A family's own config: the base of the frozen dataclass a family's config module defines
    (its fields are the keys only that family's model reads). ``runtime.engine.models.family_configs``
    maps each family with one to its class; a family without one has None in its ``ModelConfig``."""

    @classmethod
    @abc.abstractmethod
    def from_hf(cls, raw: Mapping[str, Any], reading: ConfigReading) -> FamilyConfig:
        """The family's fields read from ``raw`` (config.json, or the one the GGUF config builder
        writes); UnsupportedModelError for a value the family's model cannot serve."""

    @property
    def num_experts(self) -> int:
        """The routed experts of each sparse MLP layer; 0 (the default): the model is dense. The
        one question about a family's config that the engine outside the models asks (expert
        parallelism, a GGUF file's expert tensors)."""
        return 0

    @property
    def reserved_positions(self) -> int:
        """Rows of the position table before the first token's (XLM-RoBERTa's: its padding id + 1);
        0 (the default): none. The served context is that much shorter than ``max_position_embeddings``."""
        return 0


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's sparse MLP layers: each token's ``top_k`` of ``num_experts``
    experts, weighted by the router's softmax over them (``runtime.engine.layers.moe``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    renormalize: bool  # the top-k weights divided by their sum
    weights_in_model_dtype: bool  # routing weights rounded to the model's dtype before they scale
    sparse_layers: tuple[bool, ...]  # per layer: a sparse MLP (else the dense one of intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert behind a sigmoid gate; 0: none
    ep_size: int = 1  # ranks that split the experts between them (--ep-size): each holds whole experts

    def local_experts(self, rank: int, tp_size: int) -> range:
        """The experts TP rank ``rank`` holds whole under expert parallelism (all of them when
        ``ep_size`` is 1): the ranks form ``ep_size`` groups of ``tp_size // ep_size`` consecutive
        ranks, and group g holds the g-th ``num_experts // ep_size`` experts."""
        per_group = self.num_experts // self.ep_size
        group = rank // (tp_size // self.ep_size)
        return range(group * per_group, (group + 1) * per_group)


def declared_layer_windows(raw: Mapping[str, Any], family: Family, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window as the config declares it, read as transformers reads it (``layer_types``
    first, then the family's window rule); None: a full-attention layer. (Whether a window matters
    for the served context is the common config's question: ``ModelConfig.layer_windows``.)"""
    window = raw.get("sliding_window")
    rule = family.window_rule
    if rule is WindowRule.FROM_MAX_WINDOW_LAYERS and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window value that is off unless use_sliding_window
    if window is None or rule is WindowRule.NONE:
        return (None,) * num_layers
    window = int(window)
    if window <= 0:
        raise UnsupportedModelError(f"sliding_window must be > 0, got {window}")
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if rule is WindowRule.EVERY_NTH_FULL:
        every = int(raw.get("sliding_window_pattern") or family.window_pattern)
        return tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))
    if rule is WindowRule.FROM_MAX_WINDOW_LAYERS:
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)
