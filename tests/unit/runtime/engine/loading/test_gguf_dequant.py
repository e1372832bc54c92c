"""GGUFWeight reads every GGML type we claim exactly as gguf-py's reference dequantization does.

For each type in ``SUPPORTED_TENSOR_TYPES`` a small file holds a llama Q and K weight (rows
interleaved per head, as llama.cpp's converter stores them), a plain 2-D weight and a norm.
``load()`` must equal ``gguf.dequantize`` of the same bytes, un-interleaved to the HF row
order for Q/K; every shard a TP rank reads (``narrow`` on rows or columns, aligned to heads
and quantization blocks or not) must equal the matching slice of ``load()``, and the
aligned shards must dequantize only their part of the tensor (the point of narrowing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from runtime.checkpoints.gguf.reader import SUPPORTED_TENSOR_TYPES, GGUFContents, read_gguf
from runtime.engine.loading import gguf_tensors
from runtime.engine.loading.gguf_tensors import GGUFWeight
from tests.support.gguf_files import llama_permute, llama_unpermute, reference_tensor, write_tensors_gguf

HEADS, KV_HEADS, HEAD_DIM, COLS = 4, 2, 32, 512  # COLS: two K-quant super-blocks per row
NAMES = {
    "q": "blk.0.attn_q.weight",
    "k": "blk.0.attn_k.weight",
    "down": "blk.0.ffn_down.weight",
    "norm": "blk.0.attn_norm.weight",
}
SOURCE_SEED = 7


def _source_values() -> dict[str, np.ndarray]:
    """HF-order fp32 values of the four tensors (the K-quants replace them by random blocks)."""
    rng = np.random.default_rng(SOURCE_SEED)
    return {
        "q": rng.standard_normal((HEADS * HEAD_DIM, COLS)).astype(np.float32),
        "k": rng.standard_normal((KV_HEADS * HEAD_DIM, COLS)).astype(np.float32),
        "down": rng.standard_normal((48, COLS)).astype(np.float32),
        "norm": rng.standard_normal(COLS).astype(np.float32),
    }


class TypeFile:
    """One GGUF file whose 2-D tensors are all of one type, and lazy weights over it."""

    def __init__(self, path: Path, type_name: str) -> None:
        self.path = path
        self.type_name = type_name
        self.contents: GGUFContents = read_gguf(path)
        self.data = np.memmap(path, dtype=np.uint8, mode="r")

    def weight(self, key: str) -> GGUFWeight:
        heads = {"q": HEADS, "k": KV_HEADS}.get(key)
        return GGUFWeight(self.data, self.contents.tensors[NAMES[key]], NAMES[key], qk_heads=heads)

    def reference(self, key: str) -> torch.Tensor:
        """gguf-py's dequantization of the stored tensor, in HF row order."""
        values = reference_tensor(self.path, NAMES[key])
        heads = {"q": HEADS, "k": KV_HEADS}.get(key)
        return torch.from_numpy(np.array(llama_unpermute(values, heads) if heads else values))


@pytest.fixture(scope="module", params=SUPPORTED_TENSOR_TYPES)
def type_file(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TypeFile]:
    type_name: str = request.param
    src = _source_values()
    tensors = {
        NAMES["q"]: (llama_permute(src["q"], HEADS), type_name),
        NAMES["k"]: (llama_permute(src["k"], KV_HEADS), type_name),
        NAMES["down"]: (src["down"], type_name),
        NAMES["norm"]: (src["norm"], "F32"),
    }
    path = write_tensors_gguf(tmp_path_factory.mktemp(f"gguf-{type_name}") / f"{type_name}.gguf", tensors)
    yield TypeFile(path, type_name)


def test_every_claimed_type_is_written_as_that_type(type_file: TypeFile) -> None:
    """The file really holds the type under test (not a silent F32 fallback of the writer)."""
    for key in ("q", "k", "down"):
        assert type_file.contents.tensors[NAMES[key]].type_name == type_file.type_name
    assert type_file.contents.tensors[NAMES["q"]].shape == (HEADS * HEAD_DIM, COLS)


@pytest.mark.parametrize("key", ["q", "k", "down", "norm"])
def test_load_equals_gguf_reference_dequantization(type_file: TypeFile, key: str) -> None:
    loaded = type_file.weight(key).load()
    reference = type_file.reference(key)
    assert loaded.dtype == torch.float32 and loaded.shape == reference.shape
    assert torch.isfinite(reference).all()
    assert reference.abs().max() > 0  # a real tensor, not all zeros
    assert torch.equal(loaded, reference)


@pytest.mark.parametrize("type_file", ["F32"], indirect=True)
def test_float32_round_trips_to_the_hf_order_source(type_file: TypeFile) -> None:
    """For F32 (lossless) the un-interleaved Q/K rows are exactly the HF tensor before conversion,
    which checks the un-permute against the converter's permute, not only against itself."""
    src = _source_values()
    for key in ("q", "k", "down", "norm"):
        assert torch.equal(type_file.weight(key).load(), torch.from_numpy(src[key])), key


@pytest.mark.parametrize("type_file", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"], indirect=True)
def test_quantized_types_stay_close_to_the_source(type_file: TypeFile) -> None:
    """Where gguf-py quantized real values (the K-quants hold random blocks), the un-interleaved
    rows land near the HF-order source: a row order mix-up would leave errors of the values' size."""
    src = _source_values()
    for key in ("q", "k", "down"):
        error = (type_file.weight(key).load() - torch.from_numpy(src[key])).abs().mean()
        assert error < 0.2, (key, float(error))  # 4-bit on unit normals: ~0.1; a row swap: ~1.1


# (key, dim, start, length): TP=2 halves aligned to heads (rows) or to blocks (columns), and
# shards that are not aligned, which take the un-interleave-everything / dequantize-all path.
SHARDS = [
    ("q", 0, 0, 64),
    ("q", 0, 64, 64),
    ("k", 0, 0, 32),
    ("k", 0, 32, 32),
    ("down", 0, 0, 24),
    ("down", 0, 24, 24),
    ("down", 1, 0, 256),
    ("down", 1, 256, 256),
    ("norm", 0, 256, 256),
    ("q", 0, 16, 40),
    ("k", 0, 5, 20),
    ("q", 1, 256, 256),
    ("down", 1, 40, 100),
    ("down", 1, 96, 64),
]


@pytest.mark.parametrize(("key", "dim", "start", "length"), SHARDS)
def test_narrow_equals_slice_of_load(type_file: TypeFile, key: str, dim: int, start: int, length: int) -> None:
    weight = type_file.weight(key)
    expected = weight.load().narrow(dim, start, length)
    shard = weight.narrow(dim, start, length)
    assert shard.shape == expected.shape
    assert torch.equal(shard, expected)


def test_aligned_shards_dequantize_only_their_part(type_file: TypeFile, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank's head-aligned row shard and block-aligned column shard dequantize only that shard;
    an unaligned one falls back to the whole tensor (correct, only slower)."""
    seen: list[tuple[int, int]] = []
    real = gguf_tensors._dequantize

    def spy(raw: np.ndarray, type_name: str) -> np.ndarray:
        seen.append(raw.shape)
        return real(raw, type_name)

    monkeypatch.setattr(gguf_tensors, "_dequantize", spy)
    q, down = type_file.weight("q"), type_file.weight("down")
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_file.type_name]]
    row_bytes = COLS // block * type_size
    seen.clear()
    q.narrow(0, 64, 64)
    assert seen == [(64, row_bytes)]
    seen.clear()
    down.narrow(1, 256, 256)
    assert seen == [(48, row_bytes // 2)]
    seen.clear()
    down.narrow(1, 40, 100)
    q.narrow(0, 16, 40)
    # 40..140 is block-aligned only for the 1-element blocks of F32 / F16 / BF16
    down_bytes = 100 * type_size if block == 1 else row_bytes
    assert seen == [(48, down_bytes), (HEADS * HEAD_DIM, row_bytes)]


def test_bad_narrow_dims_are_refused(type_file: TypeFile) -> None:
    with pytest.raises(IndexError, match="no dim 1"):
        type_file.weight("norm").narrow(1, 0, 8)
    with pytest.raises(IndexError, match="no dim 2"):
        type_file.weight("down").narrow(2, 0, 8)
