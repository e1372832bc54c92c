"""A GGUF file's tensors as lazy checkpoint weights, dequantized only where read (or, under
``--quantization gguf``, handed to the layers in their blocks: ``GGUFWeight.quantized``).

The file is memory-mapped, so nothing is read until a layer's weight loader asks; a TP
rank that narrows a weight to its rows (column-parallel) dequantizes only those rows, and
one that narrows to its columns (row-parallel) only those whole quantization blocks when
the shard boundary falls on a block edge (it does for every TP split of the shapes we
serve). Dequantization is the ``gguf`` package's reference numpy code, to fp32; the
layer's loader converts to the serving dtype.

llama.cpp's llama converter stores each Q/K head's rows interleaved (its RoPE rotates
adjacent pairs, ours and transformers' rotate halves); ``GGUFWeight`` undoes that per head. Its
Gemma converter stores norm weights plus one (the family's ``gguf_norm_offset``), which
``GGUFWeight`` subtracts again, as transformers' GGUF loader does.

A mixture of experts' merged ``*_exps`` tensors are read as one 2-D tensor per expert
(``runtime.checkpoints.gguf.experts.expert_entry``: each expert's bytes lie together), each a
``GGUFWeight`` of its own: a rank that holds only some experts (``--ep-size``) reads only theirs, the
dense load dequantizes only the experts loaded, and under ``--quantization gguf`` each expert's
projections keep their blocks, rows (gate/up) or whole blocks of columns (down) alike.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch
from tqdm.auto import tqdm

from runtime.checkpoints.families import BY_NAME
from runtime.checkpoints.gguf.experts import as_matrix, dense_mlp_name, expert_tensors
from runtime.checkpoints.gguf.reader import GGUFError, TensorEntry
from runtime.engine.model_config import ModelConfig
from runtime.engine.quant.gguf_blocks import KEPT_TYPES, from_gguf
from runtime.engine.quant.weight import QuantizedWeight

logger = logging.getLogger(__name__)


def _quant_sizes(type_name: str) -> tuple[int, int]:
    """(elements per block, bytes per block) of a GGML type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]


def _dequantize(raw: np.ndarray, type_name: str) -> np.ndarray:
    """fp32 rows from raw bytes rows (uint8, whole blocks) of ``type_name``."""
    from gguf import GGMLQuantizationType, dequantize

    out = dequantize(raw, GGMLQuantizationType[type_name])
    return out if out.dtype == np.float32 else out.astype(np.float32)


class GGUFWeight:
    """One GGUF tensor behind the ``LazyWeight`` protocol (see runtime.engine.layers.linear)."""

    def __init__(
        self,
        data: np.ndarray,
        entry: TensorEntry,
        name: str,
        qk_heads: int | None = None,
        keep_quantized: bool = False,
        offset: float = 0.0,
    ) -> None:
        self.name = name  # the HF name the model loads it as
        self.entry = entry
        self._offset = offset  # subtracted from every value read (a norm stored as 1 + w: Gemma's)
        # --quantization gguf: a weight of a type the kernels read is handed over in its blocks
        self.keeps_blocks = keep_quantized and entry.type_name in KEPT_TYPES and len(entry.shape) == 2
        self._qk_heads = qk_heads  # heads to un-interleave (a llama Q/K weight or bias), else None
        rows = entry.shape[0] if len(entry.shape) > 1 else 1
        self._cols = entry.shape[-1]
        self._block, type_size = _quant_sizes(entry.type_name)
        self._raw = data[entry.offset : entry.offset + entry.n_bytes].reshape(
            rows, self._cols // self._block * type_size
        )
        self._type_size = type_size

    @property
    def shape(self) -> tuple[int, ...]:
        return self.entry.shape

    def load(self) -> torch.Tensor:
        return self._to_torch(self._rows(0, self.shape[0]))

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if len(self.shape) == 1:
            if dim != 0:
                raise IndexError(f"{self.name}: a 1-D tensor has no dim {dim}")
            return self._to_torch(self._rows(start, length))
        if dim == 0:
            return self._to_torch(self._rows(start, length))
        if dim != 1:
            raise IndexError(f"{self.name}: a 2-D tensor has no dim {dim}")
        if self._qk_heads is None and start % self._block == 0 and length % self._block == 0:
            first, count = start // self._block * self._type_size, length // self._block * self._type_size
            return self._to_torch(_dequantize(self._raw[:, first : first + count], self.entry.type_name))
        return self.load()[:, start : start + length]

    def quantized(self, dim: int, start: int, length: int) -> QuantizedWeight | None:
        """``narrow(dim, start, length)`` kept in its blocks (repacked, ``runtime.engine.quant.gguf_blocks``):
        rows, or whole blocks of columns; None where this weight is not kept quantized (a layer's
        loader then reads it dense)."""
        if not self.keeps_blocks:
            return None
        if dim == 0:
            raw, cols = self._raw_rows(start, length), self._cols
        elif dim == 1 and start % self._block == 0 and length % self._block == 0:
            first = start // self._block * self._type_size
            raw = self._raw_rows(0, self.shape[0])[:, first : first + length // self._block * self._type_size]
            cols = length
        else:
            return None
        return from_gguf(np.ascontiguousarray(raw), self.entry.type_name, cols)  # (a copy: never a view of the file)

    def _raw_rows(self, start: int, length: int) -> np.ndarray:
        """Rows [start, start + length) of a 2-D tensor's blocks in the HF row order (see ``_rows``)."""
        heads, total = self._qk_heads, self.shape[0]
        if not heads:
            return self._raw[start : start + length]
        head_rows = total // heads
        if start % head_rows or length % head_rows:
            return self._raw_rows(0, total)[start : start + length]
        raw = self._raw[start : start + length]
        return raw.reshape(-1, head_rows // 2, 2, raw.shape[1]).swapaxes(1, 2).reshape(length, raw.shape[1])

    def _rows(self, start: int, length: int) -> np.ndarray:
        """Dequantized rows [start, start + length) in the HF row order, shaped like the tensor."""
        heads = self._qk_heads
        total = self.shape[0]
        head_rows = total // heads if heads else 0
        if heads and (start % head_rows or length % head_rows):  # not head-aligned: un-interleave all
            return self._rows(0, total)[start : start + length]
        if len(self.shape) == 1:
            values = _dequantize(self._raw, self.entry.type_name)[0][start : start + length]
        else:
            values = _dequantize(self._raw[start : start + length], self.entry.type_name)
        if self._offset:
            values = values - np.float32(self._offset)  # (a new array: never a write into the file)
        if heads:
            # GGUF row 2j + a of a head is HF row a * head_rows / 2 + j (a in {0, 1}).
            tail = values.shape[1:]
            values = values.reshape(-1, head_rows // 2, 2, *tail).swapaxes(1, 2).reshape(length, *tail)
        return values

    @staticmethod
    def _to_torch(values: np.ndarray) -> torch.Tensor:
        if not values.flags.writeable or not values.flags.c_contiguous:
            values = np.array(values, dtype=np.float32, order="C")  # never hand torch a view of the file
        return torch.from_numpy(values)


def open_mapped(path: Path, size: int, mtime_ns: int) -> np.ndarray:
    """The GGUF file as read-only bytes; GGUFError when it changed since it was indexed."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        raise GGUFError(f"GGUF file {path} (indexed when it was prepared) no longer exists") from None
    if stat.st_size != size or stat.st_mtime_ns != mtime_ns:
        raise GGUFError(f"GGUF file {path} changed after it was prepared; start the server again to re-read it")
    return np.memmap(path, dtype=np.uint8, mode="r")


def hf_tensor_names(architecture: str, num_layers: int, hf_names: Iterable[str]) -> dict[str, str]:
    """GGUF tensor name -> HF name, for the HF names the model loads, from the ``gguf``
    package's own name table (llama.cpp's converter writes by it). Experts are not in it
    (``runtime.checkpoints.gguf.experts`` names them)."""
    import gguf

    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == architecture), gguf.MODEL_ARCH.LLAMA)
    table = gguf.get_tensor_name_map(arch, num_layers)
    mapping: dict[str, str] = {}
    for hf_name in hf_names:
        gguf_name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is not None:
            mapping[gguf_name] = hf_name
    return mapping


def _model_tensors(
    entry: TensorEntry, names: dict[str, str], wanted: set[str], moe: bool
) -> Iterator[tuple[str, TensorEntry]]:
    """``(model name, tensor)`` for each tensor of ``entry`` the model reads: itself under its table
    name, or (a mixture of experts) its experts, or a dense block's MLP tensor, which the MoE name
    tables lack."""
    name = names.get(entry.name)
    if name is not None:
        yield name, as_matrix(entry)
    elif moe:
        yield from expert_tensors(entry, wanted)
        dense = dense_mlp_name(entry.name)
        if dense is not None and dense in wanted:
            yield dense, entry


def iterate_gguf_weights(
    folder: Path, hf_names: Iterable[str], config: ModelConfig, progress: bool = True, keep_quantized: bool = False
) -> Iterator[tuple[str, GGUFWeight]]:
    """``(HF name, lazy weight)`` for every tensor of a prepared GGUF checkpoint the model reads
    (``config``: the folder's, for the layer count and the heads to un-interleave); with
    ``keep_quantized`` (``--quantization gguf``) the weights of the kept types offer their blocks."""
    from runtime.checkpoints.gguf.prepare import GGUFIndex

    index = GGUFIndex.read(folder)
    data = open_mapped(index.file, index.size, index.mtime_ns)
    wanted = set(hf_names)
    names = hf_tensor_names(index.architecture, config.num_hidden_layers, wanted)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    norm_offset = BY_NAME[config.family].gguf_norm_offset
    for entry in tqdm(index.tensors, desc=f"Loading {index.file.name}", unit="tensor", disable=not progress):
        tensors = list(_model_tensors(entry, names, wanted, config.num_experts > 0))
        if not tensors:
            logger.debug("GGUF tensor %s is not used by this model", entry.name)
            continue
        kind = entry.name.split(".")[2] if entry.name.startswith("blk.") else ""
        qk_heads = heads.get(kind) if index.unpermute_qk else None
        offset = norm_offset if entry.name.endswith("norm.weight") else 0.0
        for name, tensor in tensors:
            yield name, GGUFWeight(data, tensor, name, qk_heads, keep_quantized, offset)
