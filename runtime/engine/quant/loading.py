"""How a layer keeps its weight quantized while it loads (``--quantization``, SGLang's flag).

- ``gguf``: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights stay in their blocks (repacked,
  ``runtime.engine.quant.gguf_blocks``); the lazy GGUF weight hands a layer's loader its shard's blocks
  (``quantized_shard``: rows, or whole blocks of columns) instead of dequantized values. Weights in
  other types (F32, F16, the rarer quants) load dense as before. Every weight of a layer is kept,
  the token embedding (rows dequantized as they are looked up) and a tied LM head with it.
- ``int8`` / ``w8a8_int8``: every linear layer's weight (not the embedding or an untied LM head,
  as SGLang's w8a8_int8 leaves them) becomes per-output-channel symmetric int8 once loaded, from
  any checkpoint.
- None or ``none``: every weight dense in the serving dtype, a GGUF file's dequantized at load
  (greedy output then equals transformers' on the dequantized model, the project's oracle).
- ``auto`` (launch.py's default): ``gguf`` for a GGUF file on a CPU without native bf16 matmul when the
  dtype is ``auto`` too, else dense (``resolve_quantization`` says why).

A layer collects the quantized shards its loader is handed (``PendingShards``), and
``finish_loading`` (after the whole checkpoint is read) swaps its dense ``weight`` parameter for
the stacked ``QuantizedWeight``; a layer whose shards came in different layouts, or only partly
quantized, stays dense (the quantized parts are dequantized into it).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from runtime.engine.quant.weight import QuantizedWeight, cat_rows, quantize_int8, zero_rows

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("gguf", "int8", "w8a8_int8")
INT8_METHODS = ("int8", "w8a8_int8")


def resolve_quantization(
    method: str | None, dtype: str | torch.dtype, device: torch.device, is_gguf: bool, native_bf16: bool
) -> str | None:
    """The method a model loads with: ``method``, or with ``auto`` the CPU's choice; None: dense.

    ``auto`` keeps a GGUF file's blocks (``gguf``) on a CPU without native bf16 matmul (AVX2, or
    AVX-512 without BF16), where the dense alternative is fp32: on a 2-core AVX2-only EPYC the
    default model's Q4_1 blocks served one user 77 tok/s against 37 dense in fp32 (a step streams
    an eighth of the bytes) and 64 concurrent users 152 against 160 output tok/s, in an eighth of
    the memory. With native bf16 the dense bf16 model serves a loaded server 2.3x faster than the
    blocks and one user at least as fast as llama.cpp, so it stays dense. Only with ``--dtype auto``:
    a dtype asked for (fp32 for the oracle's exactness, say) means dense weights in it."""
    if method != "auto":
        return None if method in (None, "none") else method
    wants_blocks = device.type == "cpu" and dtype == "auto" and is_gguf and not native_bf16
    return "gguf" if wants_blocks else None


def quantization_reason(method: str | None, chosen: str | None, is_gguf: bool) -> str:
    """Why ``resolve_quantization`` chose ``chosen``, for the start-up log."""
    if method != "auto":
        return "--quantization"
    if chosen is not None:
        return "auto: a GGUF file on a CPU without native bf16 matmul keeps its blocks"
    if not is_gguf:
        return "auto: not a GGUF file"
    return "auto: dense (native bf16 matmul, a GPU, or --dtype given)"


def check_quantization(method: str | None, is_gguf: bool) -> None:
    """ValueError for a method this checkpoint cannot be loaded with."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {method!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    if method == "gguf" and not is_gguf:
        raise ValueError(
            "--quantization gguf keeps a GGUF file's weights quantized: the model is not a GGUF file "
            "(use int8 for a safetensors checkpoint)"
        )


def quantized_shard(weight: Any, dim: int, start: int, length: int) -> QuantizedWeight | None:
    """The blocks of ``weight``'s shard (``narrow(dim, start, length)``) where the lazy weight keeps
    them quantized (a GGUF weight under ``--quantization gguf``), else None."""
    take = getattr(weight, "quantized", None)
    return take(dim, start, length) if take is not None else None


def dense_weight(module: nn.Module) -> torch.Tensor:
    """A layer's ``weight`` while the checkpoint loads: the dense parameter (its ``weight_loader``
    hangs off it, and ``finish_loading`` swaps in a ``QuantizedWeight`` only after reading it)."""
    weight = module.weight
    assert isinstance(weight, torch.Tensor), f"{type(module).__name__}.weight is {type(weight).__name__}"
    return weight


class PendingShards:
    """The quantized shards a layer's loader was handed, by the first row they fill in its weight."""

    def __init__(self) -> None:
        self.parts: dict[int, QuantizedWeight] = {}

    def take(self, weight: Any, dim: int, start: int, length: int, row_offset: int) -> bool:
        """Keep ``weight``'s shard quantized if it comes quantized; False: load it dense."""
        shard = quantized_shard(weight, dim, start, length)
        if shard is None:
            self.parts.pop(row_offset, None)
            return False
        self.parts[row_offset] = shard
        return True


def finish_loading(model: nn.Module, method: str | None) -> None:
    """Swap every layer's dense weight for its quantized one (see the module doc); call once, after
    the checkpoint is read. Logs the weights kept quantized, by format."""
    kept: dict[str, int] = {}
    for module in list(model.modules()):  # (weights become sub-modules below)
        pending: PendingShards | None = getattr(module, "quant_shards", None)
        if pending is None:
            continue
        tied = getattr(module, "tied_to", None)
        if tied is not None:
            if isinstance(tied.weight, QuantizedWeight):
                _replace(module, tied.weight)
            continue
        quantized = _stacked(module, pending)
        if quantized is None and method in INT8_METHODS and getattr(module, "int8_quantizable", False):
            quantized = quantize_int8(dense_weight(module))
        pending.parts.clear()
        if quantized is not None:
            _replace(module, quantized)
            kept[quantized.source] = kept.get(quantized.source, 0) + 1
    if kept:
        logger.info("weights kept quantized: %s", ", ".join(f"{n} {src}" for src, n in sorted(kept.items())))


def _stacked(module: nn.Module, pending: PendingShards) -> QuantizedWeight | None:
    """The module's quantized weight from its shards, or None (dense: any quantized shard of a
    weight that cannot be all quantized is dequantized into the dense parameter)."""
    if not pending.parts:
        return None
    weight = dense_weight(module)
    rows = sorted(pending.parts.items())
    covered = sum(p.shape[0] for _, p in rows)
    offsets_ok = all(o == sum(p.shape[0] for _, p in rows[:i]) for i, (o, _) in enumerate(rows))
    layouts = {(p.kind, p.group) for _, p in rows}
    padding = weight.shape[0] - covered
    if offsets_ok and len(layouts) == 1 and (padding == 0 or (padding > 0 and getattr(module, "pads_rows", False))):
        parts = [p for _, p in rows] + ([zero_rows(rows[0][1], padding)] if padding else [])
        stacked = cat_rows(parts) if len(parts) > 1 else parts[0]
        return stacked.to(weight.device)
    logger.info(
        "%s: shards of mixed formats (%s) load dense",
        type(module).__name__,
        ", ".join(sorted({p.source for _, p in rows})),
    )
    with torch.no_grad():
        for offset, part in rows:
            weight.data[offset : offset + part.shape[0]].copy_(part.dequantize(dtype=weight.dtype))
    return None


def _replace(module: nn.Module, quantized: QuantizedWeight) -> None:
    """``module.weight`` becomes ``quantized`` (a sub-module: its buffers are the model's); the dense
    parameter is dropped (its memory freed once no other module shares it)."""
    ops = getattr(module, "ops", None)
    if ops is not None and isinstance(module.weight, torch.Tensor):
        ops.weight_loaded(module.weight)  # drop any device copy of the dense values
    del module.weight
    module.weight = quantized


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """Resident bytes of ``model``'s weights kept quantized, by source format (each weight once: a
    tied LM head's is the embedding's)."""
    seen: set[int] = set()
    by_format: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeight) and id(module) not in seen:
            seen.add(id(module))
            by_format[module.source] = by_format.get(module.source, 0) + module.nbytes()
    return by_format
