"""Family name -> the model class that serves it, imported only when a model of that family is built.

The architectures a checkpoint may name, and which family each belongs to, are the family table's
(``runtime.checkpoints.families``); this registry owns which implementation serves each family.
A test keeps the two in step: every family has an implementation here and nothing else does. The
config half, which family reads keys of its own into which ``FamilyConfig``, is ``family_configs``
(a table without torch: reading a config imports no model).
"""

from __future__ import annotations

import importlib

from runtime.engine.config_reading import UnsupportedModelError
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.base import CausalLM

# family name -> "module:class" (lazy: building one family never imports another's module)
MODEL_CLASSES: dict[str, str] = {
    "llama": "runtime.engine.models.llama:LlamaForCausalLM",
    "mistral": "runtime.engine.models.llama:LlamaForCausalLM",
    "qwen2": "runtime.engine.models.llama:LlamaForCausalLM",
    "qwen3": "runtime.engine.models.llama:LlamaForCausalLM",
    "phi3": "runtime.engine.models.phi3:Phi3ForCausalLM",
    "gemma2": "runtime.engine.models.gemma2:Gemma2ForCausalLM",
    "gemma3": "runtime.engine.models.gemma3:Gemma3ForCausalLM",
    "qwen2_moe": "runtime.engine.models.qwen_moe:QwenMoeForCausalLM",
    "qwen3_moe": "runtime.engine.models.qwen_moe:QwenMoeForCausalLM",
    "mixtral": "runtime.engine.models.mixtral:MixtralForCausalLM",
    "olmoe": "runtime.engine.models.olmoe:OlmoeForCausalLM",
    "bert": "runtime.engine.models.bert:BertModel",
    "xlm_roberta": "runtime.engine.models.bert:XLMRobertaModel",
}


def get_model_class(config: ModelConfig) -> type[CausalLM]:
    """The class that serves ``config``'s family."""
    target = MODEL_CLASSES.get(config.family)
    if target is None:
        raise UnsupportedModelError(
            f"no model implementation for architecture {config.architecture} (family {config.family})"
        )
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    assert isinstance(cls, type) and issubclass(cls, CausalLM), f"{target} is not a CausalLM"
    return cls
