"""What Ollama's model routes (``GET /api/tags``, ``POST /api/show``, ``GET /api/ps``) say about the
served model, from what the checkpoint folder already holds: ``config.json`` (the architecture and its
sizes) and the weights' file headers (the parameter count, the number format), never the weights.

Ollama's own numbers come from its GGUF files; here the weights are a GGUF file (tinyserve prepares it
into a folder whose ``gguf.json`` lists its tensors) or safetensors files (whose headers list theirs).
``digest`` is a sha256 of the weights' identity (path, size, modification time), not of their bytes:
hashing gigabytes per listing is not worth what a client does with it (tell two models apart).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.checkpoints.gguf.prepare import GGUF_INDEX

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F32": "F32", "F16": "F16", "BF16": "BF16", "F64": "F64", "I8": "Q8_0", "U8": "U8"}
_MAX_HEADER = 100 << 20  # a safetensors header larger than this is not one


@dataclass(frozen=True)
class ModelFacts:
    """The served checkpoint as Ollama describes a model."""

    format: str  # "gguf" or "safetensors"
    architecture: str  # config.json's model_type ("llama", "qwen3"): Ollama's family
    parameter_count: int | None
    quantization: str  # GGUF's tensor type ("Q4_1"), or the safetensors dtype ("BF16")
    size: int  # bytes of the weights files
    modified_at: float  # their newest modification time (seconds)
    digest: str
    config: dict[str, Any] = field(default_factory=dict)

    def details(self) -> dict[str, Any]:
        """Ollama's ``details``."""
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.architecture,
            "families": [self.architecture],
            "parameter_size": parameter_size(self.parameter_count),
            "quantization_level": self.quantization,
        }

    def model_info(self, context_len: int) -> dict[str, Any]:
        """Ollama's ``model_info``: GGUF's metadata keys, from config.json (those the config has)."""
        arch, config = self.architecture, self.config
        info: dict[str, Any] = {"general.architecture": arch, f"{arch}.context_length": context_len}
        if self.parameter_count is not None:
            info["general.parameter_count"] = self.parameter_count
        for key, name in (
            ("hidden_size", "embedding_length"),
            ("num_hidden_layers", "block_count"),
            ("intermediate_size", "feed_forward_length"),
            ("num_attention_heads", "attention.head_count"),
            ("num_key_value_heads", "attention.head_count_kv"),
            ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
            ("rope_theta", "rope.freq_base"),
            ("vocab_size", "vocab_size"),
        ):
            if isinstance(config.get(key), (int, float)):
                info[f"{arch}.{name}"] = config[key]
        return info


def parameter_size(count: int | None) -> str:
    """Ollama's ``parameter_size``: "135M", "7.6B" ("" when unknown)."""
    if count is None:
        return ""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            value = count / scale
            return f"{value:.1f}{unit}" if value < 10 and unit == "B" else f"{value:.0f}{unit}"
    return str(count)


@functools.lru_cache(maxsize=4)
def model_facts(folder: str) -> ModelFacts:
    """The facts of the checkpoint ``folder`` (read once per folder: nothing in it changes while served;
    a weight update serves another folder)."""
    path = Path(folder)
    config = _json(path / "config.json")
    arch = str(config.get("model_type") or "unknown")
    index = path / GGUF_INDEX
    if index.is_file():
        return _gguf_facts(_json(index), arch, config)
    return _safetensors_facts(path, arch, config)


def _gguf_facts(index: dict[str, Any], arch: str, config: dict[str, Any]) -> ModelFacts:
    tensors = index.get("tensors", [])
    count = sum(math.prod(t["shape"]) for t in tensors) if tensors else None
    # The file's type is its matrices' most common one (the embeddings and norms often differ).
    kinds = Counter(t["type"] for t in tensors if len(t["shape"]) >= 2)
    identity = f"{index.get('file')}|{index.get('size')}|{index.get('mtime_ns')}"
    return ModelFacts(
        format="gguf",
        architecture=arch,
        parameter_count=count,
        quantization=kinds.most_common(1)[0][0] if kinds else "",
        size=int(index.get("size") or 0),
        modified_at=int(index.get("mtime_ns") or 0) / 1e9,
        digest=_digest(identity),
        config=config,
    )


def _safetensors_facts(folder: Path, arch: str, config: dict[str, Any]) -> ModelFacts:
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("*.bin"))
    stats = [f.stat() for f in files]
    count: int | None = 0
    dtypes: Counter[str] = Counter()
    for f in files:
        header = _safetensors_header(f) if f.suffix == ".safetensors" else None
        if header is None:
            count = None
            continue
        for name, tensor in header.items():
            if name != "__metadata__" and isinstance(tensor, dict):
                n = math.prod(tensor.get("shape", []))
                dtypes[str(tensor.get("dtype"))] += n
                count = None if count is None else count + n
    dtype = dtypes.most_common(1)[0][0] if dtypes else str(config.get("torch_dtype", "")).upper()
    identity = "|".join(f"{f}:{s.st_size}:{s.st_mtime_ns}" for f, s in zip(files, stats))
    return ModelFacts(
        format="safetensors",
        architecture=arch,
        parameter_count=count if files else None,
        quantization=_SAFETENSORS_DTYPES.get(dtype, dtype),
        size=sum(s.st_size for s in stats),
        modified_at=max((s.st_mtime for s in stats), default=0.0),
        digest=_digest(identity),
        config=config,
    )


def _safetensors_header(path: Path) -> dict[str, Any] | None:
    """The JSON header of a safetensors file (its first 8 bytes say how long it is)."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                return None
            header: dict[str, Any] = json.loads(f.read(length))
            return header
    except (OSError, ValueError, struct.error):
        logger.warning("cannot read the safetensors header of %s", path)
        return None


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _digest(identity: str) -> str:
    return "sha256:" + hashlib.sha256(identity.encode()).hexdigest()
