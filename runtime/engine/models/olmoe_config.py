"""OLMoE's own config: a mixture of experts' (``moe_config``) plus ``clip_qkv``, the bound that q,
k and v are clamped to after their projections and norms (None: not clamped; released OLMoE configs
have none, OLMo's state one). Read without torch, beside the model that uses it (``olmoe.py``).

(What OLMoE's q/k norms normalise, the whole projection, is its attention class's; the family
table's ``qk_norm_span`` says so for the GGUF tensor shapes.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from runtime.engine.config_reading import ConfigReading, optional_float
from runtime.engine.models.moe_config import MoeFamilyConfig, read_moe


@dataclass(frozen=True)
class OlmoeConfig(MoeFamilyConfig):
    clip_qkv: float | None = None  # q, k and v clamped to +-this after their projections and norms

    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], reading: ConfigReading) -> OlmoeConfig:
        return cls(moe=read_moe(raw, reading), clip_qkv=optional_float(raw.get("clip_qkv")))
