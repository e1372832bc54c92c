"""ModelConfig: the facts about a checkpoint that every model's execution needs, read from config.json.

One normalised view over the several spellings found in the wild (RoPE: ``runtime.engine.rope_config``).
What a family's config means beyond the common keys (Qwen2's QKV bias that its config never states,
Qwen3's per-head q/k RMSNorm, which layers a ``sliding_window`` windows, the layers' activation, norm
form and rope style) is the family's entry in ``runtime.checkpoints.families``, read here and nowhere
else by name. Keys that only one family's model reads (Gemma's softmax scale, soft-caps and windowed
layers' RoPE; a mixture of experts' experts; OLMoE's q/k/v clamp; an encoder's LayerNorm epsilon, token
types, classifier and first position) are that family's own config, read by its config module
(``runtime.engine.models.family_configs`` names them) into ``family_config``.

Sliding windows (``Family.window_rule``, ``config_reading.declared_layer_windows``): Mistral's
``sliding_window`` makes every layer attend only to its last W tokens; Qwen2/Qwen3 with
``use_sliding_window`` window the layers from ``max_window_layers`` on (an explicit ``layer_types``
list wins over both). ``layer_windows`` holds each layer's window (None: full attention); the context
length is not capped by it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from runtime.checkpoints.families import (
    ACTIVATIONS,
    BY_ARCHITECTURE,
    NORM_FORMS,
    PLAIN_ACTIVATIONS,
    QK_NORM_SPANS,
    ROPE_STYLES,
    SUPPORTED_ARCHITECTURES,
    Family,
)
from runtime.engine.config_reading import ConfigReading, FamilyConfig, UnsupportedModelError, declared_layer_windows
from runtime.engine.models.family_configs import FAMILY_CONFIGS
from runtime.engine.rope_config import RopeConfig, longrope_switch_len, parse_rope

logger = logging.getLogger(__name__)

OwnConfig = TypeVar("OwnConfig", bound=FamilyConfig)


@dataclass
class ModelConfig:
    path: Path
    architecture: str
    family: str  # the family's name (runtime.checkpoints.families): which implementation serves it
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    # what the server admits: min(max_position_embeddings less the family's reserved rows, --context-length)
    context_len: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hidden_act: str  # the gated MLP's activation (a layer choice: runtime.engine.layers.choices)
    norm: str  # the norm form of every norm layer (a layer choice)
    rope_style: str  # how rotary pairs a head's dims (a layer choice)
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    checkpoint_dtype: str | None = None  # torch_dtype / dtype as saved, informational
    # Per layer: W when the layer attends to its last W tokens only (query included), else None.
    layer_windows: tuple[int | None, ...] = ()
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates (Phi-4-mini: 0.75)
    # The keys only this family's model reads (its config module's dataclass); None: it has none.
    family_config: FamilyConfig | None = None
    # The family is an encoder (BERT, XLM-RoBERTa): every token attends to every token of its request,
    # so it serves embeddings and scores only (``CausalLM.is_encoder``: no logits, no decoding)
    is_encoder: bool = False
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def family_config_as(self, kind: type[OwnConfig]) -> OwnConfig:
        """This config's family's own config, as the family's model reads it: ``kind`` is the class
        its config module defines (TypeError: the config is another family's)."""
        if not isinstance(self.family_config, kind):
            raise TypeError(f"a {self.family} config has no {kind.__name__} (its own: {self.family_config!r})")
        return self.family_config

    @property
    def num_experts(self) -> int:
        """The routed experts of each sparse MLP layer (the family's own config says); 0: dense."""
        return self.family_config.num_experts if self.family_config is not None else 0

    @property
    def rotary_dim(self) -> int:
        """How many of each head's dims RoPE rotates (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_switch_len(self) -> int | None:
        """The length past which a sequence rotates every token with another RoPE (LongRoPE: its long
        factors past ``original_max_position_embeddings``, when the context reaches beyond it); None
        when one RoPE serves every length. The scheduler keeps each request's KV on one side of it
        (``scheduler_proc.long_rope``)."""
        return longrope_switch_len(self.rope, self.context_len)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sliding_window(self) -> int | None:
        """The window of the windowed layers (one value per checkpoint), None when no layer has one."""
        return next((w for w in self.layer_windows if w is not None), None)

    @property
    def is_hybrid_swa(self) -> bool:
        """Some layers windowed: their KV can live in a pool that keeps only the last W tokens."""
        return self.sliding_window is not None

    @classmethod
    def from_pretrained(cls, path: str | Path, context_length: int | None = None, ep_size: int = 1) -> "ModelConfig":
        folder = Path(path)
        config_file = folder / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model folder {folder}")
        try:
            raw = json.loads(config_file.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{config_file} is not valid JSON: {exc}") from None
        return cls.from_dict(raw, folder, context_length, ep_size)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], folder: Path, context_length: int | None = None, ep_size: int = 1
    ) -> "ModelConfig":
        """``ep_size``: the ranks that split a mixture of experts' experts (``--ep-size``)."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            named = ", ".join(archs) if archs else f"none (model_type={raw.get('model_type')!r})"
            raise UnsupportedModelError(
                f"unsupported architecture {named} in {folder / 'config.json'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        family = BY_ARCHITECTURE[arch]
        if isinstance(raw.get("text_config"), dict):  # a multimodal checkpoint: its text model is served
            raw = _text_config(raw, family)
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads != 0:
            raise UnsupportedModelError(
                f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        head_dim = int(raw.get("head_dim") or hidden // heads)
        # Gemma names the MLP's activation ``hidden_activation`` (its ``hidden_act`` is a leftover)
        act = str(raw.get("hidden_activation") or raw.get("hidden_act") or family.activation)
        for what, value, supported in (
            ("hidden_act", act, ACTIVATIONS if family.gated_mlp else PLAIN_ACTIVATIONS),
            ("norm form", family.norm, NORM_FORMS),
            ("rope style", family.rope_style, ROPE_STYLES),
            ("q/k norm span", family.qk_norm_span, QK_NORM_SPANS),
        ):
            if value not in supported:
                raise UnsupportedModelError(f"unsupported {what} {value!r}; supported: {', '.join(supported)}")
        if ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {ep_size}")
        max_pos = int(raw.get("max_position_embeddings", 2048))
        rope = parse_rope(raw, folder)
        num_layers = int(raw["num_hidden_layers"])
        reader = FAMILY_CONFIGS.get(family.name)
        family_config = reader.from_hf(raw, ConfigReading(family, folder, num_layers, ep_size)) if reader else None

        # (XLM-RoBERTa's first rows of its position table are never a token's: 514 rows, 512 tokens)
        context_len = max_pos - (family_config.reserved_positions if family_config is not None else 0)
        layer_windows = declared_layer_windows(raw, family, num_layers)
        if context_length is not None:
            if context_length <= 0:
                raise ValueError(f"context_length must be > 0, got {context_length}")
            if context_length > context_len:
                raise ValueError(
                    f"context_length {context_length} exceeds what the model supports ({context_len}, "
                    f"from max_position_embeddings in config.json)"
                )
            context_len = context_length
        if all(w is None or w >= context_len for w in layer_windows):
            layer_windows = (None,) * len(layer_windows)  # no sequence outgrows the window: attention is full

        if ep_size > 1 and (family_config is None or family_config.num_experts == 0):
            raise UnsupportedModelError(
                f"--ep-size {ep_size} needs a mixture-of-experts model ({family.name} is dense)"
            )
        qkv_bias = family.always_qkv_bias or bool(raw.get("attention_bias", False))
        return cls(
            path=folder,
            architecture=arch,
            family=family.name,
            model_type=str(raw.get("model_type", family.name)),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=rope,
            max_position_embeddings=max_pos,
            context_len=context_len,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=family.qk_norm,
            hidden_act=act,
            norm=family.norm,
            rope_style=family.rope_style,
            eos_token_ids=_eos_ids(raw, folder),
            bos_token_id=raw.get("bos_token_id"),
            pad_token_id=raw.get("pad_token_id"),
            checkpoint_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            layer_windows=layer_windows,
            partial_rotary_factor=float(raw.get("partial_rotary_factor") or 1.0),
            family_config=family_config,
            is_encoder=family.encoder,
            raw=raw,
        )


def _text_config(raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (Gemma 3 4B and up): the family's text
    config defaults, then the nested ``text_config``, then the top level's token ids and dtype
    (where such checkpoints keep their end-of-turn ids)."""
    top = ("architectures", "eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype")
    return {**dict(family.text_config_defaults), **raw["text_config"], **{k: raw[k] for k in top if k in raw}}


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(raw: dict[str, Any], folder: Path) -> list[int]:
    """EOS ids from config.json and generation_config.json (union, config order first)."""
    ids = _as_id_list(raw.get("eos_token_id"))
    gen_file = folder / "generation_config.json"
    if gen_file.is_file():
        try:
            gen = json.loads(gen_file.read_text())
        except json.JSONDecodeError:
            logger.warning("ignoring unreadable %s", gen_file)
        else:
            for tid in _as_id_list(gen.get("eos_token_id")):
                if tid not in ids:
                    ids.append(tid)
    return ids
