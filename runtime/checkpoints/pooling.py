"""How an embedding server turns a prompt's hidden states into one vector: the pooling rule.

Read once from the checkpoint folder (torch-free: the launcher, the front door and the scheduler all
read it): a sentence-transformers folder says its pooling in ``modules.json`` and
``1_Pooling/config.json`` and whether it normalises (a ``Normalize`` module); a folder without them
gets ``--pooling`` or the model kind's default: an encoder pools its first token ([CLS]), a causal
LM its last token (SGLang's and the Qwen3-Embedding / gte-Qwen2 convention), both normalised. A
sequence-classification model (a cross-encoder reranker) answers its head's label scores for the
first token, never normalised. ``--pooling`` given always wins over the folder's files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.checkpoints.families import BY_ARCHITECTURE

POOLING_METHODS: tuple[str, ...] = ("mean", "cls", "last")
# 1_Pooling/config.json's switches -> our method (sentence-transformers' names)
_SENTENCE_TRANSFORMERS_MODES: tuple[tuple[str, str], ...] = (
    ("pooling_mode_mean_tokens", "mean"),
    ("pooling_mode_cls_token", "cls"),
    ("pooling_mode_lasttoken", "last"),
)
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_POOLING_MODULE = "sentence_transformers.models.Pooling"


class PoolingError(ValueError):
    """The folder's pooling files ask for what is not served (max pooling, several modes at once)."""


@dataclass(frozen=True)
class PoolingSpec:
    """What an embedding request's reply is made of."""

    method: str  # one of POOLING_METHODS: the mean of the prompt's tokens, its first, or its last
    normalize: bool  # the vector is divided by its L2 norm
    classifier: bool  # a cross-encoder: the reply is the head's label scores of the first token
    encoder: bool  # the model attends both ways: no prefix reuse, no chunking (the whole prompt at once)
    source: str  # where the rule came from, for the start-up line

    def describe(self) -> str:
        if self.classifier:
            return f"classifier scores of the first token ({self.source})"
        return f"{self.method} pooling{', normalised' if self.normalize else ''} ({self.source})"

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a cached prefix may stand for the prompt's first tokens: only where the pooled
        vector needs no hidden state of them (last-token pooling of a causal model)."""
        return not self.encoder and self.method == "last"


def _architecture(folder: Path) -> str:
    try:
        raw: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ""
    archs = raw.get("architectures") or []
    return next((a for a in archs if a in BY_ARCHITECTURE), archs[0] if archs else "")


def _sentence_transformers_rule(folder: Path) -> tuple[str, bool] | None:
    """(method, normalize) from a sentence-transformers folder's files; None: it has none."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    normalize = any(m.get("type") == _NORMALIZE_MODULE for m in modules)
    pooling = next((m for m in modules if m.get("type") == _POOLING_MODULE), None)
    if pooling is None:
        return None
    config_file = folder / str(pooling.get("path") or "1_Pooling") / "config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    chosen = [method for key, method in _SENTENCE_TRANSFORMERS_MODES if config.get(key)]
    others = [
        k
        for k, v in config.items()
        if k.startswith("pooling_mode_") and v and k not in dict(_SENTENCE_TRANSFORMERS_MODES)
    ]
    if others or len(chosen) > 1:
        raise PoolingError(
            f"{config_file} asks for {', '.join(others + chosen)}: served pooling is one of "
            f"{', '.join(POOLING_METHODS)} (give --pooling to choose)"
        )
    return (chosen[0] if chosen else "mean"), normalize


def pooling_of(folder: str | Path, flag: str | None = None) -> PoolingSpec:
    """The pooling rule of the checkpoint ``folder`` (see the module docstring); ``flag``: ``--pooling``."""
    folder = Path(folder)
    arch = _architecture(folder)
    family = BY_ARCHITECTURE.get(arch)
    encoder = family is not None and family.encoder
    if arch.endswith("ForSequenceClassification"):
        return PoolingSpec("cls", False, True, encoder, "the classification head")
    if flag is not None:
        if flag not in POOLING_METHODS:
            raise PoolingError(f"--pooling {flag!r}: choose one of {', '.join(POOLING_METHODS)}")
        found = _sentence_transformers_rule(folder)
        return PoolingSpec(flag, found[1] if found else True, False, encoder, "--pooling")
    found = _sentence_transformers_rule(folder)
    if found is not None:
        return PoolingSpec(found[0], found[1], False, encoder, "the folder's sentence-transformers files")
    default = "cls" if encoder else "last"
    return PoolingSpec(default, True, False, encoder, f"the {'encoder' if encoder else 'causal LM'} default")
