"""ModelConfig: the facts about a checkpoint that model execution needs, read from config.json.

One normalised view over the several spellings found in the wild: transformers 5.x
writes RoPE settings as ``rope_parameters`` while older and most real checkpoints
use ``rope_theta`` + ``rope_scaling``. What a family's config means beyond the common keys
(Qwen2's QKV bias that its config never states, Qwen3's per-head q/k RMSNorm, which layers
a ``sliding_window`` windows, the layers' activation, norm form and rope style) is the family's
entry in ``runtime.checkpoints.families``, read here and nowhere else by name.

Sliding windows (``Family.window_rule``): Mistral's ``sliding_window`` makes every layer attend
only to its last W tokens; Qwen2/Qwen3 with ``use_sliding_window`` window the layers from
``max_window_layers`` on (an explicit ``layer_types`` list wins over both). ``layer_windows``
holds each layer's window (None: full attention); the context length is not capped by it.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.checkpoints.families import (
    ACTIVATIONS,
    BY_ARCHITECTURE,
    NORM_FORMS,
    QK_NORM_SPANS,
    ROPE_STYLES,
    SUPPORTED_ARCHITECTURES,
    Family,
    WindowRule,
)

logger = logging.getLogger(__name__)

# "su": the name Phi-3's first long-context configs gave longrope
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "su")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture (or one of its features) is not implemented."""


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


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts model's sparse MLP layers: each token's ``top_k`` of ``num_experts``
    experts, weighted by the router's softmax over them (``runtime.engine.layers.moe``)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each routed expert's
    renormalize: bool  # the top-k weights divided by their sum
    weights_in_model_dtype: bool  # routing weights rounded to the model's dtype before they scale
    sparse_layers: tuple[bool, ...]  # per layer: a sparse MLP (else the dense one of intermediate_size)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert behind a sigmoid gate; 0: none
    ep_size: int = 1  # ranks that split the experts between them (--ep-size): each holds whole experts

    def local_experts(self, rank: int, tp_size: int) -> range:
        """The experts TP rank ``rank`` holds whole under expert parallelism (all of them when
        ``ep_size`` is 1): the ranks form ``ep_size`` groups of ``tp_size // ep_size`` consecutive
        ranks, and group g holds the g-th ``num_experts // ep_size`` experts."""
        per_group = self.num_experts // self.ep_size
        group = rank // (tp_size // self.ep_size)
        return range(group * per_group, (group + 1) * per_group)


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
    context_len: int  # what the server admits: min(max_position_embeddings, --context-length)
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
    # The RoPE of the windowed layers where the config gives them their own (Gemma 3's
    # ``rope_local_base_freq``); None: every layer uses ``rope``.
    rope_local: RopeConfig | None = None
    # Per layer: whether it is of the windowed type (kept when the windows are dropped because no
    # sequence outgrows them: such a layer still rotates with ``rope_local``).
    local_layers: tuple[bool, ...] = ()
    partial_rotary_factor: float = 1.0  # the share of each head's dims that RoPE rotates (Phi-4-mini: 0.75)
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 (Gemma); None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # attention scores soft-capped at this (Gemma 2)
    final_logit_softcap: float | None = None  # logits soft-capped at this (Gemma 2)
    qk_norm_span: str = "head"  # what the q/k norm normalises: each head, or the whole projection (OLMoE)
    clip_qkv: float | None = None  # q, k and v clamped to +-this after their projections and norms (OLMoE)
    moe: MoeConfig | None = None  # the sparse MLP layers of a mixture of experts; None: dense
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def attention_scaling(self) -> float:
        """The softmax scale of every attention layer."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

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
            ("hidden_act", act, ACTIVATIONS),
            ("norm form", family.norm, NORM_FORMS),
            ("rope style", family.rope_style, ROPE_STYLES),
            ("q/k norm span", family.qk_norm_span, QK_NORM_SPANS),
        ):
            if value not in supported:
                raise UnsupportedModelError(f"unsupported {what} {value!r}; supported: {', '.join(supported)}")
        max_pos = int(raw.get("max_position_embeddings", 2048))
        rope, rope_local = _parse_ropes(raw, folder)

        context_len = max_pos
        layer_windows = _layer_windows(raw, family, int(raw["num_hidden_layers"]))
        if context_length is not None:
            if context_length <= 0:
                raise ValueError(f"context_length must be > 0, got {context_length}")
            if context_length > context_len:
                raise ValueError(
                    f"context_length {context_length} exceeds what the model supports ({context_len}, "
                    f"from max_position_embeddings in config.json)"
                )
            context_len = context_length
        local_layers = tuple(w is not None for w in layer_windows)
        if all(w is None or w >= context_len for w in layer_windows):
            layer_windows = (None,) * len(layer_windows)  # no sequence outgrows the window: attention is full

        qkv_bias = family.always_qkv_bias or bool(raw.get("attention_bias", False))
        return cls(
            path=folder,
            architecture=arch,
            family=family.name,
            model_type=str(raw.get("model_type", family.name)),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
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
            rope_local=rope_local,
            local_layers=local_layers,
            partial_rotary_factor=float(raw.get("partial_rotary_factor") or 1.0),
            query_pre_attn_scalar=_optional_float(raw.get("query_pre_attn_scalar")),
            attn_logit_softcap=_optional_float(raw.get("attn_logit_softcapping")),
            final_logit_softcap=_optional_float(raw.get("final_logit_softcapping")),
            qk_norm_span=family.qk_norm_span,
            clip_qkv=_optional_float(raw.get("clip_qkv")),
            moe=_parse_moe(raw, family, int(raw["num_hidden_layers"]), ep_size),
            raw=raw,
        )


def _text_config(raw: dict[str, Any], family: Family) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (Gemma 3 4B and up): the family's text
    config defaults, then the nested ``text_config``, then the top level's token ids and dtype
    (where such checkpoints keep their end-of-turn ids)."""
    top = ("architectures", "eos_token_id", "bos_token_id", "pad_token_id", "torch_dtype", "dtype")
    return {**dict(family.text_config_defaults), **raw["text_config"], **{k: raw[k] for k in top if k in raw}}


def _parse_moe(raw: dict[str, Any], family: Family, num_layers: int, ep_size: int) -> MoeConfig | None:
    """The family's sparse MLP layers as transformers builds them: every layer unless it is in
    ``mlp_only_layers`` or ``decoder_sparse_step`` skips it; None for a dense family or config."""
    keys = family.moe
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    experts = next((int(raw[k]) for k in keys.experts_keys if raw.get(k) is not None), 0) if keys else 0
    if keys is None or experts == 0:
        if ep_size > 1:
            raise UnsupportedModelError(
                f"--ep-size {ep_size} needs a mixture-of-experts model ({family.name} is dense)"
            )
        return None
    if experts % ep_size:
        raise UnsupportedModelError(f"{experts} experts cannot be split evenly over --ep-size {ep_size}")
    top_k = int(raw["num_experts_per_tok"])
    if not 0 < top_k <= experts:
        raise UnsupportedModelError(f"num_experts_per_tok {top_k} is not within 1..{experts}")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense_layers = set(raw.get("mlp_only_layers") or ())
    renormalize = bool(raw.get(keys.renormalize_key, False)) if keys.renormalize_key else True
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(raw[keys.expert_size_key]),
        renormalize=renormalize,
        weights_in_model_dtype=keys.weights_in_model_dtype,
        sparse_layers=tuple(i not in dense_layers and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0),
        ep_size=ep_size,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _parse_ropes(raw: dict[str, Any], folder: Path) -> tuple[RopeConfig, RopeConfig | None]:
    """``(rope, rope of the windowed layers or None)``. transformers 5 writes per-layer-type
    parameters (``rope_parameters: {"full_attention": ..., "sliding_attention": ...}``); older
    Gemma 3 configs give the windowed layers ``rope_local_base_freq``."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        full = _parse_rope({**raw, "rope_parameters": params["full_attention"], "rope_scaling": None}, folder)
        local = params.get("sliding_attention")
        if not isinstance(local, dict):
            return full, None
        return full, _parse_rope({**raw, "rope_parameters": local, "rope_scaling": None}, folder)
    rope = _parse_rope(raw, folder)
    if raw.get("rope_local_base_freq") is None:
        return rope, None
    return rope, RopeConfig("default", float(raw["rope_local_base_freq"]))


def _parse_rope(raw: dict[str, Any], folder: Path) -> RopeConfig:
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


def _parse_longrope(raw: dict[str, Any], params: dict[str, Any], theta: float) -> RopeConfig:
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


def _layer_windows(raw: dict[str, Any], family: Family, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's window, read as transformers reads it (``layer_types`` first, then the family rule)."""
    window = raw.get("sliding_window")
    rule = family.window_rule
    if rule is WindowRule.FROM_MAX_WINDOW_LAYERS and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window value that is off unless use_sliding_window
    if window is None or rule is WindowRule.NONE:
        return (None,) * num_layers
    window = int(window)
    if window <= 0:
        raise UnsupportedModelError(f"sliding_window must be > 0, got {window}")
    types = raw.get("layer_types")
    if isinstance(types, list) and len(types) == num_layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    if rule is WindowRule.EVERY_NTH_FULL:
        every = int(raw.get("sliding_window_pattern") or family.window_pattern)
        return tuple(None if (i + 1) % every == 0 else window for i in range(num_layers))
    if rule is WindowRule.FROM_MAX_WINDOW_LAYERS:
        first = int(raw.get("max_window_layers", num_layers))
        return tuple(window if i >= first else None for i in range(num_layers))
    return (window,) * num_layers


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
