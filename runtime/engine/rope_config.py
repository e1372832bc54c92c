"""RoPE settings read from a config.json: ``RopeConfig`` and the one parser of its spellings.

Every family's rotary layer is built from a ``RopeConfig``; which scaling a checkpoint uses
(linear, llama3, LongRoPE) is the checkpoint's choice, not its family's, as in transformers' shared
rope utilities, so the common config (``runtime.engine.model_config``) reads it for every family.
A family whose windowed layers have a RoPE of their own (Gemma 3) reads that one with the same
parser (``runtime.engine.models.gemma_config``). Plain data, no torch: the tokenizer process and
``launch.py`` read configs before any torch import.

Spellings: transformers 5 writes ``rope_parameters`` (per layer type, ``{"full_attention": ...,
"sliding_attention": ...}``, where a model's layer types differ) while older and most real
checkpoints use ``rope_theta`` + ``rope_scaling``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from runtime.engine.config_reading import UnsupportedModelError

# "su": the name Phi-3's first long-context configs gave longrope
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str  # "default" | "linear" | "llama3" | "longrope"
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # longrope (Phi-3.5, Phi-4-mini): per-frequency divisors of the inverse frequencies, one per
    # rotary pair; the long ones apply to a forward whose sequence outgrows
    # original_max_position_embeddings (transformers' rule), the short ones otherwise.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0  # multiplies cos and sin (longrope: sqrt(1 + ln(factor) / ln(original)))


def longrope_switch_len(rope: RopeConfig, context_len: int) -> int | None:
    """``original_max_position_embeddings`` of a longrope whose context reaches past it (the length
    past which its long factors rotate every token); None for any other RoPE or a context within it."""
    orig = rope.original_max_position_embeddings
    return orig if rope.rope_type == "longrope" and orig is not None and context_len > orig else None


def parse_rope(raw: Mapping[str, Any], folder: Path) -> RopeConfig:
    """The RoPE of ``raw``'s full-attention layers (all its layers unless transformers 5 gives each
    layer type its parameters: then ``rope_parameters["full_attention"]``)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return _parse_one({**raw, "rope_parameters": params["full_attention"], "rope_scaling": None}, folder)
    return _parse_one(raw, folder)


def _parse_one(raw: Mapping[str, Any], folder: Path) -> RopeConfig:
    """Accept both ``rope_parameters`` (transformers 5) and ``rope_theta`` + ``rope_scaling``."""
    params: dict[str, Any] = {}
    if isinstance(raw.get("rope_parameters"), dict):
        params.update(raw["rope_parameters"])
    if isinstance(raw.get("rope_scaling"), dict):
        params.update(raw["rope_scaling"])
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope type {rope_type!r} in {folder / 'config.json'}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig("default", float(theta))
    if rope_type in ("longrope", "su"):
        return _parse_longrope(raw, params, float(theta))
    factor = float(params.get("factor", 1.0))
    if rope_type == "linear":
        return RopeConfig("linear", float(theta), factor=factor)
    orig = params.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    return RopeConfig(
        "llama3",
        float(theta),
        factor=factor,
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(orig) if orig is not None else None,
    )


def _parse_longrope(raw: Mapping[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
    """LongRoPE as transformers 5 reads it (``_compute_longrope_parameters``): a top-level
    ``original_max_position_embeddings`` wins over the scaling dict's (Phi-3 keeps it there); with no
    ``factor`` the context's growth ``max_position_embeddings / original`` sets the attention factor."""
    orig = int(
        raw.get("original_max_position_embeddings")
        or params.get("original_max_position_embeddings")
        or raw.get("max_position_embeddings", 2048)
    )
    missing = [key for key in ("short_factor", "long_factor") if not isinstance(params.get(key), (list, tuple))]
    if missing:
        raise UnsupportedModelError(f"longrope scaling without {' or '.join(missing)}")
    factor = params.get("factor")
    factor = float(factor) if factor is not None else float(raw.get("max_position_embeddings", orig)) / orig
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return RopeConfig(
        "longrope",
        theta,
        factor=factor,
        original_max_position_embeddings=orig,
        short_factor=tuple(float(f) for f in params["short_factor"]),
        long_factor=tuple(float(f) for f in params["long_factor"]),
        attention_factor=float(attention),
    )
