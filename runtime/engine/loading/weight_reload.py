"""Reloading a served model's weights in place from another checkpoint of the same model (SGLang's
``update_weights_from_disk``: an RL loop serves each rollout with the weights it just trained).

Why in place, through the start-up loader (``load_model_weights``): every parameter keeps its tensor,
so the KV pool sized at start-up stays right, captured CUDA graphs read the new values, and each
layer's own ``weight_loader`` cuts this TP rank's shard as it did at start-up (a loader drops the
device's copy of the old values; ``prepare_model`` makes them again).

Why checks first: a load that fails half-way leaves a model of two checkpoints. The new config must
describe the same model (architecture and every shape, the norms' epsilon, the RoPE: what the layers
were built from) and, for safetensors, hold every tensor this model reads with the served shapes;
those are read from the files' headers before any weight is written. Whatever still fails (a
truncated file, an unreadable shard) is undone by reloading the served checkpoint. Under TP the ranks
agree before they keep the new weights: if any rank failed, every rank goes back, so the ranks never
serve different checkpoints.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from runtime.checkpoints.gguf.prepare import is_gguf_folder
from runtime.engine.distributed import get_tp_group
from runtime.engine.loading.weight_loader import checkpoint_files, load_model_weights
from runtime.engine.model_config import ModelConfig
from runtime.engine.models.base import CausalLM
from runtime.engine.ops import DeviceOps
from runtime.engine.quant.loading import DUAL_METHOD, GGUF_METHODS, hold_kept_weights, release_kept_weights

logger = logging.getLogger(__name__)

# ModelConfig fields a reload may change: they do not shape the model (the stop tokens stay the
# served ones: the scheduler read them at start-up).
MAY_DIFFER = frozenset({"path", "raw", "checkpoint_dtype", "eos_token_ids", "bos_token_id", "pad_token_id"})
LOAD_FORMATS = (None, "auto", "safetensors", "gguf")
# --quantization methods whose weights reload in place: dense ones, gguf_dual (its dense values keep
# their tensors; its blocks are made again from the new file, as at start-up) and gguf (the new file's
# blocks are written into the served ones, which must be of the same formats). int8's are made at
# load from the dense values, which are not kept: nothing to load into.
RELOADABLE_METHODS = (None, DUAL_METHOD, "gguf")


class WeightReloadError(ValueError):
    """The new weights were refused or could not be loaded; the served ones are in place."""


class ReloadTarget(Protocol):
    """What a reload needs of the model runner (``ModelRunner``)."""

    model: CausalLM
    model_config: ModelConfig
    model_path: Path
    ops: DeviceOps
    device: torch.device
    tp_size: int
    ep_size: int  # --ep-size: a new config is read for the same split of the experts
    quantization: str | None
    int8_activations: bool  # --quantized-activations int8: the kept blocks' numerics
    bf16_prefill: bool  # the kept blocks' long prefills in bf16 (quant.loading.bf16_prefill)


def reload_weights(runner: ReloadTarget, folder: Path, load_format: str | None = None) -> None:
    """Load ``folder``'s weights into ``runner``'s model in place (every TP rank calls this at the
    same step). WeightReloadError, with the served weights in place, when it cannot."""
    served = runner.model_path
    failure: str | None = None
    touched = False
    try:
        check_reload(runner, folder, load_format)
        touched = True
        _load(runner, folder)
    except Exception as exc:  # refused (WeightReloadError) or failed half-way: undone below
        failure = str(exc) if isinstance(exc, WeightReloadError) else f"loading {folder} failed: {exc}"
    failed_ranks = _failed_ranks(runner, failure is not None)
    if failed_ranks == 0:
        runner.ops.prepare_model(runner.model)
        runner.model_path = folder
        logger.info("reloaded the weights from %s", folder)
        return
    if failure is None:
        failure = f"{failed_ranks} other TP rank(s) could not load {folder} (see their log)"
    if touched:  # this rank wrote some of the new weights: the served checkpoint again
        try:
            _load(runner, served)
        except Exception as exc:  # not a WeightReloadError: the caller must not serve on
            raise RuntimeError(f"{failure}; reloading the served weights from {served} failed too: {exc}") from exc
        runner.ops.prepare_model(runner.model)
    logger.warning("weights not reloaded, still serving %s: %s", served, failure)
    raise WeightReloadError(failure)


def _load(runner: ReloadTarget, folder: Path) -> None:
    """The start-up loader over the served model; weights kept in their blocks (``gguf``) take the new
    file's blocks in place (``hold_kept_weights``), and keep the served ones if the load fails."""
    held = hold_kept_weights(runner.model) if runner.quantization in GGUF_METHODS else None
    try:
        load_model_weights(
            runner.model,
            folder,
            progress=False,
            quantization=runner.quantization,
            int8_activations=runner.int8_activations,
            refill=held,
            bf16_prefill=runner.bf16_prefill,
        )
    finally:
        if held is not None:
            release_kept_weights(held)


def check_reload(runner: ReloadTarget, folder: Path, load_format: str | None) -> None:
    """WeightReloadError unless ``folder`` holds the served model's weights in ``load_format``."""
    if load_format not in LOAD_FORMATS:
        formats = ", ".join(str(f) for f in LOAD_FORMATS[1:])
        raise WeightReloadError(f"load_format {load_format!r} is not supported; choose from {formats} (or null)")
    if runner.quantization not in RELOADABLE_METHODS:
        raise WeightReloadError(
            f"this server made its weights int8 at load (--quantization {runner.quantization}) and keeps "
            "no dense values to load new ones into: start it with --quantization none to update its "
            "weights from disk"
        )
    if not folder.is_dir():
        raise WeightReloadError(f"model_path {folder} is not a checkpoint folder")
    gguf = is_gguf_folder(folder)
    if load_format in ("safetensors", "gguf") and gguf != (load_format == "gguf"):
        raise WeightReloadError(f"{folder} holds {'GGUF' if gguf else 'safetensors'} weights, not {load_format}")
    if runner.quantization == "gguf" and not gguf:
        raise WeightReloadError(
            f"{folder} holds safetensors weights; this server keeps a GGUF file's blocks (--quantization gguf, "
            "chosen by auto on a CPU without native bf16 unless given) and reloads only GGUF files of the same formats"
        )
    current = runner.model_config
    try:
        new = ModelConfig.from_pretrained(folder, context_length=current.context_len, ep_size=runner.ep_size)
    except Exception as exc:
        raise WeightReloadError(f"cannot read the config of {folder}: {exc}") from None
    differs = config_difference(current, new)
    if differs is not None:
        raise WeightReloadError(f"{folder} is not a checkpoint of the served model: {differs}")
    if not gguf and not is_gguf_folder(runner.model_path):
        shapes_differ = tensor_difference(runner.model, runner.model_path, folder)
        if shapes_differ is not None:
            raise WeightReloadError(f"{folder} does not match the served weights: {shapes_differ}")


def config_difference(current: ModelConfig, new: ModelConfig) -> str | None:
    """The first field in which ``new`` describes another model than ``current``; None: the same."""
    for field in dataclasses.fields(ModelConfig):
        if field.name in MAY_DIFFER:
            continue
        was, now = getattr(current, field.name), getattr(new, field.name)
        if was != now:
            return f"its {field.name} is {now!r}, the served model's {was!r}"
    return None


def tensor_difference(model: CausalLM, served: Path, folder: Path) -> str | None:
    """The first tensor ``model`` reads that ``folder``'s safetensors lack or hold in another shape
    than ``served``'s (read from the files' headers only); None: all there, all alike."""
    targets = model.checkpoint_targets()
    was, now = _target_shapes(model, served, targets), _target_shapes(model, folder, targets)
    for name in sorted(set(targets)):
        if name in was and name not in now:
            return f"it has no tensor {name}"
        if name in was and was[name] != now[name]:
            return f"its tensor {name} has shape {list(now[name])}, the served one {list(was[name])}"
    return None


def _target_shapes(model: CausalLM, folder: Path, targets: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                target = model.checkpoint_name(name)
                if target in targets:
                    shapes[target] = tuple(handle.get_slice(name).get_shape())
    return shapes


def _failed_ranks(runner: ReloadTarget, failed: bool) -> int:
    """How many TP ranks failed (every rank asks at the same step: a collective)."""
    if runner.tp_size == 1:
        return int(failed)
    flag = torch.tensor([1 if failed else 0], dtype=torch.int32, device=runner.device)
    return int(get_tp_group().all_reduce(flag).item())
