"""Family name -> the class of its own config (``FamilyConfig``), for the families with keys only
their model reads; a family not listed has none (``ModelConfig.family_config`` is None).

The config half of the registry (``registry.py`` maps a family to its model class): kept apart
because ``runtime.engine.model_config`` reads it to read a config, which needs no torch, while the
model classes do. The classes are each family's, defined beside its model. A test keeps the table
in step with the family table.
"""

from __future__ import annotations

from runtime.engine.config_reading import FamilyConfig
from runtime.engine.models.bert_config import BertConfig, XLMRobertaConfig
from runtime.engine.models.gemma_config import GemmaConfig
from runtime.engine.models.moe_config import MoeFamilyConfig
from runtime.engine.models.olmoe_config import OlmoeConfig

FAMILY_CONFIGS: dict[str, type[FamilyConfig]] = {
    "gemma2": GemmaConfig,
    "gemma3": GemmaConfig,
    "qwen2_moe": MoeFamilyConfig,
    "qwen3_moe": MoeFamilyConfig,
    "mixtral": MoeFamilyConfig,
    "olmoe": OlmoeConfig,
    "bert": BertConfig,
    "xlm_roberta": XLMRobertaConfig,
}
