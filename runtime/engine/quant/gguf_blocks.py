"""GGUF quantized blocks repacked into the kernels' two layouts (``runtime.engine.quant.weight``), losslessly.

Q8_0, Q4_0 and Q4_1 keep their values as they are (only the fp16 scales become fp32, and Q4_0's
implicit offset of 8 becomes an explicit min); Q5_0's 5-bit values, less their offset of 16, become
int8 (one ``d`` per 32: 1.125 bytes a value, from 0.6875), and Q5_1's int8 with a ``d`` and an ``m`` per
32 (1.25 bytes a value, from 0.75). The K-quants are repacked into an equivalent the
kernels read with the same loop as the simple formats, their scales in the super-block form (the
file's 6- or 8-bit codes as bytes, its ``d`` and ``dmin`` in fp32 per 256 values: ``weight.py``'s
module doc): Q4_K's 256-value super-block becomes eight q4 blocks of 32 whose scale and min are
``d * sc`` and ``-(dmin * m)`` (0.59 bytes a value, from 0.5625), Q5_K's eight int8 blocks of 32 with
the same scale and min (1.09 bytes a value, from 0.6875), Q6_K's int8 values with a scale ``d * sc``
per 16 (1.09 bytes a value, from 0.82). The repacked weight's ``dequantize`` equals the ``gguf``
package's, value for value (fp32 products of the same factors), which the tests check on random blocks.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.engine.quant.weight import BLOCK, QuantizedWeight

# GGUF types kept quantized by --quantization gguf (the others are dequantized at load)
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    """fp32 of little-endian fp16 bytes ``[..., 2]``."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _tensor(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values))


def from_gguf(raw: np.ndarray, type_name: str, in_features: int, source: str | None = None) -> QuantizedWeight:
    """The ``[rows, in_features]`` weight of GGUF rows ``raw`` (uint8 ``[rows, bytes a row]``, whole
    blocks) of type ``type_name`` (one of ``KEPT_TYPES``), in our layout."""
    rows = raw.shape[0]
    shape = (rows, in_features)
    name = source or type_name
    if type_name == "Q8_0":
        blocks = raw.reshape(rows, -1, 34)
        qs = blocks[..., 2:].reshape(rows, in_features).view(np.int8)
        return QuantizedWeight("q8", name, shape, _tensor(qs), _tensor(_f16(blocks[..., :2])))
    if type_name in ("Q4_0", "Q4_1"):
        head = 2 if type_name == "Q4_0" else 4
        blocks = raw.reshape(rows, -1, head + BLOCK // 2)
        scales = _f16(blocks[..., :2])
        mins = -8.0 * scales if type_name == "Q4_0" else _f16(blocks[..., 2:4])
        qs = blocks[..., head:].reshape(rows, in_features // 2)
        return QuantizedWeight("q4", name, shape, _tensor(qs), _tensor(scales), _tensor(mins))
    if type_name in ("Q5_0", "Q5_1"):
        return _from_q5(raw, rows, in_features, name, with_min=type_name == "Q5_1")
    if type_name == "Q5_K":
        return _from_q5_k(raw, rows, in_features, name)
    if type_name == "Q4_K":
        return _from_q4_k(raw, rows, in_features, name)
    if type_name == "Q6_K":
        return _from_q6_k(raw, rows, in_features, name)
    raise ValueError(f"GGUF type {type_name} is not kept quantized (kept: {', '.join(KEPT_TYPES)})")


def _five_bits(low_nibbles: np.ndarray, high_bits: np.ndarray) -> np.ndarray:
    """5-bit values of blocks of 32: ``low_nibbles`` [.., 16] bytes (value j low, value j + 16 high),
    ``high_bits`` [.., 32] the fifth bit of each value."""
    low = np.concatenate([low_nibbles & 0xF, low_nibbles >> 4], axis=-1)
    return low | (high_bits.astype(np.uint8) << 4)


def _from_q5(raw: np.ndarray, rows: int, in_features: int, name: str, with_min: bool) -> QuantizedWeight:
    """Q5_0 (d, 4 bytes of fifth bits, 16 of nibbles: w = d * (q - 16)) or Q5_1 (d, m, then the same:
    w = d * q + m), as int8 values with a scale (and Q5_1's min) per 32."""
    head = 4 if with_min else 2
    blocks = raw.reshape(-1, head + 4 + BLOCK // 2)
    d = _f16(blocks[:, 0:2])
    fifth = (blocks[:, head : head + 4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1
    values = _five_bits(blocks[:, head + 4 :], fifth).astype(np.int8)
    per_row = in_features // BLOCK
    mins = _tensor(_f16(blocks[:, 2:4]).reshape(rows, per_row)) if with_min else None
    return QuantizedWeight(
        "q8",
        name,
        (rows, in_features),
        _tensor((values if with_min else values - np.int8(16)).reshape(rows, in_features)),
        _tensor(d.reshape(rows, per_row)),
        mins,
    )


def _super_form(
    blocks: np.ndarray, rows: int, in_features: int, group: int, with_mins: bool
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A K-quant's scales in the super-block form: the codes per ``group`` (and the min codes per 32),
    and the fp32 ``d`` and ``dmin`` per super-block (``blocks`` [super-blocks, bytes]; Q4_K/Q5_K: d,
    dmin, 12 bytes of 6-bit scales and mins; Q6_K: d last, its int8 scales before it)."""
    per_row = in_features // group
    if with_mins:
        from gguf.quants import Q4_K

        sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        codes, min_codes = sc.astype(np.uint8), _tensor(m.astype(np.uint8).reshape(rows, per_row))
    else:
        codes, min_codes = blocks[:, 192:208].view(np.int8), None
        d = _f16(blocks[:, 208:210])
        dmin = np.zeros_like(d)
    supers = np.stack([d, dmin], axis=-1).reshape(rows, in_features // 256, 2)
    return _tensor(codes.reshape(rows, per_row)), min_codes, _tensor(supers)


def _from_q5_k(raw: np.ndarray, rows: int, in_features: int, name: str) -> QuantizedWeight:
    # d, dmin (fp16), 12 bytes of 6-bit scales and mins (Q4_K's packing), 32 bytes of fifth bits, 128 of nibbles
    blocks = raw.reshape(-1, 176)
    # sub-blocks 2j and 2j + 1 share 32 bytes of nibbles (low, high); sub-block s's fifth bits are bit s
    nibbles = blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    low = (nibbles & 0xF).reshape(-1, 8, 32)
    high = (blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    values = (low | (high << 4)).astype(np.int8)
    scales, mins, supers = _super_form(blocks, rows, in_features, BLOCK, with_mins=True)
    return QuantizedWeight(
        "q8", name, (rows, in_features), _tensor(values.reshape(rows, in_features)), scales, mins, supers=supers
    )


def _from_q4_k(raw: np.ndarray, rows: int, in_features: int, name: str) -> QuantizedWeight:
    blocks = raw.reshape(-1, 144)  # d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 bytes of values
    # 32 bytes hold sub-blocks 2j (low nibbles) and 2j + 1 (high nibbles): unpack, then pack ours
    packed = blocks[:, 16:].reshape(-1, 4, 1, 32)
    values = ((packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0xF).reshape(-1, BLOCK)
    ours = values[:, : BLOCK // 2] | (values[:, BLOCK // 2 :] << 4)
    scales, mins, supers = _super_form(blocks, rows, in_features, BLOCK, with_mins=True)
    return QuantizedWeight(
        "q4", name, (rows, in_features), _tensor(ours.reshape(rows, in_features // 2)), scales, mins, supers=supers
    )


def _from_q6_k(raw: np.ndarray, rows: int, in_features: int, name: str) -> QuantizedWeight:
    from gguf.quants import Q6_K

    blocks = raw.reshape(-1, 210)  # 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales, fp16 d
    d = _f16(blocks[:, 208:210])
    scales = d[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)  # [super-blocks, 16]
    dense = Q6_K.dequantize_blocks(blocks).reshape(-1, 16, 16)  # the package's d * sc * q (-32 <= q < 32)
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    values = np.where(scales[..., None] == 0, 0, np.rint(dense / safe)).astype(np.int8)
    codes, _, supers = _super_form(blocks, rows, in_features, 16, with_mins=False)
    shape = (rows, in_features)
    return QuantizedWeight("q8", name, shape, _tensor(values.reshape(shape)), codes, group=16, supers=supers)
