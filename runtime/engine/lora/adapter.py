"""Reading a PEFT LoRA folder: its config and its low-rank matrices, by the checkpoint module they adapt.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (or ``.bin``), tensors
named ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``.lora_B.weight`` (``[out, r]``)
per adapted module. The update a module's output gets is ``scaling * B (A x)`` with ``scaling =
alpha / r`` (rsLoRA: ``alpha / sqrt(r)``), where ``r`` and ``alpha`` may differ per module
(``rank_pattern`` / ``alpha_pattern``, keys matched against the module's name as PEFT matches them).
Dropout is a training-time operation and is not applied. Anything a plain LoRA adapter does not do
(DoRA, trained biases, whole modules saved beside the adapter, embedding or LM-head targets, expert
weights adapted as parameters) is refused with a message that names it, so an adapter never serves as
something it is not.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."


class LoraAdapterError(ValueError):
    """An adapter folder that cannot be served (the message names the folder and what is wrong)."""


@dataclass(frozen=True)
class LoraModule:
    """One adapted checkpoint module: ``a [r, in]``, ``b [out, r]`` (fp32, as read) and its scaling."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT adapter read from ``path``: its modules by checkpoint module name
    (``model.layers.0.self_attn.q_proj``), and the leaf names it targets (``q_proj``...)."""

    path: str
    modules: dict[str, LoraModule]

    @property
    def max_rank(self) -> int:
        return max((module.rank for module in self.modules.values()), default=0)

    @property
    def target_leaves(self) -> set[str]:
        return {name.rpartition(".")[2] for name in self.modules}


def _pattern_value(patterns: dict[str, object], module: str, default: float) -> float:
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: the first key that matches the end of the
    module's name (at a dot boundary, or the whole name) wins; none: the adapter's default. A key is a
    regex, grouped as PEFT groups it, so an alternation (``k_proj|o_proj``) is anchored as a whole."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(value)  # type: ignore[arg-type]
    return default


def _read_config(folder: Path) -> dict[str, object]:
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise LoraAdapterError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as exc:
        raise LoraAdapterError(f"{config_path}: not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise LoraAdapterError(f"{config_path}: not a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraAdapterError(f"{folder}: a {peft_type} adapter; only LoRA adapters are served")
    for key, what in (("use_dora", "DoRA"),):
        if config.get(key):
            raise LoraAdapterError(f"{folder}: {what} adapters are not served ({key} is set)")
    if str(config.get("bias", "none")) != "none":
        raise LoraAdapterError(f"{folder}: an adapter with trained biases (bias={config['bias']!r}) is not served")
    if config.get("target_parameters"):  # (peft's way to adapt a mixture of experts' expert weights)
        raise LoraAdapterError(
            f"{folder}: the adapter targets parameters, not projections (target_parameters="
            f"{config['target_parameters']}, such as a mixture of experts' experts); only attention and dense MLP "
            "projections take adapters"
        )
    if config.get("modules_to_save"):
        raise LoraAdapterError(
            f"{folder}: the adapter saves whole modules beside it ({config['modules_to_save']}); not served"
        )
    return config


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(str(path))
        loaded = torch.load(str(path), map_location="cpu", weights_only=True)
        return dict(loaded)
    raise LoraAdapterError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")


def read_adapter(path: str | Path) -> LoraAdapter:
    """The adapter in PEFT folder ``path`` (``LoraAdapterError`` naming what is wrong)."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoraAdapterError(f"{folder}: not a folder")
    config = _read_config(folder)
    tensors = _read_tensors(folder)
    default_rank = float(config.get("r", 8))  # type: ignore[arg-type]
    default_alpha = float(config.get("lora_alpha", default_rank))  # type: ignore[arg-type]
    rank_pattern = dict(config.get("rank_pattern") or {})  # type: ignore[call-overload]
    alpha_pattern = dict(config.get("alpha_pattern") or {})  # type: ignore[call-overload]
    rslora = bool(config.get("use_rslora", False))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key[len(_PEFT_PREFIX) :] if key.startswith(_PEFT_PREFIX) else key
        for side in ("lora_A", "lora_B"):
            marker = f".{side}."
            if marker in name:
                module = name.split(marker)[0]
                pairs.setdefault(module, {})[side] = tensor
                break
        else:
            if ".base_layer." in name:  # (peft saves it beside an adapter on the embeddings or the LM head)
                raise LoraAdapterError(
                    f"{folder}: tensor {key} is a whole weight of {name.split('.base_layer.')[0]}, not a LoRA "
                    "matrix (an adapter on the embeddings or the LM head); not served"
                )
            if "lora_embedding" in name or "lora_magnitude" in name:
                raise LoraAdapterError(f"{folder}: tensor {key} is not a plain LoRA matrix; not served")
            raise LoraAdapterError(f"{folder}: tensor {key} is not a LoRA matrix")
    modules: dict[str, LoraModule] = {}
    for module, sides in sorted(pairs.items()):
        if set(sides) != {"lora_A", "lora_B"}:
            raise LoraAdapterError(f"{folder}: module {module} has {sorted(sides)} but not both lora_A and lora_B")
        a, b = sides["lora_A"].float(), sides["lora_B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise LoraAdapterError(
                f"{folder}: module {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not make a "
                "low-rank product (want [r, in] and [out, r])"
            )
        rank = int(a.shape[0])
        declared = _pattern_value(rank_pattern, module, default_rank)
        if int(declared) != rank:
            raise LoraAdapterError(f"{folder}: module {module} has rank {rank}, the config says {int(declared)}")
        alpha = _pattern_value(alpha_pattern, module, default_alpha)
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules[module] = LoraModule(a=a, b=b, scaling=scaling)
    if not modules:
        raise LoraAdapterError(f"{folder}: the adapter has no LoRA matrices")
    return LoraAdapter(path=str(folder), modules=modules)
