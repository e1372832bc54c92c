"""Gemma's own config (Gemma 2 and Gemma 3 text): the keys only the Gemma model reads.

- ``query_pre_attn_scalar``: the softmax scale is its ``** -0.5`` (not ``head_dim ** -0.5``);
- ``attn_logit_softcapping`` / ``final_logit_softcapping``: attention scores and final logits
  soft-capped at these (Gemma 2 sets both; Gemma 3 neither, unless its config does);
- the windowed layers' own RoPE (Gemma 3): transformers 5 writes it as ``rope_parameters
  ["sliding_attention"]``, older configs as ``rope_local_base_freq``;
- which layers are of the windowed type: they keep that RoPE even where the served context is too
  short for their window to matter (the common config then drops the window, not the type).

Read without torch (``runtime.engine.config_reading``), beside the model that uses it
(``gemma2.py``); a GGUF file's values of these keys are the GGUF config builder's (the family
table's ``gguf_float_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from runtime.engine.config_reading import ConfigReading, FamilyConfig, declared_layer_windows, optional_float
from runtime.engine.rope_config import RopeConfig, parse_rope


@dataclass(frozen=True)
class GemmaConfig(FamilyConfig):
    query_pre_attn_scalar: float | None  # softmax scale = this ** -0.5; None: head_dim ** -0.5
    attn_logit_softcap: float | None  # attention scores soft-capped at this; None: not capped
    final_logit_softcap: float | None  # logits soft-capped at this; None: not capped
    # The RoPE of the windowed layers where the config gives them their own; None: every layer
    # uses the common config's ``rope``.
    rope_local: RopeConfig | None
    local_layers: tuple[bool, ...]  # per layer: whether it is of the windowed type

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], reading: ConfigReading) -> GemmaConfig:
        windows = declared_layer_windows(raw, reading.family, reading.num_layers)
        return cls(
            query_pre_attn_scalar=optional_float(raw.get("query_pre_attn_scalar")),
            attn_logit_softcap=optional_float(raw.get("attn_logit_softcapping")),
            final_logit_softcap=optional_float(raw.get("final_logit_softcapping")),
            rope_local=_local_rope(raw, reading),
            local_layers=tuple(w is not None for w in windows),
        )

    def attention_scaling(self, head_dim: int) -> float:
        """The softmax scale of every attention layer."""
        return (self.query_pre_attn_scalar or head_dim) ** -0.5


def _local_rope(raw: Mapping[str, Any], reading: ConfigReading) -> RopeConfig | None:
    """The windowed layers' RoPE: transformers 5's per-layer-type ``rope_parameters`` (their
    ``sliding_attention`` entry, if any), else ``rope_local_base_freq`` (older Gemma 3 configs)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        local = params.get("sliding_attention")
        if not isinstance(local, dict):
            return None
        return parse_rope({**raw, "rope_parameters": local, "rope_scaling": None}, reading.folder)
    if raw.get("rope_local_base_freq") is None:
        return None
    return RopeConfig("default", float(raw["rope_local_base_freq"]))
