"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from runtime.engine.model_config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError
from runtime.engine.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {arch: LlamaForCausalLM for arch in SUPPORTED_ARCHITECTURES}


def get_model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise UnsupportedModelError(f"no model implementation for architecture {config.architecture}")
    return cls  # type: ignore[return-value]
