"""Model families: what each family's checkpoints say and mean, declared once.

A family is a set of architectures that share one implementation and one reading of their
``config.json`` (Mistral and Qwen2 are Llamas with other defaults). Every rule that used to be
a string compare on the family's name lives here as a field of its ``Family``, and every place
that reads a checkpoint reads it from this table: the HF config parser
(``runtime.engine.model_config``), the GGUF config builder (``runtime.checkpoints.gguf.config``),
the GGUF weight reader, and the tests' GGUF writer. A new family is one entry here plus a model
module in ``runtime.engine.models`` (its registry maps the family's name to its class).

The module is plain data and imports nothing heavy: ``launch.py`` and the GGUF preparation read
it before any torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WindowRule(Enum):
    """How a family's ``config.json`` says which layers attend through a sliding window."""

    NONE = "none"  # never windowed (Llama: a ``sliding_window`` key is ignored, as transformers does)
    EVERY_LAYER = "every_layer"  # ``sliding_window`` windows every layer (Mistral)
    # Qwen2/Qwen3: off unless ``use_sliding_window``; then the layers from ``max_window_layers`` on
    FROM_MAX_WINDOW_LAYERS = "from_max_window_layers"


# The layer choices the layers implement, by name (``runtime.engine.layers.choices`` maps each to
# its work, and a test keeps the two in step): a family may name only these, and a checkpoint whose
# config names another is refused before any weight is read. Names only, so that reading a config
# needs no torch.
ACTIVATIONS: tuple[str, ...] = ("silu", "swish")  # the gated MLP's act(gate) * up ("swish" is silu)
NORM_FORMS: tuple[str, ...] = ("rms",)  # x / rms(x) * weight, fp32 statistics
ROPE_STYLES: tuple[str, ...] = ("neox",)  # the two halves of a head's rotary dims rotate as pairs


@dataclass(frozen=True)
class Family:
    """One model family's checkpoint conventions and layer choices."""

    name: str  # our name, and the ``model_type`` we write for it
    architectures: tuple[str, ...]  # config.json ``architectures`` values served as this family
    gguf_architectures: tuple[str, ...]  # GGUF ``general.architecture`` values read as this family
    always_qkv_bias: bool = False  # q/k/v biases whatever ``attention_bias`` says (Qwen2 has no such key)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    window_rule: WindowRule = WindowRule.NONE
    # The ``general.architecture`` llama.cpp's converter writes for this family when it is not the
    # family's own (Mistral: ``llama``); such a file is told apart by the family's name in its
    # ``general.name``, as transformers does.
    gguf_converted_as: str | None = None
    # Layer choices, read by the layers (``runtime.engine.layers``), never compared by name elsewhere:
    activation: str = "silu"  # the gated MLP's activation (config ``hidden_act`` when it names one)
    norm: str = "rms"  # the norm form: ``rms`` is x / rms(x) * weight
    rope_style: str = "neox"  # neox: the two halves of each head's rotary dims rotate as pairs

    @property
    def architecture(self) -> str:
        """The architecture name written for this family (a GGUF file's ``config.json``)."""
        return self.architectures[0]


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family(
        "mistral", ("MistralForCausalLM",), ("mistral",), window_rule=WindowRule.EVERY_LAYER, gguf_converted_as="llama"
    ),
    Family(
        "qwen2", ("Qwen2ForCausalLM",), ("qwen2",), always_qkv_bias=True, window_rule=WindowRule.FROM_MAX_WINDOW_LAYERS
    ),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True, window_rule=WindowRule.FROM_MAX_WINDOW_LAYERS),
)

# llama.cpp's ``llama`` converter interleaves the rows of each Q and K head for its RoPE (Mistral
# checkpoints are usually converted by it too); the GGUF reader undoes it for these architectures.
GGUF_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.architectures}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
BY_GGUF_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.gguf_architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_ARCHITECTURE)


def family_of_gguf(architecture: str, general_name: str) -> Family | None:
    """The family of a GGUF file whose ``general.architecture`` is ``architecture`` and whose
    ``general.name`` is ``general_name``; None: not a family we serve."""
    for family in FAMILIES:
        if family.gguf_converted_as == architecture and family.name in general_name.lower():
            return family
    return BY_GGUF_ARCHITECTURE.get(architecture)


def gguf_architecture_of(family: Family) -> str:
    """The ``general.architecture`` llama.cpp's converter writes for ``family``."""
    return family.gguf_converted_as or family.gguf_architectures[0]
