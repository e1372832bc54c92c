"""An HF ``config.json`` from a GGUF file's metadata, and the tensor shapes it implies.

llama.cpp writes one key per hyper-parameter under the architecture's name
(``llama.block_count``, ``qwen2.attention.head_count_kv``, ...); this maps them onto the
config keys ``runtime.engine.model_config`` reads, for the families we serve: which GGUF
architecture is which family, and what each family's config and tensors hold, is the family
table's (``runtime.checkpoints.families``). Mistral checkpoints are usually converted as
``llama`` (told apart by ``general.name``, as transformers does); llama.cpp's llama converter
interleaves the rows of each Q and K head for its RoPE, which the weight reader undoes
(``needs_qk_unpermute``), and stores Gemma's norm weights plus one, which it subtracts again
(``Family.gguf_norm_offset``). Tied embeddings: no ``output.weight`` tensor. RoPE scaling that
llama.cpp stores as tensors (LongRoPE's factors, Llama 3.1's ``rope_freqs``) is read here too, and a
mixture of experts' keys and expert tensors (``runtime.checkpoints.gguf.experts``; Mixtral is a
``llama`` file with experts).
"""

from __future__ import annotations

from typing import Any

from runtime.checkpoints.families import (
    BY_GGUF_ARCHITECTURE,
    BY_NAME,
    GGUF_PERMUTED_QK_ARCHITECTURES,
    WindowRule,
    family_of_gguf,
)
from runtime.checkpoints.gguf.experts import expert_count, moe_config, shape_matches, sparse_block_shapes, sparse_layer
from runtime.checkpoints.gguf.reader import GGUFContents, GGUFError
from runtime.checkpoints.gguf.rope_freqs import TENSOR as ROPE_FREQS
from runtime.checkpoints.gguf.rope_freqs import rope_freqs_scaling


def needs_qk_unpermute(architecture: str) -> bool:
    """Whether llama.cpp permuted the Q/K rows of files of this ``general.architecture``."""
    return architecture in GGUF_PERMUTED_QK_ARCHITECTURES


def hf_config(contents: GGUFContents) -> dict[str, Any]:
    """The ``config.json`` dict for ``contents``; GGUFError for an architecture we do not serve
    or metadata that is missing or inconsistent."""
    arch = contents.architecture
    family = family_of_gguf(arch, str(contents.metadata.get("general.name", "")), expert_count(contents))
    if family is None:
        raise GGUFError(
            f"{contents.path}: unsupported architecture {arch or '(none)'!r} in general.architecture; "
            f"supported: {', '.join(BY_GGUF_ARCHITECTURE)}"
        )
    architecture, model_type = family.architecture, family.name

    def need(key: str) -> Any:
        value = contents.arch_value(key)
        if value is None:
            raise GGUFError(f"{contents.path}: metadata key {arch}.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = int(contents.arch_value("attention.head_count_kv", heads))
    head_dim = int(contents.arch_value("attention.key_length", hidden // heads))
    embed = contents.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{contents.path}: tensor token_embd.weight is missing")
    vocab = int(contents.arch_value("vocab_size", contents.metadata.get("tokenizer.ggml.tokens#count", embed.shape[0])))
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "max_position_embeddings": int(contents.arch_value("context_length", 2048)),
        "rms_norm_eps": float(contents.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(contents.arch_value("rope.freq_base", 10000.0)),
        "hidden_act": family.activation,
        "tie_word_embeddings": "output.weight" not in contents.tensors,
        "attention_bias": "blk.0.attn_q.bias" in contents.tensors,
        "torch_dtype": "float32",
    }
    for key, config_key, default in family.gguf_float_keys:
        value = contents.arch_value(key, default)
        if value is not None:
            config[config_key] = float(value)
    rotary = contents.arch_value("rope.dimension_count")
    if rotary is not None and int(rotary) < head_dim:  # partial rotary (Phi-4-mini: 3/4 of each head)
        config["partial_rotary_factor"] = int(rotary) / head_dim
    rotary_dim = int(rotary) if rotary is not None and int(rotary) < head_dim else head_dim
    rope_scaling = _rope_scaling(contents, rotary_dim, config["rope_theta"], config["max_position_embeddings"])
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    window = contents.arch_value("attention.sliding_window")
    if window:
        config["sliding_window"] = int(window)
        if family.window_rule is WindowRule.FROM_MAX_WINDOW_LAYERS:
            config["use_sliding_window"] = True
            config["max_window_layers"] = 0
    for key, name in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        if name in contents.metadata:
            config[key] = int(contents.metadata[name])
    # llama.cpp ends generation on eos and on the end-of-turn token where a chat model has one.
    eos = [
        int(contents.metadata[k])
        for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if k in contents.metadata
    ]
    if eos:
        config["eos_token_id"] = eos[0] if len(set(eos)) == 1 else sorted(set(eos), key=eos.index)
    config.update(moe_config(contents, family, config["num_hidden_layers"], config["intermediate_size"]))
    check_tensor_shapes(contents, config)
    return config


def _rope_scaling(contents: GGUFContents, rotary_dim: int, base: float, context: int) -> dict[str, Any] | None:
    """The config's ``rope_scaling``: from LongRoPE's factor tensors (Phi-3), llama.cpp's
    ``rope_freqs`` divisors (Llama 3.1-style scaling, ``runtime.checkpoints.gguf.rope_freqs``) or
    the ``rope.scaling.*`` keys; None: no scaling."""
    kind = contents.arch_value("rope.scaling.type")
    if "rope_factors_long.weight" in contents.tensors:
        return _longrope(contents)
    if ROPE_FREQS in contents.tensors:
        return rope_freqs_scaling(contents, rotary_dim, base, context)
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise GGUFError(
            f"{contents.path}: unsupported RoPE scaling {kind!r} ({contents.architecture}.rope.scaling.type); "
            f"supported: linear"
        )
    return {"rope_type": "linear", "factor": float(contents.arch_value("rope.scaling.factor", 1.0))}


def _longrope(contents: GGUFContents) -> dict[str, Any]:
    """Phi-3's LongRoPE as llama.cpp's converter stores it: the per-frequency factors as F32 tensors
    ``rope_factors_long`` / ``rope_factors_short`` (read here: they are config, not weights), the
    pretraining context as ``rope.scaling.original_context_length``, the factor it multiplies cos
    and sin by as ``rope.scaling.attn_factor``."""
    import numpy as np

    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for kind in ("long", "short"):
        name = f"rope_factors_{kind}.weight"
        entry = contents.tensors.get(name)
        if entry is None or entry.type_name != "F32" or len(entry.shape) != 1:
            raise GGUFError(f"{contents.path}: LongRoPE needs tensor {name} as 1-D F32, found {entry}")
        values = np.fromfile(contents.path, dtype="<f4", count=entry.shape[0], offset=entry.offset)
        scaling[f"{kind}_factor"] = [float(v) for v in values]
    original = contents.arch_value("rope.scaling.original_context_length")
    if original is None:
        raise GGUFError(
            f"{contents.path}: metadata key {contents.architecture}.rope.scaling.original_context_length is missing"
        )
    scaling["original_max_position_embeddings"] = int(original)
    attention = contents.arch_value("rope.scaling.attn_factor")
    if attention is not None:
        scaling["attention_factor"] = float(attention)
    return scaling


def expected_shapes(
    config: dict[str, Any], fused: bool = False, merged_experts: bool = True
) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> the shape (rows first) the config implies, for every tensor the model
    reads; ``fused``: the file stores q, k and v rows in one ``attn_qkv`` and gate and up rows in
    ``ffn_up`` (llama.cpp's ``phi3``); ``merged_experts``: a mixture's experts in ``*_exps`` tensors,
    else one tensor per expert (older Mixtral files)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config["vocab_size"], hidden),
        "output_norm.weight": (hidden,),
    }
    if not config["tie_word_embeddings"]:
        shapes["output.weight"] = (config["vocab_size"], hidden)
    family = BY_NAME[config["model_type"]]
    for i in range(config["num_hidden_layers"]):
        block = {
            "attn_norm.weight": (hidden,),
            "ffn_norm.weight": (hidden,),
            "attn_q.weight": (q_rows, hidden),
            "attn_k.weight": (kv_rows, hidden),
            "attn_v.weight": (kv_rows, hidden),
            "attn_output.weight": (hidden, q_rows),
            "ffn_gate.weight": (inter, hidden),
            "ffn_up.weight": (inter, hidden),
            "ffn_down.weight": (hidden, inter),
        }
        if fused:
            for name in ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight"):
                del block[name]
            block.update({"attn_qkv.weight": (q_rows + 2 * kv_rows, hidden), "ffn_up.weight": (2 * inter, hidden)})
        if config["attention_bias"] or family.always_qkv_bias:
            block.update({"attn_q.bias": (q_rows,), "attn_k.bias": (kv_rows,), "attn_v.bias": (kv_rows,)})
        if family.qk_norm:  # (OLMoE's norms span the whole projection)
            whole = family.qk_norm_span == "projection"
            q_norm, k_norm = (q_rows, kv_rows) if whole else (config["head_dim"], config["head_dim"])
            block.update({"attn_q_norm.weight": (q_norm,), "attn_k_norm.weight": (k_norm,)})
        block.update({f"{norm}.weight": (hidden,) for norm in family.gguf_block_norms})
        if family.moe is not None and sparse_layer(config, i):
            for name in ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"):
                del block[name]
            block.update(sparse_block_shapes(config, family.moe, merged_experts))
        shapes.update({f"blk.{i}.{name}": shape for name, shape in block.items()})
    return shapes


def check_tensor_shapes(contents: GGUFContents, config: dict[str, Any]) -> None:
    """GGUFError naming the first tensor that is missing or whose shape disagrees with the metadata."""
    fused = "blk.0.attn_qkv.weight" in contents.tensors
    merged = not any(".ffn_gate.0.weight" in name for name in contents.tensors)  # (older Mixtral: per expert)
    for name, shape in expected_shapes(config, fused, merged).items():
        entry = contents.tensors.get(name)
        if entry is None:
            raise GGUFError(f"{contents.path}: tensor {name} is missing")
        if not shape_matches(name, entry.shape, shape):
            raise GGUFError(f"{contents.path}: tensor {name} has shape {entry.shape}, but the metadata implies {shape}")
