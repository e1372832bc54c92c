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
    # Gemma: every layer windowed but each N-th (``sliding_window_pattern``, else the family's
    # ``window_pattern``): layer i attends fully when (i + 1) % N == 0
    EVERY_NTH_FULL = "every_nth_full"


# The layer choices the layers implement, by name (``runtime.engine.layers.choices`` maps each to
# its work, and a test keeps the two in step): a family may name only these, and a checkpoint whose
# config names another is refused before any weight is read. Names only, so that reading a config
# needs no torch.
# the gated MLP's act(gate) * up ("swish" is silu; "gelu_pytorch_tanh": gelu's tanh approximation)
ACTIVATIONS: tuple[str, ...] = ("silu", "swish", "gelu_pytorch_tanh")
# an ungated MLP's act(up(x)) (an encoder's: BERT's intermediate layer); "gelu": the exact (erf) GELU
PLAIN_ACTIVATIONS: tuple[str, ...] = ("gelu",)
# rms: x / rms(x) * weight, fp32 statistics; rms_unit_offset (Gemma): x / rms(x) * (1 + weight);
# layer_norm: (x - mean(x)) / std(x) * weight + bias (BERT's, torch's LayerNorm)
NORM_FORMS: tuple[str, ...] = ("rms", "rms_unit_offset", "layer_norm")
ROPE_STYLES: tuple[str, ...] = ("neox",)  # the two halves of a head's rotary dims rotate as pairs
# what a q/k norm normalises: each head (Qwen3, Gemma 3) or the whole projection of every head (OLMoE)
QK_NORM_SPANS: tuple[str, ...] = ("head", "projection")


@dataclass(frozen=True)
class MoeKeys:
    """How a mixture-of-experts family's ``config.json`` describes its sparse MLP layers (read by
    the mixtures' own config, ``runtime.engine.models.moe_config``; a config whose expert count is 0
    is dense)."""

    experts_keys: tuple[str, ...]  # the number of routed experts: the first of these keys present
    expert_size_key: str  # each routed expert's intermediate size
    # the key saying whether the top-k weights are renormalised to sum to 1 (its default: False, as
    # transformers' config classes have it); None: always renormalised (Mixtral)
    renormalize_key: str | None
    # routing weights rounded to the model's dtype before they scale the experts' outputs (transformers'
    # Qwen and OLMoE routers); False: kept in fp32 (Mixtral's router)
    weights_in_model_dtype: bool = True
    # whether a GGUF file renormalises when it does not say (``{arch}.expert_weights_norm``): llama.cpp's
    # graph and transformers' GGUF loader renormalise Qwen3-MoE's and not Qwen2-MoE's or OLMoE's
    gguf_renormalize: bool = False


@dataclass(frozen=True)
class Family:
    """One model family's checkpoint conventions and layer choices."""

    name: str  # our name, and the ``model_type`` we write for it
    architectures: tuple[str, ...]  # config.json ``architectures`` values served as this family
    gguf_architectures: tuple[str, ...]  # GGUF ``general.architecture`` values read as this family
    always_qkv_bias: bool = False  # q/k/v biases whatever ``attention_bias`` says (Qwen2 has no such key)
    qk_norm: bool = False  # RMSNorm of q and k before RoPE (Qwen3: per head; see qk_norm_span)
    qk_norm_span: str = "head"  # what the q/k norm normalises (one of QK_NORM_SPANS)
    moe: MoeKeys | None = None  # a mixture-of-experts family: how its config names its experts
    window_rule: WindowRule = WindowRule.NONE
    window_pattern: int = 0  # EVERY_NTH_FULL: N when the config does not say (Gemma 2: 2, Gemma 3: 6)
    # The ``general.architecture`` llama.cpp's converter writes for this family when it is not the
    # family's own (Mistral: ``llama``); such a file is told apart by the family's name in its
    # ``general.name``, as transformers does.
    gguf_converted_as: str | None = None
    # llama.cpp's converter stores this family's norm weights plus this offset (Gemma: 1, for its
    # plain RMSNorm); the GGUF reader subtracts it again, as transformers' GGUF loader does.
    gguf_norm_offset: float = 0.0
    # Norm tensors a GGUF block has beyond attn_norm / ffn_norm (Gemma's sandwich norms)
    gguf_block_norms: tuple[str, ...] = ()
    # Float metadata read into the config: (key under the architecture, config key, value when the
    # file has none; None: leave the key out). llama.cpp's own defaults where it hard-codes them.
    gguf_float_keys: tuple[tuple[str, str, float | None], ...] = ()
    # A multimodal checkpoint's config nests the text model's under ``text_config``, keeping only
    # what differs from the text config class's defaults; these are those defaults (what
    # transformers fills in from its class), under the keys ``model_config`` reads.
    text_config_defaults: tuple[tuple[str, object], ...] = ()
    # An encoder (BERT, XLM-RoBERTa): every token attends to every other of its request, so it serves
    # embeddings and scores only (``--is-embedding``): no decoding, no prefix reuse, no chunking.
    encoder: bool = False
    # Layer choices, read by the layers (``runtime.engine.layers``), never compared by name elsewhere:
    # the MLP gates (act(gate) * up, the activation one of ACTIVATIONS) or not (act(up), one of
    # PLAIN_ACTIVATIONS: BERT's)
    gated_mlp: bool = True
    activation: str = "silu"  # the MLP's activation (config ``hidden_act`` when it names one)
    norm: str = "rms"  # the norm form: ``rms`` is x / rms(x) * weight
    rope_style: str = "neox"  # neox: the two halves of each head's rotary dims rotate as pairs

    @property
    def architecture(self) -> str:
        """The architecture name written for this family (a GGUF file's ``config.json``)."""
        return self.architectures[0]


_GEMMA_BLOCK_NORMS = ("post_attention_norm", "post_ffw_norm")
# llama.cpp scales Gemma's queries by key_length ** -0.5 (its config's query_pre_attn_scalar)
_GEMMA_QUERY_SCALE: tuple[str, str, float | None] = ("attention.key_length", "query_pre_attn_scalar", None)

# (transformers 5 writes Qwen3-MoE's expert count as num_local_experts; released configs say num_experts)
_QWEN_MOE = MoeKeys(("num_experts", "num_local_experts"), "moe_intermediate_size", "norm_topk_prob")
_QWEN3_MOE = MoeKeys(
    ("num_experts", "num_local_experts"), "moe_intermediate_size", "norm_topk_prob", gguf_renormalize=True
)

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family(
        "mistral", ("MistralForCausalLM",), ("mistral",), window_rule=WindowRule.EVERY_LAYER, gguf_converted_as="llama"
    ),
    Family(
        "qwen2", ("Qwen2ForCausalLM",), ("qwen2",), always_qkv_bias=True, window_rule=WindowRule.FROM_MAX_WINDOW_LAYERS
    ),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), qk_norm=True, window_rule=WindowRule.FROM_MAX_WINDOW_LAYERS),
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        ("gemma2",),
        window_rule=WindowRule.EVERY_NTH_FULL,
        window_pattern=2,
        gguf_norm_offset=1.0,
        gguf_block_norms=_GEMMA_BLOCK_NORMS,
        gguf_float_keys=(
            _GEMMA_QUERY_SCALE,
            ("attn_logit_softcapping", "attn_logit_softcapping", 50.0),
            ("final_logit_softcapping", "final_logit_softcapping", 30.0),
        ),
        activation="gelu_pytorch_tanh",
        norm="rms_unit_offset",
    ),
    Family(
        "gemma3",
        ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),  # (the second: its text model only)
        ("gemma3",),
        qk_norm=True,
        window_rule=WindowRule.EVERY_NTH_FULL,
        window_pattern=6,
        gguf_norm_offset=1.0,
        gguf_block_norms=_GEMMA_BLOCK_NORMS,
        gguf_float_keys=(_GEMMA_QUERY_SCALE, ("rope.freq_base_swa", "rope_local_base_freq", 10000.0)),
        text_config_defaults=(  # transformers' Gemma3TextConfig
            ("vocab_size", 262208),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
            ("hidden_activation", "gelu_pytorch_tanh"),
            ("max_position_embeddings", 131072),
            ("rms_norm_eps", 1e-6),
            ("rope_theta", 1000000.0),
            ("rope_local_base_freq", 10000.0),
            ("query_pre_attn_scalar", 256),
            ("sliding_window", 4096),
            ("tie_word_embeddings", True),
            ("pad_token_id", 0),
            ("eos_token_id", 1),
            ("bos_token_id", 2),
        ),
        activation="gelu_pytorch_tanh",
        norm="rms_unit_offset",
    ),
    # Phi-3, Phi-3.5, Phi-4-mini: fused qkv_proj and gate_up_proj in the checkpoint; every layer
    # windowed when the config has a sliding_window smaller than the context
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), window_rule=WindowRule.EVERY_LAYER),
    # Mixtures of experts: the Llama layout with sparse MLP layers (``runtime.engine.layers.moe``)
    Family(
        "qwen2_moe",
        ("Qwen2MoeForCausalLM",),
        ("qwen2moe",),
        always_qkv_bias=True,
        window_rule=WindowRule.FROM_MAX_WINDOW_LAYERS,
        moe=_QWEN_MOE,
    ),
    Family(
        "qwen3_moe",
        ("Qwen3MoeForCausalLM",),
        ("qwen3moe",),
        qk_norm=True,
        window_rule=WindowRule.FROM_MAX_WINDOW_LAYERS,
        moe=_QWEN3_MOE,
    ),
    # llama.cpp converts Mixtral as ``llama`` with expert tensors
    Family(
        "mixtral",
        ("MixtralForCausalLM",),
        ("mixtral",),
        window_rule=WindowRule.EVERY_LAYER,
        gguf_converted_as="llama",
        moe=MoeKeys(("num_local_experts",), "intermediate_size", None, weights_in_model_dtype=False),
    ),
    Family(
        "olmoe",
        ("OlmoeForCausalLM",),
        ("olmoe",),
        qk_norm=True,
        qk_norm_span="projection",
        moe=MoeKeys(("num_experts",), "intermediate_size", "norm_topk_prob"),
        # llama.cpp's OLMo converter states clip_qkv so (its OLMoE converter drops it: released
        # OLMoE configs have none); a file that states it gets it
        gguf_float_keys=(("attention.clamp_kqv", "clip_qkv", None),),
    ),
    # Encoders (``--is-embedding`` only): post-norm LayerNorm layers, an ungated GELU MLP, absolute
    # position and token-type embeddings; the sequence classifiers are cross-encoder rerankers. Served
    # from safetensors only (no GGUF form). XLM-RoBERTa's positions start past its padding id (its own
    # config, ``runtime.engine.models.bert_config``).
    Family(
        "bert",
        ("BertModel", "BertForSequenceClassification"),
        (),
        always_qkv_bias=True,
        encoder=True,
        gated_mlp=False,
        activation="gelu",
        norm="layer_norm",
    ),
    Family(
        "xlm_roberta",
        ("XLMRobertaModel", "XLMRobertaForSequenceClassification"),
        (),
        always_qkv_bias=True,
        encoder=True,
        gated_mlp=False,
        activation="gelu",
        norm="layer_norm",
    ),
)

# llama.cpp's ``llama`` converter interleaves the rows of each Q and K head for its RoPE (Mistral
# checkpoints are usually converted by it too); the GGUF reader undoes it for these architectures.
GGUF_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

BY_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.architectures}
BY_NAME: dict[str, Family] = {f.name: f for f in FAMILIES}
BY_GGUF_ARCHITECTURE: dict[str, Family] = {arch: f for f in FAMILIES for arch in f.gguf_architectures}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(BY_ARCHITECTURE)


def family_of_gguf(architecture: str, general_name: str, expert_count: int = 0) -> Family | None:
    """The family of a GGUF file whose ``general.architecture`` is ``architecture``, whose
    ``general.name`` is ``general_name`` and whose ``{arch}.expert_count`` is ``expert_count``; None:
    not a family we serve. Of the families converted as another's architecture, only the mixtures
    of experts are candidates for a file with experts and only the dense ones for one without: a
    ``llama`` file with experts is Mixtral whatever its name ("mistralai_Mixtral-8x7B" names Mistral
    too), one without is never Mixtral."""
    converted = [
        f for f in FAMILIES if f.gguf_converted_as == architecture and (f.moe is not None) == (expert_count > 0)
    ]
    for family in converted:
        if family.name in general_name.lower():
            return family
    if expert_count > 0 and len(converted) == 1:
        return converted[0]
    return BY_GGUF_ARCHITECTURE.get(architecture)


def gguf_architecture_of(family: Family) -> str:
    """The ``general.architecture`` llama.cpp's converter writes for ``family`` (ValueError: a family
    served from safetensors only, the encoders)."""
    if family.gguf_converted_as is None and not family.gguf_architectures:
        raise ValueError(f"the {family.name} family has no GGUF form here")
    return family.gguf_converted_as or family.gguf_architectures[0]
