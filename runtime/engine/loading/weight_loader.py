"""Reading checkpoints into a model, one tensor at a time: HF safetensors, or GGUF.

Tensors are opened lazily (``safe_open`` slices), so a TP rank reads from disk only the
rows/columns of its shard; the layers' ``weight_loader`` decides which part that is.
Works for a single ``model.safetensors``, a sharded checkpoint with
``model.safetensors.index.json``, or any set of ``*.safetensors`` files.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from runtime.checkpoints.gguf.prepare import GGUFIndex, is_gguf_folder
from runtime.engine.layers.linear import LazyWeight
from runtime.engine.loading.gguf_tensors import iterate_gguf_weights
from runtime.engine.models.base import CausalLM
from runtime.engine.quant.gguf_blocks import KEPT_TYPES
from runtime.engine.quant.loading import (
    DUAL_METHOD,
    GGUF_METHODS,
    INT8_METHODS,
    GGUFFootprint,
    HeldWeights,
    check_quantization,
    finish_loading,
)

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class MissingWeightError(KeyError):
    """A tensor the model needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class SafetensorsWeight:
    """One checkpoint tensor, read in full or in part only when asked (see layers.linear.LazyWeight)."""

    def __init__(self, handle: object, name: str) -> None:
        self._slice = handle.get_slice(name)  # type: ignore[attr-defined]
        self.name = name

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = tuple(slice(None) for _ in range(dim)) + (slice(start, start + length),)
        return self._slice[index]

    def load(self) -> torch.Tensor:
        return self._slice[:]


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in index order when there is an index."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        names = sorted(set(weight_map.values()))
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint shard {f.name} listed in {INDEX_FILE} is missing from {folder}")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model folder {folder}")
    return files


def iterate_weights(folder: str | Path, progress: bool = True) -> Iterator[tuple[str, SafetensorsWeight]]:
    """Yield ``(name, lazy tensor)`` for every tensor of the checkpoint, with a progress bar."""
    files = checkpoint_files(folder)
    with tqdm(total=len(files), desc="Loading safetensors shards", unit="file", disable=not progress) as bar:
        for path in files:
            with safe_open(str(path), framework="pt", device="cpu") as handle:
                for name in handle.keys():
                    yield name, SafetensorsWeight(handle, name)
            bar.update(1)


def gguf_footprint(folder: str | Path) -> GGUFFootprint | None:
    """What the GGUF file of a prepared folder takes dense in bf16 and in its kept blocks (None: the
    folder is not a GGUF file's), from its index: nothing is read from the file."""
    if not is_gguf_folder(Path(folder)):
        return None
    tensors = GGUFIndex.read(Path(folder)).tensors
    dense = sum(2 * math.prod(t.shape) for t in tensors)
    blocks = sum(t.n_bytes for t in tensors if t.type_name in KEPT_TYPES and len(t.shape) == 2)
    return GGUFFootprint(dense, blocks)


def weight_bytes_estimate(
    folder: str | Path, dtype: torch.dtype, quantization: str | None, gguf: GGUFFootprint | None
) -> int:
    """At least the bytes the checkpoint's weights take once loaded in ``dtype`` under ``quantization``,
    from its index or headers alone (nothing is read): every tensor dense in ``dtype``; under ``gguf``
    only the kept blocks as the file stores them (repacked they take more, and the rest is dense on
    top); ``gguf_dual`` both. A lower bound, so that a model refused for it surely cannot fit. ``gguf``: the
    folder's ``gguf_footprint`` (None for a safetensors folder), which the caller has read already."""
    if gguf is not None:
        values, per_value = gguf.dense_bytes // 2, dtype.itemsize
        if quantization == "gguf":
            return gguf.block_bytes
        if quantization == DUAL_METHOD:
            return values * per_value + gguf.block_bytes
    else:
        values = 0
        for file in checkpoint_files(folder):
            with safe_open(str(file), framework="pt") as f:
                values += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return values * (1 if quantization in INT8_METHODS else dtype.itemsize)  # (int8: its linears' byte a value)


def load_model_weights(
    model: CausalLM,
    folder: str | Path,
    progress: bool = True,
    quantization: str | None = None,
    int8_activations: bool = False,
    refill: HeldWeights | None = None,
    bf16_prefill: bool = False,
) -> None:
    """Fill every parameter of ``model`` from the checkpoint (safetensors, or the GGUF file of a
    folder runtime.checkpoints.gguf.prepare made); errors name the tensor at fault. ``quantization`` (the
    ``--quantization`` method, ``runtime.engine.quant.loading``): which weights stay quantized;
    ``int8_activations`` (``--quantized-activations int8``) and ``bf16_prefill``
    (``quant.loading.bf16_prefill``): how their kernels multiply them; ``refill``
    (a weight update of a model whose weights are kept quantized: ``quant.loading.hold_kept_weights``):
    the served blocks that take the new ones in place."""
    targets = model.checkpoint_targets()
    is_gguf = is_gguf_folder(Path(folder))
    check_quantization(quantization, is_gguf)
    weights: Iterator[tuple[str, LazyWeight]]
    if is_gguf:
        weights = iterate_gguf_weights(
            Path(folder), targets, model.config, progress=progress, keep_quantized=quantization in GGUF_METHODS
        )
    else:
        weights = iterate_weights(folder, progress=progress)
    loaded = model.load_weights(weights)
    missing = sorted(set(targets) - loaded)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingWeightError(f"checkpoint {folder} has no tensor {missing[0]}{more}")
    finish_loading(model, quantization, int8_activations, refill, bf16_prefill)
    logger.info("loaded %d tensors from %s", len(loaded), folder)
