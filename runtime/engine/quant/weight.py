"""A linear layer's weight kept quantized: ``QuantizedWeight`` and its plain-torch meaning.

Why a weight stays quantized: a decode step of one request streams every weight once, so its
time is the weights' bytes over the memory bandwidth; a GGUF file's Q4_1 weights are ~0.6 bytes
a parameter where the dense fp32 copy is 4. The kernels (``runtime.engine.cpu.quant_kernels``,
``runtime.engine.cuda.quant_matmul``) read two layouts, and every source format is repacked into one of
them at load, losslessly (the dequantized values are the source's, bit for bit):

- ``q8``: int8 values, one fp32 scale per ``group`` values of a row: ``w = scale * q``. GGUF Q8_0
  (group 32), Q5_0 (its 5-bit values less 16), GGUF Q6_K (its 6-bit values widened to int8, one scale
  per 16: ``d * sub-scale``), and the per-output-channel int8 of ``--quantization int8`` (group = the
  row). With groups of 32 it may carry a min per block too, ``w = scale * q + min``: GGUF Q5_1
  (``d``, ``m``) and Q5_K (each 32-value sub-block's ``d * sc`` and ``-dmin * m``), 5-bit values.
- ``q4``: 4-bit values packed two a byte, per block of 32 a scale and a min, both fp32:
  ``w = scale * q + min``. GGUF Q4_0 (``min = -8 * d``), Q4_1 (``d``, ``m``) and Q4_K (each
  32-value sub-block's ``d * sc`` and ``-dmin * m``). Within a block, byte ``j`` holds value ``j``
  in its low nibble and value ``j + 16`` in its high nibble (GGUF Q4_0/Q4_1's order).

Scales and mins come in one of two forms. Plain: fp32, as above. Super-block (the K-quants: ``supers``
set): what the fp32 values are products of, an 8-bit code per group (``scales``: uint8 per 32 with a
uint8 min code per 32 in ``mins``, Q4_K and Q5_K; int8 per 16 without mins, Q6_K) and per 256 values
the fp32 factors ``d`` and ``dmin`` (``supers [out, in // 256, 2]``): ``scale = d * code``, ``min =
-(dmin * min code)``, the same fp32 products, 3 bytes per 32 values where the plain form takes 8. A
decode step reads every weight byte once, so the form is a quarter of a Q4_K weight's bytes a token
(0.59 bytes a value against 0.75; the file's own 0.5625). The CPU kernels decode a row's scales at a
time (csrc/quant_layout.h: row_scales); ``scale_values`` gives them for the torch reference and
``expand_scales_`` turns a weight plain for kernels that read only that form (the Triton kernel).

The weight is an ``nn.Module`` holding its tensors as buffers, so ``model.buffers()`` counts its
real resident bytes and ``.to()`` moves it. A layer hands it to ``DeviceOps.linear`` in place of
a dense weight; ``TorchOps`` dequantizes and multiplies (the reference every kernel is tested
against), the CPU and Triton ops run their kernels on the packed bytes. Owned by its layer (a
tied LM head shares the embedding's).

A merged linear (q/k/v, gate/up) whose checkpoint parts come in different formats (a Q4_K_M file's
Q4_K q/k beside a Q6_K v) is a ``QuantizedBands``: consecutive row ranges, each a
``QuantizedWeight`` in its own layout. Why bands and not one common layout: no layout takes every
format losslessly at its own size. Q4_K (q4, 0.59 bytes a value) would become int8 values with a
scale and a min per 32 (1.09 bytes), and Q6_K's two scales per 32 (``d * sc`` per 16, any two int8
``sc``) fit one scale per 32 only when one divides the other with the values still in int8, which a
real file does not promise; a common per-16 layout with mins would take 1.5 bytes a value for all.
Bands keep each part at its format's bytes, and the kernels already write any run of output columns
(their output row stride): each band is one call into its columns of the one output
(``KeptWeight.bands``). ``KeptWeight`` is either form, what a layer's ``weight`` may be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 32  # values per block of both layouts (a q8 group divides it or is a multiple of it)
KINDS = ("q8", "q4")


class QuantizedWeight(nn.Module):
    """``[out, in]`` weight in layout ``kind`` (see the module doc); ``source`` names the format it
    came from (a GGUF type name, or ``int8``) for logs and ``server_info``."""

    # The buffers registered in __init__ (declared for the type checker: nn.Module's attribute
    # lookup of a buffer is typed ``Tensor | Module``).
    qs: torch.Tensor  # q8: int8 [out, in]; q4: uint8 [out, in // 2]
    scales: torch.Tensor  # fp32 [out, in // group] (super-block form: int8 or uint8 codes)
    mins: torch.Tensor | None  # q4: fp32, scales' shape (super-block form: uint8 codes); None for a q8 weight
    supers: torch.Tensor | None  # the super-block form's fp32 factors [out, in // 256, 2] (d, dmin); else None
    shape: tuple[int, int]

    def __init__(
        self,
        kind: str,
        source: str,
        shape: tuple[int, int],
        qs: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None = None,
        group: int = BLOCK,
        int8_activations: bool = False,
        supers: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        out_features, in_features = shape
        if kind not in KINDS:
            raise ValueError(f"unknown quantized layout {kind!r} (one of {KINDS})")
        per_row = in_features // 2 if kind == "q4" else in_features
        if in_features % BLOCK or qs.shape != (out_features, per_row):
            raise ValueError(f"{source}: packed values of shape {tuple(qs.shape)} do not hold a {shape} weight")
        if kind == "q4" and (group != BLOCK or mins is None or mins.shape != scales.shape):
            raise ValueError(f"{source}: a q4 weight needs one scale and one min per block of {BLOCK}")
        if kind == "q8" and mins is not None and (group != BLOCK or mins.shape != scales.shape):
            raise ValueError(f"{source}: a q8 weight's mins come one per block of {BLOCK}, with its scales")
        if in_features % group or scales.shape != (out_features, in_features // group):
            raise ValueError(f"{source}: scales of shape {tuple(scales.shape)} for groups of {group} of {shape}")
        if supers is not None:
            _check_super_form(source, shape, scales, mins, group, supers)
        elif not scales.is_floating_point() or (mins is not None and not mins.is_floating_point()):
            raise ValueError(f"{source}: 8-bit scale codes come with their super-block factors (supers)")
        self.kind, self.source, self.group = kind, source, group
        # How a CPU kernel multiplies it for a few rows (runtime.engine.cpu.quant_kernels): False, the
        # activations as they are (weight-only: the dense model's numbers); True, the activations
        # quantized to int8 per block of 32 (llama.cpp's numerics: --quantized-activations int8, and
        # the int8 method's w8a8 always). Set once, as the checkpoint loads.
        self.int8_activations = int8_activations
        # How it multiplies a long prefill's rows (``quant_kernels.DENSE_MIN_ROWS`` on), dequantized
        # whole: False in fp32; True in bf16 (the weight and the activations rounded to bf16, as a dense
        # bf16 model's products: ``loading.bf16_prefill`` says where). Set once, as the checkpoint loads.
        self.bf16_prefill = False
        self.shape = (out_features, in_features)
        self.register_buffer("qs", qs.contiguous())
        plain = supers is None  # (the super-block form's codes stay 8-bit)
        self.register_buffer("scales", (scales.float() if plain else scales).contiguous())
        self.register_buffer("mins", None if mins is None else (mins.float() if plain else mins).contiguous())
        self.register_buffer("supers", None if supers is None else supers.float().contiguous())

    @property
    def dtype(self) -> torch.dtype:
        """The packed values' dtype (never a float: code asking for a dense weight's dtype sees it is not one)."""
        return self.qs.dtype

    @property
    def device(self) -> torch.device:
        return self.qs.device

    def nbytes(self) -> int:
        """Resident bytes: packed values, scales and mins (and the super-block form's factors)."""
        tensors = (self.qs, self.scales, self.mins, self.supers)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integer values as int32 ``[rows, in]`` (all rows, or those indexed by ``rows``)."""
        qs = self.qs if rows is None else self.qs.index_select(0, rows)
        if self.kind == "q8":
            return qs.to(torch.int32)
        blocks = qs.reshape(qs.shape[0], -1, BLOCK // 2).to(torch.int32)
        return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(qs.shape[0], -1)

    def scale_values(self, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The fp32 scales and mins (None without) ``[rows, in // group]`` of all rows or ``rows``:
        the plain form's own, or the super-block form's products (``d * code``, ``-(dmin * code)``)."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t if rows is None else t.index_select(0, rows)

        scales = pick(self.scales)
        mins = None if self.mins is None else pick(self.mins)
        if self.supers is None:
            return scales, mins
        factors = pick(self.supers).repeat_interleave(256 // self.group, dim=1)  # [rows, groups, 2]
        decoded = factors[..., 0] * scales.float()
        return decoded, None if mins is None else -(factors[..., 1] * mins.float())

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight (or its rows ``rows``) in ``dtype``: fp32 products, as the kernels scale."""
        scales, mins = self.scale_values(rows)
        values = self.values(rows).float().reshape(scales.shape[0], scales.shape[1], -1)
        dense = values * scales.unsqueeze(-1)
        if mins is not None:
            dense += mins.unsqueeze(-1)
        return dense.reshape(scales.shape[0], -1).to(dtype)

    def expand_scales_(self) -> None:
        """In place, the plain form of the same values (``scale_values``): for kernels that read fp32
        scales only (the Triton kernel); a no-op on a plain weight."""
        if self.supers is None:
            return
        scales, mins = self.scale_values()
        self.scales, self.mins, self.supers = scales.contiguous(), mins, None

    def bands(self) -> list[tuple[int, QuantizedWeight]]:
        """``(first output row, weight)`` of each band: one, the whole weight (see ``QuantizedBands``)."""
        return [(0, self)]

    def extra_repr(self) -> str:
        numerics = (", int8 activations" if self.int8_activations else "") + (
            ", bf16 prefill" if self.bf16_prefill else ""
        )
        numerics += ", super-block scales" if self.supers is not None else ""
        return f"{self.source} as {self.kind}{numerics}, shape {self.shape}, {self.nbytes()} bytes"


def _check_super_form(
    source: str,
    shape: tuple[int, int],
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    group: int,
    supers: torch.Tensor,
) -> None:
    """Raise where the super-block form's tensors do not fit ``shape`` (see the module doc)."""
    out_features, in_features = shape
    codes = torch.int8 if group == 16 else torch.uint8
    if (
        in_features % 256
        or group not in (16, BLOCK)
        or (mins is None) != (group == 16)
        or supers.shape != (out_features, in_features // 256, 2)
        or scales.dtype != codes
        or (mins is not None and mins.dtype != torch.uint8)
    ):
        raise ValueError(
            f"{source}: super-block scales are {codes} codes per {group} (with uint8 min codes per 32 where "
            f"group is 32) and fp32 factors [{out_features}, {in_features // 256}, 2]"
        )


class QuantizedBands(nn.Module):
    """``[out, in]`` weight made of consecutive row bands, each a ``QuantizedWeight`` of its own
    layout (see the module doc: a merged linear whose parts' formats differ). ``source`` names the
    formats (``Q4_K+Q6_K``); each band is a sub-module, so the model's buffers and
    ``quantized_bytes`` count each at its own format. A kernel multiplies band by band into the
    band's columns of one output; the plain-torch meaning is the bands' rows stacked."""

    shape: tuple[int, int]

    def __init__(self, parts: list[QuantizedWeight]) -> None:
        super().__init__()
        if len(parts) < 2 or len({p.shape[1] for p in parts}) != 1:
            raise ValueError("bands need two or more weights of the same input width")
        self.parts = nn.ModuleList(parts)
        self.offsets = tuple(sum(p.shape[0] for p in parts[:i]) for i in range(len(parts)))
        self.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        self.source = "+".join(sorted({p.source for p in parts}))

    def weights(self) -> list[QuantizedWeight]:
        """The bands' weights, in row order."""
        return [p for p in self.parts if isinstance(p, QuantizedWeight)]

    def bands(self) -> list[tuple[int, QuantizedWeight]]:
        """``(first output row, weight)`` of each band, in row order."""
        return list(zip(self.offsets, self.weights()))

    @property
    def int8_activations(self) -> bool:
        """Whether the bands' few-row products quantize the activations (set on all alike)."""
        return all(p.int8_activations for p in self.weights())

    @int8_activations.setter
    def int8_activations(self, value: bool) -> None:
        for part in self.weights():
            part.int8_activations = value

    @property
    def bf16_prefill(self) -> bool:
        """Whether the bands' long-prefill products run in bf16 (set on all alike)."""
        return all(p.bf16_prefill for p in self.weights())

    @bf16_prefill.setter
    def bf16_prefill(self, value: bool) -> None:
        for part in self.weights():
            part.bf16_prefill = value

    @property
    def dtype(self) -> torch.dtype:
        """The first band's packed dtype (never a float, as ``QuantizedWeight.dtype``)."""
        return self.weights()[0].dtype

    @property
    def device(self) -> torch.device:
        return self.weights()[0].device

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.weights())

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight (or its rows ``rows``) in ``dtype``: each band's values, stacked."""
        dense = torch.cat([p.dequantize(dtype=dtype) for p in self.weights()])
        return dense if rows is None else dense.index_select(0, rows)

    def extra_repr(self) -> str:
        return f"{self.source} in {len(self.parts)} bands, shape {self.shape}, {self.nbytes()} bytes"


KeptWeight = QuantizedWeight | QuantizedBands  # a weight a layer keeps quantized, in one layout or in bands
KEPT_WEIGHTS = (QuantizedWeight, QuantizedBands)  # (for isinstance)


def weight_blocks(layer: nn.Module) -> KeptWeight | None:
    """A layer's blocks kept beside its dense weight (``--quantization gguf_dual``: its
    ``weight_blocks`` sub-module, or for a tied LM head its embedding's), else None. Decode steps of
    few rows read them, larger products the dense values (the device's plan decides)."""
    blocks = layer._modules.get("weight_blocks")
    if blocks is None:
        tied = getattr(layer, "tied_to", None)
        blocks = tied._modules.get("weight_blocks") if isinstance(tied, nn.Module) else None
    return blocks if isinstance(blocks, KEPT_WEIGHTS) else None


def reference_linear(x: torch.Tensor, weight: KeptWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of ``x`` by the dequantized weight: what every quantized kernel approximates
    (they quantize ``x`` too) and what runs where no kernel does."""
    return F.linear(x, weight.dequantize(dtype=x.dtype), bias)


def embedding_rows(ids: torch.Tensor, weight: KeptWeight, dtype: torch.dtype) -> torch.Tensor:
    """``F.embedding(ids, dequantized weight)``: only the looked-up rows are dequantized."""
    flat = ids.reshape(-1)
    return weight.dequantize(flat, dtype).reshape(*ids.shape, weight.shape[1])


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """One weight of ``parts``' rows stacked (a merged qkv or gate/up projection); all alike in layout."""
    first = parts[0]
    if any(
        p.kind != first.kind
        or p.group != first.group
        or p.shape[1] != first.shape[1]
        or (p.mins is None) != (first.mins is None)
        or (p.supers is None) != (first.supers is None)
        for p in parts
    ):
        raise ValueError("cannot stack quantized weights of different layouts")
    mins = None if first.mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
    supers = None if first.supers is None else torch.cat([p.supers for p in parts if p.supers is not None])
    source = "+".join(sorted({p.source for p in parts}))
    return QuantizedWeight(
        first.kind,
        source,
        (sum(p.shape[0] for p in parts), first.shape[1]),
        torch.cat([p.qs for p in parts]),
        torch.cat([p.scales for p in parts]),
        mins,
        first.group,
        supers=supers,
    )


def zero_rows(like: QuantizedWeight, rows: int) -> QuantizedWeight:
    """``rows`` rows of zeros in ``like``'s layout (an embedding's padding rows under TP)."""
    mins = None if like.mins is None else like.mins.new_zeros(rows, like.mins.shape[1])
    supers = None if like.supers is None else like.supers.new_zeros(rows, *like.supers.shape[1:])
    return QuantizedWeight(
        like.kind,
        like.source,
        (rows, like.shape[1]),
        like.qs.new_zeros(rows, like.qs.shape[1]),
        like.scales.new_zeros(rows, like.scales.shape[1]),
        mins,
        like.group,
        supers=supers,
    )


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight | None:
    """Per-output-channel symmetric int8 (``--quantization int8``): ``scale = max |row| / 127``;
    None when the rows are not whole blocks of 32 (the kernels' unit: the weight stays dense)."""
    if weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    dense = weight.detach().float()
    scales = dense.abs().amax(dim=1, keepdim=True) / 127.0
    qs = torch.where(scales > 0, dense / torch.where(scales > 0, scales, 1.0), 0.0).round().clamp(-127, 127)
    out_features, in_features = dense.shape
    return QuantizedWeight(
        "q8", "int8", (out_features, in_features), qs.to(torch.int8), scales, group=in_features, int8_activations=True
    )
