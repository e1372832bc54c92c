"""How a layer keeps its weight quantized while it loads (``--quantization``, SGLang's flag).

- ``gguf``: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K weights stay in their blocks (repacked,
  ``runtime.engine.quant.gguf_blocks``); the lazy GGUF weight hands a layer's loader its shard's blocks
  (``quantized_shard``: rows, or whole blocks of columns) instead of dequantized values. Weights in
  other types (F32, F16, the rarer quants) load dense as before. Every weight of a layer is kept,
  the token embedding (rows dequantized as they are looked up) and a tied LM head with it.
- ``gguf_dual``: the same blocks, and the dense values beside them (dequantized from the blocks, as
  the dense load makes them): the blocks are a sub-module of the weight's layer (``weight_blocks``,
  so the model's buffers count them; a tied LM head reads its embedding's, ``quant.weight.weight_blocks``). A decode step of
  few rows reads the blocks (a fraction of the bytes), a prefill or a loaded batch the dense values
  (no dequantization per product): both at the memory of both.
- ``int8`` / ``w8a8_int8``: every linear layer's weight (not the embedding or an untied LM head,
  as SGLang's w8a8_int8 leaves them) becomes per-output-channel symmetric int8 once loaded, from
  any checkpoint.
- None or ``none``: every weight dense in the serving dtype, a GGUF file's dequantized at load
  (greedy output then equals transformers' on the dequantized model, the project's oracle).
- ``auto`` (launch.py's default): for a GGUF file with ``--dtype auto`` on a CPU, ``gguf`` without
  native bf16 matmul, ``gguf_dual`` with it on AVX512-BF16 without AMX (where both forms fit), else dense
  (``resolve_quantization`` says why).

How the kept weights multiply their activations on a CPU (``--quantized-activations``,
``activation_numerics``): weight-only by default (each block dequantized in cache, the activations as
they are: the dense model's answers), or with the activations quantized to int8 per block for decode
steps of a few rows (llama.cpp's numerics), which the int8 method's weights always use.

A layer collects the quantized shards its loader is handed (``PendingShards``), and
``finish_loading`` (after the whole checkpoint is read) swaps its dense ``weight`` parameter for
the stacked ``QuantizedWeight``. A merged layer whose shards came in different layouts (a Q4_K_M
file's Q4_K q/k and Q6_K v: most K-quant files mix formats so) keeps each run of shards of one
layout as a band of a ``QuantizedBands`` (``runtime.engine.quant.weight`` says why bands); a layer
only partly quantized (a shard in F16, or in a type not kept) stays dense (the quantized parts are
dequantized into it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from runtime.engine.ops.linear_weights import LinearWeightLayer
from runtime.engine.quant.weight import (
    KEPT_WEIGHTS,
    KeptWeight,
    QuantizedBands,
    QuantizedWeight,
    cat_rows,
    quantize_int8,
    zero_rows,
)

logger = logging.getLogger(__name__)

DUAL_METHOD = "gguf_dual"  # the blocks beside the dense values
GGUF_METHODS = ("gguf", DUAL_METHOD)  # the GGUF file's blocks are kept
INT8_METHODS = ("int8", "w8a8_int8")
QUANTIZATION_METHODS = (*GGUF_METHODS, *INT8_METHODS)


# auto keeps both forms (gguf_dual) only while they take at most this share of the host's RAM (every
# data-parallel replica's copy): where memory is what limits, the blocks alone (with their bf16
# kernels) take a third of it and leave the KV pool the rest.
DUAL_RAM_SHARE = 1 / 3


@dataclass(frozen=True)
class GGUFFootprint:
    """What a GGUF file's weights take in each form (``runtime.engine.loading.weight_loader.gguf_footprint``)."""

    dense_bytes: int  # every tensor dense in bf16
    block_bytes: int  # the tensors of kept types, as the file stores them


def resolve_quantization(
    method: str | None,
    dtype: str | torch.dtype,
    device: torch.device,
    gguf: GGUFFootprint | None,
    native_bf16: bool,
    amx: bool,
    ram_share_bytes: int,
) -> tuple[str | None, str]:
    """The method a model loads with (None: dense) and why, for the start-up log: ``method``, or
    with ``auto`` the CPU's choice for a GGUF file (``gguf``: its footprint; None for another
    checkpoint) when ``dtype`` is auto too (a dtype asked for, fp32 for the oracle's exactness say,
    means dense weights in it). ``ram_share_bytes``: what the weights of one replica may take.

    - Without native bf16 matmul (AVX2, AVX-512 without BF16) the dense model would be fp32: its
      blocks (``gguf``) served one user 77 tok/s against 37 dense on a 2-core AVX2-only EPYC and 64
      users 152 against 160 output tok/s, in an eighth of the memory.
    - With native bf16, both forms (``gguf_dual``): one user 151 tok/s against 94 dense bf16 on a
      2-core AVX-512 EPYC, 64 users 500 against 502 (dense bf16 values for prefills and large
      batches, the blocks for decode steps of a few rows), at the memory of both (the dense values
      live in the packed copy the CPU kernels read: ``LinearWeightLayer.release_values``). Where both
      would take more than ``ram_share_bytes``, the blocks alone (``gguf``, bf16 activations: their own
      kernel up to 32 rows, the weight dequantized to bf16 above): Qwen2.5-Coder-1.5B Q4_K_M on that
      EPYC served in 3.05 GiB against gguf_dual's 6.2 (PSS; llama.cpp's server 3.49), a 2,000-token
      prompt in 14.7 s against 13.3 s, but 16 users at 31.6 output tok/s against 46.0 (its
      16-row steps on the blocks' bf16 dot products against oneDNN's on dense values). On CPUs with
      AMX tiles (``amx``), whose dense kernels the blocks were never measured against, dense bf16
      stays the default until an AMX host's figures say otherwise."""
    if method != "auto":
        return (None if method in (None, "none") else method), "--quantization"
    if device.type != "cpu" or dtype != "auto" or gguf is None or gguf.block_bytes == 0:
        return None, "auto: dense (a GPU, --dtype given, or no quantized GGUF weights)"
    if not native_bf16:
        return "gguf", "auto: this CPU has no native bf16 matmul, where the GGUF blocks serve best"
    if amx:
        return None, "auto: dense bf16 on AMX tiles (both forms not yet measured on an AMX host)"
    if gguf.dense_bytes + gguf.block_bytes > ram_share_bytes:
        return (
            "gguf",
            f"auto: the blocks alone, bf16 activations (both forms would take over {DUAL_RAM_SHARE:.0%} of RAM)",
        )
    return DUAL_METHOD, "auto: blocks for decode steps of a few rows, dense bf16 values for the rest"


def bf16_prefill(method: str | None, dtype: str | torch.dtype, device: torch.device, native_bf16: bool) -> bool:
    """Whether the weights ``method`` keeps in their blocks (``gguf``) multiply a long prefill in bf16
    (``QuantizedWeight.bf16_prefill``): the weight dequantized, then it and the activations rounded to
    bf16, ~1.75x fp32's speed (docs/quantization.md), with gguf_dual's prefill numerics (its dense
    bf16 values). Only on a CPU with native bf16 matmul (``native_bf16``, the CPU class the caller
    decided on: emulated bf16 is slower than fp32) and with ``--dtype auto``: a dtype asked for (fp32
    for the oracle's exactness) keeps the fp32 product. ``gguf_dual``'s prefills read its dense
    values; the int8 methods' weights keep fp32."""
    return method == "gguf" and device.type == "cpu" and dtype == "auto" and native_bf16


def activation_numerics(method: str | None, int8_activations: bool, bf16_prefill: bool = False) -> str:
    """How the weights kept by ``method`` multiply their activations, and why, for the start-up line."""
    if method is None:
        return "dense weights"
    if method in INT8_METHODS:
        return "int8 activations (w8a8)"
    prefill = ", long prefills in bf16 (native bf16 matmul)" if bf16_prefill else ""
    if int8_activations:
        return (
            "int8 activations for decode steps of a few rows (--quantized-activations int8, llama.cpp's numerics)"
            + prefill
        )
    return (
        "weight-only: the activations as they are, the dense model's answers (--quantized-activations none)" + prefill
    )


def check_quantization(method: str | None, is_gguf: bool) -> None:
    """ValueError for a method this checkpoint cannot be loaded with."""
    if method is not None and method not in QUANTIZATION_METHODS:
        raise ValueError(f"--quantization {method!r} is not one of {', '.join(QUANTIZATION_METHODS)}")
    if method in GGUF_METHODS and not is_gguf:
        raise ValueError(
            f"--quantization {method} keeps a GGUF file's weights quantized: the model is not a GGUF file "
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


HeldWeights = dict[nn.Module, KeptWeight]


def hold_kept_weights(model: nn.Module) -> HeldWeights:
    """Before a ``gguf`` model's weights are loaded again (a weight update): each layer whose weight is
    kept in its blocks (not a tied head, which shares its embedding's) gets back a stand-in parameter
    of the dense shape on the meta device, with its loader, so that the loader is handed the new
    file's blocks as at start-up (nothing is ever written to the stand-in). ``finish_loading(refill=)``
    then writes the new blocks into the served ones; ``release_kept_weights`` puts back whatever a
    failed load left standing in."""
    held: HeldWeights = {}
    for module in list(model.modules()):
        weight = module._modules.get("weight")
        if getattr(module, "quant_shards", None) is None or getattr(module, "tied_to", None) is not None:
            continue
        if isinstance(weight, KEPT_WEIGHTS):
            del module.weight
            stand_in = nn.Parameter(torch.empty(weight.shape, device="meta"), requires_grad=False)
            stand_in.weight_loader = module.weight_loader  # type: ignore[attr-defined]
            module.weight = stand_in
            held[module] = weight
    return held


def release_kept_weights(held: HeldWeights) -> None:
    """Every layer of ``held`` whose stand-in is still in place gets its served blocks back."""
    for module, weight in held.items():
        if not isinstance(module._modules.get("weight"), KEPT_WEIGHTS):
            _replace(module, weight)


def finish_loading(
    model: nn.Module,
    method: str | None,
    int8_activations: bool = False,
    refill: HeldWeights | None = None,
    bf16_prefill: bool = False,
) -> None:
    """Swap every layer's dense weight for its quantized one (see the module doc); call once, after
    the checkpoint is read. ``int8_activations`` (--quantized-activations int8): the kept blocks'
    products for few rows quantize the activations (``QuantizedWeight.int8_activations``; the int8
    method's always do). ``bf16_prefill`` (the rule of that name): the kept blocks' long-prefill
    products run in bf16 (``QuantizedWeight.bf16_prefill``). ``refill`` (``hold_kept_weights``): the
    layers whose served blocks take the new ones in place (same formats and shapes, else ValueError naming the layer). Logs the weights
    kept quantized, by format."""
    kept: dict[str, int] = {}
    for module in list(model.modules()):  # (weights become sub-modules below)
        pending: PendingShards | None = getattr(module, "quant_shards", None)
        if pending is None:
            continue
        tied = getattr(module, "tied_to", None)
        if tied is not None:
            if isinstance(tied.weight, KEPT_WEIGHTS):
                _replace(module, tied.weight)
            continue  # (gguf_dual: the same tensor; the head reads its embedding's blocks, weight_blocks)
        if refill is not None and module in refill:
            _refill(module, _stacked(module, pending, refill[module].device), refill[module])
            pending.parts.clear()
            kept[refill[module].source] = kept.get(refill[module].source, 0) + 1
            continue
        quantized = _stacked(module, pending)
        if quantized is None and method in INT8_METHODS and getattr(module, "int8_quantizable", False):
            quantized = quantize_int8(dense_weight(module))
        pending.parts.clear()
        if quantized is not None:
            quantized.int8_activations = int8_activations or method in INT8_METHODS
            quantized.bf16_prefill = bf16_prefill and method not in INT8_METHODS
            (_attach if method == DUAL_METHOD and not _lookups_only(module) else _replace)(module, quantized)
            kept[quantized.source] = kept.get(quantized.source, 0) + 1
    if kept:
        logger.info("weights kept quantized: %s", ", ".join(f"{n} {src}" for src, n in sorted(kept.items())))


def _stacked(module: nn.Module, pending: PendingShards, device: torch.device | None = None) -> KeptWeight | None:
    """The module's quantized weight from its shards, on ``device`` (default: its dense weight's):
    one ``QuantizedWeight`` where the shards share a layout, else a ``QuantizedBands`` of each run
    of shards of one layout; or None (dense: any quantized shard of a weight that cannot be all
    quantized is dequantized into the dense parameter)."""
    if not pending.parts:
        return None
    weight = dense_weight(module)
    rows = sorted(pending.parts.items())
    covered = sum(p.shape[0] for _, p in rows)
    offsets_ok = all(o == sum(p.shape[0] for _, p in rows[:i]) for i, (o, _) in enumerate(rows))
    padding = weight.shape[0] - covered
    if offsets_ok and (padding == 0 or (padding > 0 and getattr(module, "pads_rows", False))):
        parts = [p for _, p in rows] + ([zero_rows(rows[-1][1], padding)] if padding else [])
        bands = [cat_rows(run) if len(run) > 1 else run[0] for run in _layout_runs(parts)]
        stacked: KeptWeight = bands[0] if len(bands) == 1 else QuantizedBands(bands)
        return stacked.to(device if device is not None else weight.device)
    logger.info(
        "%s: shards in %s beside dense ones load dense",
        type(module).__name__,
        ", ".join(sorted({p.source for _, p in rows})),
    )
    with torch.no_grad():
        for offset, part in rows:
            weight.data[offset : offset + part.shape[0]].copy_(part.dequantize(dtype=weight.dtype))
    return None


def _layout_runs(parts: list[QuantizedWeight]) -> list[list[QuantizedWeight]]:
    """``parts`` (in row order) cut into runs of one layout (kind, group, with or without mins):
    each run stacks into one band."""
    runs: list[list[QuantizedWeight]] = []
    for part in parts:
        if runs and _layout(runs[-1][-1]) == _layout(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _layout(weight: QuantizedWeight) -> tuple[str, int, bool, bool]:
    return weight.kind, weight.group, weight.mins is None, weight.supers is None


def _refill(module: nn.Module, new: KeptWeight | None, served: KeptWeight) -> None:
    """The served blocks take ``new``'s values in place (every tensor keeps its storage, as a dense
    reload keeps its parameters'); the layer gets them back as its weight. Bands refill band by
    band: the new file must bring the same bands (formats and rows)."""
    served_bands = served.bands()
    new_bands = [] if new is None else new.bands()
    if len(new_bands) != len(served_bands) or any(
        (o, n.kind, n.group, n.shape, n.mins is None) != (p, s.kind, s.group, s.shape, s.mins is None)
        or (s.supers is not None and n.supers is None)  # (served plain, new in super-blocks: expanded below)
        for (o, n), (p, s) in zip(new_bands, served_bands)
    ):
        found = "dense values" if new is None else f"{new.source} blocks as {_kinds(new)}"
        raise ValueError(
            f"{type(module).__name__}: the new checkpoint's weight is {found}, where the served one is "
            f"{served.source} blocks as {_kinds(served)}: a weight kept quantized reloads only in the same format"
        )
    with torch.no_grad():
        for (_, part), (_, fresh) in zip(served_bands, new_bands):
            if part.supers is None:  # (served plain: a device whose kernels read that form only)
                fresh.expand_scales_()
            elif fresh.supers is not None:
                part.supers.copy_(fresh.supers)
            part.qs.copy_(fresh.qs)
            part.scales.copy_(fresh.scales)
            if part.mins is not None and fresh.mins is not None:
                part.mins.copy_(fresh.mins)
    _replace(module, served)


def _kinds(weight: KeptWeight) -> str:
    """The layouts of ``weight``'s bands, for an error message (``q4``, ``q4+q8``)."""
    return "+".join(part.kind for _, part in weight.bands())


def _replace(module: nn.Module, quantized: KeptWeight) -> None:
    """``module.weight`` becomes ``quantized`` (a sub-module: its buffers are the model's); the dense
    parameter is dropped (its memory freed once no other module shares it)."""
    _drop_plan(module)  # the device's plan was for the dense values
    del module.weight
    module.weight = quantized


def _lookups_only(module: nn.Module) -> bool:
    """Whether ``module``'s weight is only looked up, never multiplied: a token embedding that no LM head
    shares. ``gguf_dual`` keeps such a weight in its blocks alone: a lookup dequantizes its rows to the
    dense values bit for bit (the blocks' fp32 values, cast), so dense values beside them would serve
    nothing (Qwen2.5-Coder-1.5B: 0.47 GB)."""
    return not isinstance(module, LinearWeightLayer) and getattr(module, "tied_head", True) is None


def _attach(module: nn.Module, quantized: KeptWeight) -> None:
    """``gguf_dual``: the dense ``module.weight`` gets the blocks' values (what the dense load gives:
    the blocks dequantized to fp32, then cast) and keeps the blocks beside them."""
    weight = dense_weight(module)
    with torch.no_grad():
        weight.data.copy_(quantized.dequantize())
    _drop_plan(module)  # the device's plan was made of the values before, without the blocks
    module.weight_blocks = quantized  # (a sub-module: its buffers are the model's)


def _drop_plan(module: nn.Module) -> None:
    """Drop the device's plan for ``module``'s weight (a linear layer's, or a tied LM head's through
    its embedding's loader), whose values or form just changed."""
    for layer in (module, getattr(module, "tied_head", None)):
        if isinstance(layer, LinearWeightLayer):
            layer.drop_plan()


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
