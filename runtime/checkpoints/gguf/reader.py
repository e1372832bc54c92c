"""Opening a GGUF file with the ``gguf`` package, with errors that name the file.

``read_gguf`` parses the header once (metadata and tensor table) and checks everything a
loader would otherwise trip over halfway: a file that is not GGUF, one cut short (a tensor
reaching past the end), tensor types we cannot dequantize. The result, ``GGUFContents``,
is plain data (metadata values and a tensor index) so it can be written to JSON by
``prepare.py`` and the scheduler never has to parse the header again.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any, Iterator

# The types gguf's numpy dequantization handles that tinyserve loads (llama.cpp's common
# weight types; the importance-matrix IQ types and the 1-2 bit ternary ones are left out).
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


class GGUFError(ValueError):
    """A GGUF file tinyserve cannot load; the message names the file and what is wrong."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives in the file. ``shape`` is numpy order (rows first), as the
    model wants it: a GGUF ``[in, out]`` weight is ``(out, in)`` here."""

    name: str
    type_name: str  # a GGMLQuantizationType name, e.g. "Q4_1"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": self.type_name,
            "shape": list(self.shape),
            "offset": self.offset,
            "n_bytes": self.n_bytes,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "TensorEntry":
        return cls(
            str(raw["name"]),
            str(raw["type"]),
            tuple(int(d) for d in raw["shape"]),
            int(raw["offset"]),
            int(raw["n_bytes"]),
        )


@dataclass
class GGUFContents:
    """A GGUF file's metadata (key -> value; big token tables are left out) and tensor index."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]
    # The gguf package's parse of the file (``shared_parse``: transformers' converters read it too).
    reader: Any = dataclass_field(default=None, repr=False, compare=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` (e.g. ``llama.block_count``), or ``default``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)


# Metadata arrays kept out of GGUFContents.metadata: the tokenizer tables (tens of thousands of
# strings) are read by transformers' converter, not by us; their length is kept instead.
_TABLE_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges")


def _unreadable(path: Path, size: int, exc: Exception) -> str:
    """What is wrong with a file GGUFReader could not parse. gguf-py reports a file cut short
    (the usual fault: an interrupted download) only as a numpy error about the memory-mapped
    bytes, wherever the cut falls (header, tensor table or tensor data), so it is named here."""
    detail = f"{type(exc).__name__}: {exc}"
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        return f"{path} is not a GGUF file (it does not start with the GGUF magic number)"
    if "is not a valid" in str(exc):  # an enum value this gguf package does not know
        return f"{path} is not a readable GGUF file: {detail} (written by a newer llama.cpp, or corrupt)"
    return (
        f"{path} is not a readable GGUF file, probably truncated (an incomplete download?): "
        f"it has {size} bytes and reading it failed with {detail}"
    )


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse and check ``path``; GGUFError when it is not a loadable GGUF file."""
    path = Path(path)
    try:
        from gguf import GGMLQuantizationType, GGUFReader
    except ImportError:  # pragma: no cover - a declared dependency
        raise GGUFError(f"{path}: loading GGUF files needs the 'gguf' package (pip install gguf)") from None
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path, "r")
    except (ValueError, IndexError, OverflowError, TypeError, KeyError) as exc:
        raise GGUFError(_unreadable(path, size, exc)) from None
    metadata: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if key in _TABLE_KEYS:
            metadata[f"{key}#count"] = len(field.data)
            continue
        try:
            metadata[key] = field.contents()
        except (ValueError, UnicodeDecodeError) as exc:
            raise GGUFError(f"{path}: metadata key {key} cannot be read: {exc}") from None
    tensors: dict[str, TensorEntry] = {}
    supported = {getattr(GGMLQuantizationType, n) for n in SUPPORTED_TENSOR_TYPES}
    for t in reader.tensors:
        qtype = GGMLQuantizationType(t.tensor_type)
        if qtype not in supported:
            raise GGUFError(
                f"{path}: tensor {t.name} has type {qtype.name}, which tinyserve cannot "
                f"dequantize (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})"
            )
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(f"{path} is truncated: tensor {t.name} ends at byte {end}, the file has {size}")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = TensorEntry(t.name, qtype.name, shape, int(t.data_offset), int(t.n_bytes))
    return GGUFContents(path, metadata, tensors, reader)


@contextlib.contextmanager
def shared_parse(contents: GGUFContents) -> Iterator[None]:
    """Within the block, the gguf package's reader opened on ``contents.path`` is the parse
    ``read_gguf`` made. transformers parses a GGUF file anew for the config and again for the tokenizer
    it converts, and the reader walks the token table element by element: for Gemma 3's 262k tokens
    ~20 s a parse on two cores, twice, at a model's first start. (transformers imports the reader
    when it reads a file, so the module attribute is what it finds.)"""
    import gguf

    original = gguf.GGUFReader
    parsed = contents.reader

    def open_reader(path: Any, mode: Any = "r") -> Any:
        same = parsed is not None and mode == "r" and Path(path).resolve() == contents.path.resolve()
        return parsed if same else original(path, mode)

    gguf.GGUFReader = open_reader  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]
