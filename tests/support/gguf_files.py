"""The one place that writes small GGUF files for tests, with the maintained ``gguf`` package.

``write_checkpoint_gguf`` turns a tiny HF test checkpoint (``tests.support.checkpoints``) into
a GGUF file the way llama.cpp's converter lays one out: per-architecture metadata keys,
tensor names from gguf's ``TensorNameMap``, Q/K rows interleaved for the ``llama``
architecture (llama.cpp's RoPE rotates adjacent pairs), no ``output.weight`` when the
embeddings are tied, Gemma's norm weights stored plus the family's ``gguf_norm_offset`` with its
head size, window and float keys (``gguf_float_keys``, checked against gguf-py's ``Keys``), and
the byte-level BPE tokenizer as ``tokenizer.ggml.*`` metadata that transformers can convert back.
The family is the family table's entry for the config's ``architectures`` (Gemma 3's
``model_type``, ``gemma3_text``, is no family's name). A mixture of experts gets llama.cpp's expert
keys and its experts stacked into ``ffn_{gate,up,down}_exps`` (or, ``expert_form="per_expert"``, the
older converter's ``ffn_gate.{e}`` tensors of Mixtral files); a quantized file keeps the router F32
and the shared-expert gate 1-D F32, as llama.cpp's quantizer leaves them; the dense blocks of a
mixture whose llama.cpp table has none (Qwen's) take the dense names (``ffn_up``).
``write_tensors_gguf`` writes bare tensors of any supported GGML type (for the dequantization
tests, whose K-quant shapes the tiny models are too narrow for). Broken files:
``write_checkpoint_gguf``'s options give an unsupported architecture, a tensor of the wrong shape or
a missing one; ``truncate`` and ``set_tensor_type_number`` damage a written file the ways a download
or a newer converter can.

Types gguf-py can quantize are quantized from the values; for the K-quants (which gguf-py
only dequantizes) valid random blocks of the values' spread are written instead, so the
reference for every type is ``gguf.dequantize`` of the stored bytes (``reference_tensor``).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from runtime.checkpoints.families import BY_ARCHITECTURE, MoeKeys, WindowRule, gguf_architecture_of
from runtime.checkpoints.gguf.config import needs_qk_unpermute

# Byte offsets of the fp16 scale fields inside one block of each K-quant type (gguf-py's layouts).
KQUANT_SCALE_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}

TensorHook = Callable[[str, np.ndarray], "np.ndarray | None"]

# An expert's projection in an HF checkpoint (Mixtral's block_sparse_moe w1/w3/w2 or mlp.*_proj)
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_PROJECTIONS = {
    "w1": "gate",
    "gate_proj": "gate",
    "w3": "up",
    "up_proj": "up",
    "w2": "down",
    "down_proj": "down",
}
_HF_DENSE_MLP = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight$")
_UNQUANTIZED = ("F32", "F16", "BF16")


@contextlib.contextmanager
def gguf_test_folder(tmp_path_factory: Any, name: str) -> Iterator[Path]:
    """A fresh folder for a test module's GGUF files, with ``$TINYSERVE_CACHE`` pointing into it
    while the block runs (the folders prepared from those files stay private to the module; the
    CPU kernels are the suite's, ``private_model_cache``)."""
    import pytest

    from tests.support.real_model import private_model_cache

    folder = tmp_path_factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINYSERVE_CACHE", str(private_model_cache(folder / "cache")))
        yield folder


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """HF Q/K rows -> llama.cpp's order: within each head, the two rotary halves are interleaved
    (HF row ``a * half + j`` becomes row ``2j + a``)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def llama_unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``llama_permute`` (what transformers' ``_reverse_permute_weights`` does)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def random_kquant_blocks(
    type_name: str, rows: int, cols: int, rng: np.random.Generator, target_std: float = 1.0
) -> np.ndarray:
    """``rows`` rows of random but valid ``type_name`` blocks: random quants and sub-scales, and
    finite fp16 super-block scales chosen so the values' standard deviation is about
    ``target_std`` (a weight of sane size: a tiny model fed huge weights only saturates)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, dequantize

    qtype = GGMLQuantizationType[type_name]
    block, type_size = GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"{type_name} needs a multiple of {block} columns, not {cols}")
    raw = rng.integers(0, 256, size=(rows * (cols // block), type_size), dtype=np.uint8)
    offsets = KQUANT_SCALE_OFFSETS[type_name]
    scales = rng.uniform(0.5, 1.0, size=(raw.shape[0], len(offsets)))
    for i, offset in enumerate(offsets):
        raw[:, offset : offset + 2] = scales[:, i].astype(np.float16).view(np.uint8).reshape(-1, 2)
    # every value is linear in the block's fp16 scales: rescale them all by one factor
    factor = target_std / float(dequantize(raw, qtype).std())
    for i, offset in enumerate(offsets):
        raw[:, offset : offset + 2] = (scales[:, i] * factor).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * type_size)


def encode(values: np.ndarray, type_name: str, rng: np.random.Generator) -> tuple[np.ndarray, Any]:
    """``(array, raw_dtype)`` for ``GGUFWriter.add_tensor``: ``values`` stored as ``type_name``
    (quantized by gguf-py, or random blocks of that shape for a K-quant)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType[type_name]
    values = np.ascontiguousarray(values, dtype=np.float32)
    if type_name == "F32":
        return values, None
    if type_name == "F16":
        return values.astype(np.float16), None
    if type_name in KQUANT_SCALE_OFFSETS:
        std = float(values.std()) or 1.0
        return random_kquant_blocks(type_name, values.shape[0], values.shape[-1], rng, target_std=std), qtype
    try:
        return quantize(values, qtype), qtype
    except NotImplementedError:  # e.g. IQ2_XXS: only its bytes matter (a type tinyserve must refuse)
        return random_blocks(type_name, values.shape[0], values.shape[-1], rng), qtype


def random_blocks(type_name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` rows of random bytes sized as ``type_name`` blocks (no meaningful values)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return rng.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)


def reference_tensor(path: Path, name: str) -> np.ndarray:
    """Tensor ``name`` of a GGUF file dequantized by gguf-py, numpy order (rows first), in the
    file's own row order: the reference every GGUFWeight read is compared with."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(path, "r")
    tensor = next(t for t in reader.tensors if t.name == name)
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    return np.asarray(dequantize(np.asarray(tensor.data), tensor.tensor_type), dtype=np.float32).reshape(shape)


def write_tensors_gguf(
    out: Path, tensors: Mapping[str, tuple[np.ndarray, str]], seed: int = 0, architecture: str = "llama"
) -> Path:
    """A GGUF file holding only ``tensors`` (name -> (fp32 values, GGML type name)), no model metadata."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(seed)
    writer = GGUFWriter(out, architecture)
    for name, (values, type_name) in tensors.items():
        array, raw_dtype = encode(values, type_name, rng)
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    _finish(writer)
    return out


def _finish(writer: Any) -> None:
    """Header, metadata, tensor table and data, in the order GGUFWriter requires."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_checkpoint_gguf(
    src: Path,
    out: Path,
    *,
    weight_type: str = "F32",
    types: Mapping[str, str] | None = None,
    architecture: str | None = None,
    model_name: str | None = None,
    tokenizer: bool = True,
    tie: bool = False,
    rope_scaling: bool = True,
    tensor_hook: TensorHook | None = None,
    extra: Callable[[Any], None] | None = None,
    seed: int = 0,
    expert_form: str = "merged",
) -> Path:
    """The HF checkpoint folder ``src`` as the GGUF file ``out``, as llama.cpp's converter writes it.

    Every 2-D weight is stored as ``weight_type`` (``types`` overrides per GGUF tensor name);
    1-D tensors (norms, biases) stay F32 as llama.cpp keeps them. ``architecture`` overrides
    general.architecture (and the key prefix), ``model_name`` general.name (default: the HF
    model_type, so a Mistral checkpoint is named "mistral"). ``tie`` drops ``output.weight``
    (a tied checkpoint). ``rope_scaling=False`` leaves out the rope.scaling keys and the
    ``rope_freqs`` tensor of a llama3 scaling (transformers' GGUF loader ignores them, so a file
    compared with it must not need them).
    ``tensor_hook(gguf_name, hf_order_values)`` may replace a tensor's values before it is
    permuted and encoded, or drop it by returning None. ``extra(writer)`` may add metadata
    keys or tensors of its own (the GGUFWriter, before any tensor is written). ``expert_form``: a
    mixture's experts ``merged`` into ``*_exps`` tensors or ``per_expert`` (older Mixtral files).
    """
    import gguf
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(src)
    # by architecture: Gemma 3's model_type (gemma3_text) is no family's name
    family = BY_ARCHITECTURE[config.architectures[0]]
    arch = gguf_architecture_of(family)  # the family table's (Mistral: llama)
    written_arch = architecture or arch
    tied = tie or bool(config.tie_word_embeddings)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rope, swa_rope = _rope_parameters(config)

    writer = gguf.GGUFWriter(out, written_arch)
    writer.add_name(model_name if model_name is not None else config.model_type)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    if rope_scaling and rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    rotary = int(head_dim * float(rope.get("partial_rotary_factor") or 1.0))
    if rotary != head_dim:  # (llama.cpp's phi3 converter states it always)
        writer.add_rope_dimension_count(rotary)
    longrope = rope_scaling and rope.get("rope_type") == "longrope"
    if longrope:  # as llama.cpp's phi3 converter: the factors become tensors (below)
        original = int(rope["original_max_position_embeddings"])
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
    float_keys = {key: config_key for key, config_key, _ in family.gguf_float_keys}
    written_keys: set[str] = set()
    # the converter states Qwen3's explicit head_dim, and Gemma's (whose query scale llama.cpp reads from it)
    if family.qk_norm or "attention.key_length" in float_keys:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        written_keys.add("attention.key_length")
    if family.window_rule is WindowRule.EVERY_NTH_FULL and getattr(config, "sliding_window", None):
        # llama.cpp's Gemma converters write the window only: the pattern is hard-coded per architecture
        writer.add_sliding_window(int(config.sliding_window))
    for key, config_key in float_keys.items():
        value = _config_float(config, config_key, swa_rope)
        if key not in written_keys and value is not None:
            writer.add_float32(_gguf_key(arch, key).format(arch=written_arch), value)
    if arch == "llama":  # llama.cpp's llama converter writes it; for Qwen the token count says it
        writer.add_vocab_size(config.vocab_size)
    if family.moe is not None:
        _add_expert_keys(writer, config, family.moe)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        _add_tokenizer(writer, src, config)
    if extra is not None:
        extra(writer)

    rng = np.random.default_rng(seed)
    table = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), config.num_hidden_layers
    )
    state = load_file(str(src / "model.safetensors"))

    def add(name: str, values: np.ndarray) -> None:
        hooked = tensor_hook(name, values) if tensor_hook is not None else values
        if hooked is None:
            return
        values = hooked
        if family.gguf_norm_offset and name.endswith("norm.weight"):  # (Gemma: stored as 1 + w)
            values = values + np.float32(family.gguf_norm_offset)
        if needs_qk_unpermute(arch) and (".attn_q." in name or ".attn_k." in name):
            values = llama_permute(values, heads if ".attn_q." in name else kv_heads)
        type_name = "F32" if values.ndim == 1 else (types or {}).get(name, weight_type)
        if weight_type not in _UNQUANTIZED and name not in (types or {}):  # llama.cpp's quantizer:
            if name.endswith(".ffn_gate_inp.weight"):  # the router is never quantized
                type_name = "F32"
            elif name.endswith(".ffn_gate_inp_shexp.weight"):  # [1, H] rewritten 1-D
                values, type_name = values.reshape(-1), "F32"
        array, raw_dtype = encode(values.reshape(-1, values.shape[-1]), type_name, rng)
        writer.add_tensor(name, array.reshape(*values.shape[:-1], array.shape[-1]), raw_dtype=raw_dtype)

    experts: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for hf_name in sorted(state):
        if tied and hf_name == "lm_head.weight":
            continue
        values = state[hf_name].to(torch.float32).numpy()
        expert = _HF_EXPERT.match(hf_name)
        if expert is not None:
            projection = _EXPERT_PROJECTIONS[expert.group(3)]
            experts.setdefault((int(expert.group(1)), projection), {})[int(expert.group(2))] = values
            continue
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        dense = _HF_DENSE_MLP.match(hf_name) if family.moe is not None else None
        if name is None and dense is not None:  # (a dense block of a mixture: llama.cpp's dense names)
            name = f"blk.{dense.group(1)}.ffn_{dense.group(2)}.weight"
        if name is None:
            raise ValueError(f"no GGUF name for {hf_name}")
        add(name, values)
    for (layer, projection), by_expert in sorted(experts.items()):
        if expert_form == "merged":  # (the expert is GGUF's outermost dimension)
            add(f"blk.{layer}.ffn_{projection}_exps.weight", np.stack([by_expert[e] for e in sorted(by_expert)]))
        else:
            for e, values in sorted(by_expert.items()):
                add(f"blk.{layer}.ffn_{projection}.{e}.weight", values)
    if rope_scaling and rope.get("rope_type") == "llama3":  # as llama.cpp's llama converter: a divisors tensor
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(rope, head_dim))
    if longrope:
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    _finish(writer)
    return out


def _add_expert_keys(writer: Any, config: Any, keys: MoeKeys) -> None:
    """A mixture's keys as llama.cpp's converters write them: expert and top-k counts, the routed
    experts' size where it is not ``feed_forward_length`` (Qwen's) and the shared expert's."""
    writer.add_expert_count(next(int(getattr(config, k)) for k in keys.experts_keys if getattr(config, k, None)))
    writer.add_expert_used_count(int(config.num_experts_per_tok))
    if keys.expert_size_key != "intermediate_size":
        writer.add_expert_feed_forward_length(int(getattr(config, keys.expert_size_key)))
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(int(config.shared_expert_intermediate_size))


def llama_cpp_rope_freqs(rope: Mapping[str, Any], dim: int) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter computes for a ``llama3`` scaling
    (``LlamaModel.generate_extra_tensors``), step by step as it does (torch fp32): each rotary
    frequency's divisor. Written independently of the product's ``llama3_divisors``, which
    must agree with it."""
    import torch

    base = rope.get("rope_theta", 10000.0)
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low_freq_factor = rope.get("low_freq_factor", 1.0)
    high_freq_factor = rope.get("high_freq_factor", 4.0)
    old_context_len = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    rope_factors: list[float] = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            rope_factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            rope_factors.append(float(factor))
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            rope_factors.append(float(1 / ((1 - smooth) / factor + smooth)))
    return torch.tensor(rope_factors, dtype=torch.float32).numpy()


def _rope_parameters(config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(rope of the full-attention layers, rope of the windowed ones)`` from transformers'
    ``rope_parameters``, flat or per layer type (Gemma 3: the file's rope.* keys are the full
    layers'; llama.cpp gives the windowed ones their own base)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(params.get("full_attention"), dict):
        return dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    return params, {}


def _config_float(config: Any, config_key: str, swa_rope: Mapping[str, Any]) -> float | None:
    """The value of a family's GGUF float key in ``config``; None where the config has none
    (transformers 5 keeps Gemma 3's ``rope_local_base_freq`` as the windowed layers' rope_theta)."""
    value = getattr(config, config_key, None)
    if value is None and config_key == "rope_local_base_freq":
        value = swa_rope.get("rope_theta")
    return None if value is None else float(value)


def _gguf_key(arch: str, key: str) -> str:
    """``{arch}.key`` checked against gguf-py's ``Keys``: a family-table key llama.cpp does not
    know would make files no converter writes."""
    import gguf

    known = {
        value
        for group in vars(gguf.Keys).values()
        if isinstance(group, type)
        for value in vars(group).values()
        if isinstance(value, str)
    }
    name = "{arch}." + key
    if name not in known:
        raise ValueError(f"{name} is not a GGUF metadata key gguf-py knows (family of {arch})")
    return name


def _add_tokenizer(writer: Any, src: Path, config: Any) -> None:
    """The checkpoint's byte-level BPE tokenizer as llama.cpp's ``gpt2`` tokenizer metadata."""
    from gguf import TokenType

    spec = json.loads((src / "tokenizer.json").read_text())
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(spec["model"]["vocab"])
    special = {t["content"]: t["id"] for t in spec["added_tokens"] if t.get("special")}
    vocab.update({t["content"]: t["id"] for t in spec["added_tokens"]})
    tokens = [""] * (max(vocab.values()) + 1)
    for token, index in vocab.items():
        tokens[index] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    qwen_split = spec.get("pre_tokenizer", {}).get("type") == "Sequence"
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if qwen_split else "gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    writer.add_add_bos_token(bool(tok_config.get("add_bos_token", False)))
    writer.add_chat_template(tok_config["chat_template"])


# ---- broken files ----------------------------------------------------------------------


def truncate(path: Path, *, drop: int | None = None, keep: int | None = None) -> Path:
    """Cut ``path`` short, as a download that stopped early does: the last ``drop`` bytes go,
    or all but the first ``keep``."""
    size = path.stat().st_size
    new_size = keep if keep is not None else size - (drop or 0)
    if not 0 <= new_size < size:
        raise ValueError(f"cannot cut {path} ({size} bytes) to {new_size} bytes")
    with open(path, "r+b") as f:
        f.truncate(new_size)
    return path


def set_tensor_type_number(path: Path, name: str, number: int) -> Path:
    """Overwrite the GGML type number recorded for tensor ``name`` in the tensor table (e.g.
    with one outside the enum, as a newer llama.cpp could write)."""
    from gguf import GGUFReader

    reader = GGUFReader(path, "r")
    tensor = next(t for t in reader.tensors if t.name == name)
    # a tensor-info field's parts: name length, name, n_dims, dims, type, offset
    type_part = tensor.field.parts[4]
    offset = int(tensor.field.offset) + sum(int(p.nbytes) for p in tensor.field.parts[:4])
    assert type_part.dtype == np.uint32 and int(type_part[0]) == int(tensor.tensor_type)
    del reader
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([number], dtype="<u4").tobytes())
    return path
