"""What the front door knows of the embedding model it serves (a server started with ``--is-embedding``):
read once at start from the checkpoint folder, torch-free, so that a request the model cannot answer
is refused before it reaches the scheduler.

- the pooling rule (``runtime.checkpoints.pooling``): whether the reply is a normalised vector, or a
  cross-encoder's label scores (then the server reranks, and does not embed);
- the vector's length (the hidden size, or the classifier's label count), which bounds ``dimensions``;
- the Matryoshka sizes a checkpoint declares (``matryoshka_dimensions`` in config.json, SGLang's
  convention): when it names them, ``dimensions`` must be one of them.

``dimensions`` itself (OpenAI's, for Matryoshka-trained models such as text-embedding-3): the first
``d`` values of the vector, renormalised when the pooling rule normalises, so that a cut vector is
still a unit vector for cosine similarity. Where a checkpoint declares no sizes, any ``d`` up to the
model's size is served, as SGLang and vLLM leave that choice to the client.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.checkpoints.pooling import PoolingSpec, pooling_of

# HF configs without ``id2label`` or ``num_labels`` have two labels (PretrainedConfig's default).
DEFAULT_NUM_LABELS = 2


class DimensionsError(ValueError):
    """A ``dimensions`` the model cannot serve; the message says why and what it can."""


@dataclass(frozen=True)
class EmbeddingModel:
    """The embedding model served: its pooling rule, the length of its vectors (None: unknown, then
    checked on the reply) and the Matryoshka sizes it declares (None: any size up to its own)."""

    pooling: PoolingSpec
    size: int | None
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def classifier(self) -> bool:
        """A cross-encoder (reranker): its reply is label scores, one per label, never normalised."""
        return self.pooling.classifier

    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse a ``dimensions`` this model cannot serve (DimensionsError says why)."""
        if dimensions is None:
            return
        if self.classifier:
            raise DimensionsError("the model is a cross-encoder: its label scores cannot be cut to a size")
        if isinstance(dimensions, bool) or dimensions < 1:
            raise DimensionsError(f"must be a number of dimensions >= 1, got {dimensions}")
        if self.size is not None and dimensions > self.size:
            raise DimensionsError(f"{dimensions} is more than the model's {self.size} dimensions")
        sizes = self.matryoshka_dimensions
        if sizes is not None and dimensions not in sizes:
            raise DimensionsError(
                f"the model was trained for the sizes {', '.join(map(str, sizes))}; {dimensions} is not one of them"
            )

    def cut(self, vector: list[float], dimensions: int | None) -> list[float]:
        """``vector`` with only its first ``dimensions`` values (all with None), renormalised when the
        pooling rule normalises; DimensionsError when the vector is shorter than asked (a size the
        folder did not say)."""
        if dimensions is None or dimensions == len(vector):
            return vector
        if dimensions > len(vector):
            raise DimensionsError(f"{dimensions} is more than the model's {len(vector)} dimensions")
        kept = vector[:dimensions]
        if not self.pooling.normalize:
            return kept
        norm = math.sqrt(math.fsum(x * x for x in kept))
        return kept if norm == 0.0 else [x / norm for x in kept]


def load_embedding_model(folder: str | Path, pooling_flag: str | None) -> EmbeddingModel:
    """The embedding model of the checkpoint ``folder`` (``--pooling``: ``pooling_flag``)."""
    folder = Path(folder)
    spec = pooling_of(folder, pooling_flag)
    config = _config(folder)
    size = _num_labels(config) if spec.classifier else _hidden_size(config)
    declared = config.get("matryoshka_dimensions")
    sizes = (
        tuple(sorted(int(d) for d in declared))
        if isinstance(declared, list) and declared and all(isinstance(d, int) for d in declared)
        else None
    )
    return EmbeddingModel(spec, size, sizes)


def _config(folder: Path) -> dict[str, Any]:
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _hidden_size(config: dict[str, Any]) -> int | None:
    """The hidden size (a multimodal config keeps its text model's under ``text_config``)."""
    for where in (config, config.get("text_config")):
        if isinstance(where, dict) and isinstance(where.get("hidden_size"), int):
            return int(where["hidden_size"])
    return None


def _num_labels(config: dict[str, Any]) -> int:
    labels = config.get("id2label")
    if isinstance(labels, dict) and labels:
        return len(labels)
    count = config.get("num_labels")
    return int(count) if isinstance(count, int) and count > 0 else DEFAULT_NUM_LABELS
