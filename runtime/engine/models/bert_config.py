"""BERT's and XLM-RoBERTa's own config: the keys only the encoder model reads.

- ``layer_norm_eps``: every LayerNorm's epsilon (BERT's configs name it so, not ``rms_norm_eps``);
- ``type_vocab_size``: the rows of the token-type table (2 for BERT's sentence pairs; XLM-RoBERTa 1);
- the classifier head of a ``*ForSequenceClassification`` checkpoint (a cross-encoder reranker):
  its label count, ``id2label``'s length where the config lists labels, else ``num_labels``;
- where positions start: BERT's first token takes row 0 of the position table; XLM-RoBERTa's takes
  row ``pad_token_id + 1`` (transformers numbers a request's tokens from past its padding id), so its
  context is that many positions shorter than ``max_position_embeddings`` (514 rows: 512 tokens).

Only absolute positions are served (``position_embedding_type`` "absolute"), and only the encoder
(a config with ``is_decoder`` set is a causal BERT: refused). Read without torch, beside the model
that uses it (``bert.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from runtime.engine.config_reading import ConfigReading, FamilyConfig, UnsupportedModelError

CLASSIFIER_SUFFIX = "ForSequenceClassification"


@dataclass(frozen=True)
class BertConfig(FamilyConfig):
    layer_norm_eps: float
    type_vocab_size: int
    num_labels: int  # the classifier head's outputs; 0: the checkpoint has no head (a plain encoder)
    position_offset: int  # the position-table row of a request's first token

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], reading: ConfigReading) -> BertConfig:
        kind = raw.get("position_embedding_type") or "absolute"
        if kind != "absolute":
            raise UnsupportedModelError(
                f"unsupported position_embedding_type {kind!r} in {reading.folder / 'config.json'}; supported: absolute"
            )
        if raw.get("is_decoder"):
            raise UnsupportedModelError(f"{reading.folder / 'config.json'} is a causal (is_decoder) BERT: not served")
        return cls(
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            num_labels=_num_labels(raw, reading),
            position_offset=cls.first_position(raw),
        )

    @staticmethod
    def first_position(raw: Mapping[str, Any]) -> int:
        """The position-table row of a request's first token: BERT's 0."""
        return 0

    @property
    def reserved_positions(self) -> int:
        return self.position_offset

    @property
    def classifier(self) -> bool:
        """The checkpoint is a sequence classifier (a cross-encoder): its head scores pooled rows."""
        return self.num_labels > 0


@dataclass(frozen=True)
class XLMRobertaConfig(BertConfig):
    @staticmethod
    def first_position(raw: Mapping[str, Any]) -> int:
        """XLM-RoBERTa's first token takes row ``pad_token_id + 1`` (transformers'
        ``create_position_ids_from_input_ids``; the rows up to the padding id are never used)."""
        return int(raw.get("pad_token_id", 1)) + 1


def _num_labels(raw: Mapping[str, Any], reading: ConfigReading) -> int:
    """The classifier's label count for a sequence classification checkpoint, else 0."""
    served = [a for a in raw.get("architectures") or () if a in reading.family.architectures]
    if not served or not served[0].endswith(CLASSIFIER_SUFFIX):
        return 0
    labels = raw.get("id2label")
    count = len(labels) if isinstance(labels, dict) and labels else int(raw.get("num_labels", 2))
    if count < 1:
        raise UnsupportedModelError(f"{reading.folder / 'config.json'} has a classifier of {count} labels")
    return count
