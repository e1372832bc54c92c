"""Mixtures of experts in a GGUF file: their metadata, their tensors' shapes and their names.

llama.cpp's converters (``qwen2moe``, ``qwen3moe``, ``olmoe``, and ``llama`` for Mixtral) state the
experts in the metadata as ``{arch}.expert_count`` and ``{arch}.expert_used_count`` (top-k), each
routed expert's size as ``{arch}.expert_feed_forward_length`` where it is not the model's
``feed_forward_length`` (the Qwen families), and Qwen2-MoE's shared expert's as
``{arch}.expert_shared_feed_forward_length``. A sparse block holds the router ``ffn_gate_inp``
(``[E, H]``) and the experts' projections, either merged into one 3-D tensor per projection
(``ffn_gate_exps`` / ``ffn_up_exps``: ``[E, I, H]``, ``ffn_down_exps``: ``[E, H, I]``, numpy order:
GGUF's ``ne`` reversed) or, in Mixtral files of the older converter, one 2-D tensor per expert
(``ffn_gate.{e}``, ``ffn_up.{e}``, ``ffn_down.{e}``). Qwen2-MoE adds ``ffn_{gate,up,down}_shexp``
and the shared expert's gate ``ffn_gate_inp_shexp``, which the converter writes ``[1, H]`` and
llama.cpp's quantizer rewrites 1-D (it drops trailing unit dims): both are read as ``[1, H]``.

Whether the top-k weights are renormalised is not in the file (llama.cpp hard-codes it in each
architecture's graph: ``qwen3moe`` and Mixtral's ``llama`` renormalise, ``qwen2moe`` and ``olmoe`` do
not); a file that states ``{arch}.expert_weights_norm`` (newer converters do for other families) is
taken at its word. transformers' GGUF loader, the project's oracle, defaults Qwen3-MoE's
``norm_topk_prob`` to True for the same reason and leaves Qwen2-MoE's at its config default, False.

Which layers are sparse is not in the metadata either: a block with a router is sparse, one without
is the model's dense MLP (``mlp_only_layers``; stored under the dense names ``ffn_gate`` / ``ffn_up``
/ ``ffn_down`` that llama.cpp uses for the dense blocks of other mixtures, as its ``qwen2moe`` and
``qwen3moe`` tables have none).

A merged tensor's experts lie one after another in the file (the expert is GGUF's outermost
dimension), so each expert is a tensor of its own: ``expert_entry`` gives its bytes' place, and the
weight reader (``runtime.engine.loading.gguf_tensors``) reads, dequantizes or keeps quantized only
the experts a rank holds. Plain data: no torch, as the rest of this package.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Iterator

from runtime.checkpoints.families import Family, MoeKeys
from runtime.checkpoints.gguf.reader import GGUFContents, GGUFError, TensorEntry

ROUTER = "ffn_gate_inp"
SHARED_GATE = "ffn_gate_inp_shexp"
_HF_PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
_MERGED = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")
_DENSE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)\.weight$")


def expert_count(contents: GGUFContents) -> int:
    """``{arch}.expert_count`` (0: a dense file)."""
    return int(contents.arch_value("expert_count", 0) or 0)


def moe_config(contents: GGUFContents, family: Family, num_layers: int, intermediate: int) -> dict[str, Any]:
    """The ``config.json`` keys of a mixture of experts' sparse layers (none for a dense family),
    under the names the family's config uses (``MoeKeys``); GGUFError where the file names no
    experts or its top-k is missing."""
    keys = family.moe
    if keys is None:
        return {}
    experts = expert_count(contents)
    if experts <= 0:
        raise GGUFError(
            f"{contents.path}: a {family.name} file needs metadata key {contents.architecture}.expert_count > 0"
        )
    used = contents.arch_value("expert_used_count")
    if used is None:
        raise GGUFError(f"{contents.path}: metadata key {contents.architecture}.expert_used_count is missing")
    config: dict[str, Any] = {keys.experts_keys[0]: experts, "num_experts_per_tok": int(used)}
    if keys.expert_size_key != "intermediate_size":
        # llama.cpp's fallback where the key is missing: feed_forward_length / top-k
        config[keys.expert_size_key] = int(contents.arch_value("expert_feed_forward_length", intermediate // int(used)))
    if any(f"blk.{i}.ffn_gate_shexp.weight" in contents.tensors for i in range(num_layers)):
        config["shared_expert_intermediate_size"] = int(
            contents.arch_value("expert_shared_feed_forward_length", intermediate)
        )
    if keys.renormalize_key is not None:
        stated = contents.arch_value("expert_weights_norm")
        renormalize = bool(stated) if stated is not None else keys.gguf_renormalize
        config[keys.renormalize_key] = renormalize
    dense = [i for i in range(num_layers) if f"blk.{i}.{ROUTER}.weight" not in contents.tensors]
    if dense:
        config["mlp_only_layers"] = dense
    return config


def sparse_layer(config: dict[str, Any], layer: int) -> bool:
    """Whether layer ``layer`` of a GGUF file's ``config`` (``hf_config``'s) is sparse."""
    return layer not in config.get("mlp_only_layers", ())


def sparse_block_shapes(config: dict[str, Any], keys: MoeKeys, merged: bool) -> dict[str, tuple[int, ...]]:
    """A sparse block's MLP tensors (names after ``blk.N.``) -> shapes, rows first; ``merged``: the
    experts in ``*_exps`` tensors, else one tensor per expert (older Mixtral files)."""
    hidden, experts = config["hidden_size"], int(config[keys.experts_keys[0]])
    size = int(config[keys.expert_size_key])
    shapes: dict[str, tuple[int, ...]] = {f"{ROUTER}.weight": (experts, hidden)}
    per_expert = {"gate": (size, hidden), "up": (size, hidden), "down": (hidden, size)}
    for proj, shape in per_expert.items():
        if merged:
            shapes[f"ffn_{proj}_exps.weight"] = (experts, *shape)
        else:
            shapes.update({f"ffn_{proj}.{e}.weight": shape for e in range(experts)})
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if shared:
        shapes.update(
            {
                "ffn_gate_shexp.weight": (shared, hidden),
                "ffn_up_shexp.weight": (shared, hidden),
                "ffn_down_shexp.weight": (hidden, shared),
                f"{SHARED_GATE}.weight": (1, hidden),
            }
        )
    return shapes


def shape_matches(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """``shape`` is ``expected``, or the 1-D form of a ``[1, H]`` shared-expert gate (quantized files)."""
    if shape == expected:
        return True
    return name.endswith(f".{SHARED_GATE}.weight") and expected[:1] == (1,) and shape == expected[1:]


def as_matrix(entry: TensorEntry) -> TensorEntry:
    """A 1-D shared-expert gate as the ``[1, H]`` matrix the model loads (the same bytes)."""
    if entry.name.endswith(f".{SHARED_GATE}.weight") and len(entry.shape) == 1:
        return replace(entry, shape=(1, entry.shape[0]))
    return entry


def hf_expert_name(layer: int, expert: int, proj: str) -> str:
    """The model's name of layer ``layer``'s expert ``expert``'s projection ``proj`` (gate/up/down)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{_HF_PROJECTIONS[proj]}.weight"


def expert_entry(entry: TensorEntry, expert: int) -> TensorEntry:
    """Expert ``expert`` of a merged ``[E, rows, cols]`` tensor as a 2-D tensor of its own: its rows'
    blocks lie together, the ``expert``-th of ``E`` equal runs of the tensor's bytes."""
    experts = entry.shape[0]
    if len(entry.shape) != 3 or entry.n_bytes % experts or not 0 <= expert < experts:
        raise GGUFError(f"tensor {entry.name} of shape {entry.shape} has no expert {expert}")
    size = entry.n_bytes // experts
    return TensorEntry(f"{entry.name}#{expert}", entry.type_name, entry.shape[1:], entry.offset + expert * size, size)


def expert_tensors(entry: TensorEntry, wanted: set[str]) -> Iterator[tuple[str, TensorEntry]]:
    """``(model name, 2-D tensor)`` for each expert in GGUF tensor ``entry`` whose name is in ``wanted``
    (the experts a rank holds): every expert of a merged ``*_exps`` tensor, or the one of an older
    per-expert tensor; nothing for any other tensor."""
    merged = _MERGED.match(entry.name)
    if merged:
        layer, proj = int(merged.group(1)), merged.group(2)
        for expert in range(entry.shape[0] if len(entry.shape) == 3 else 0):
            name = hf_expert_name(layer, expert, proj)
            if name in wanted:
                yield name, expert_entry(entry, expert)
        return
    single = _PER_EXPERT.match(entry.name)
    if single:
        name = hf_expert_name(int(single.group(1)), int(single.group(3)), single.group(2))
        if name in wanted:
            yield name, entry


def dense_mlp_name(gguf_name: str) -> str | None:
    """The model's name of a dense block's MLP tensor in a mixture-of-experts file (``blk.N.ffn_up``:
    the names llama.cpp's MoE tables lack); None for any other tensor."""
    match = _DENSE.match(gguf_name)
    if match is None:
        return None
    return f"model.layers.{match.group(1)}.mlp.{_HF_PROJECTIONS[match.group(2)]}.weight"
