"""A GGUF file tinyserve cannot serve is refused up front, with a message naming the file and the fault.

Each broken file (cut short, a tensor type we cannot dequantize or one no GGML knows, an
architecture we do not serve, a tensor whose shape disagrees with the metadata or that is
missing) must raise GGUFError from ``prepare_gguf`` (what ``launch.py`` calls before any
child starts), and leave nothing in the cache: a later start must not find a half-built
folder and serve it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from runtime.checkpoints.gguf.prepare import prepare_gguf
from runtime.checkpoints.gguf.reader import GGUFError, read_gguf
from runtime.checkpoints.model_source import ModelSourceError, checkpoint_folder
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import set_tensor_type_number, truncate, write_checkpoint_gguf, write_tensors_gguf


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache, so the test can check it stays empty (and never touches the user's)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TINYSERVE_CACHE", str(root))
    return root


def _assert_refused(path: Path, cache: Path, *fragments: str) -> None:
    """prepare_gguf raises GGUFError naming the file and each fragment; the cache holds nothing."""
    with pytest.raises(GGUFError) as info:
        prepare_gguf(path)
    message = str(info.value)
    assert str(path.resolve()) in message or path.name in message, message
    for fragment in fragments:
        assert fragment in message, message
    leftovers = sorted(p.relative_to(cache) for p in cache.rglob("*") if p.is_file() or p.name != "gguf")
    assert leftovers == [], leftovers


@pytest.fixture
def llama_file(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> Path:
    """A valid tiny llama GGUF (weights only: the tokenizer conversion is not under test here)."""
    return write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "tiny-llama.gguf", tokenizer=False)


def test_valid_file_prepares(llama_file: Path, cache: Path) -> None:
    """The baseline the broken variants below depart from."""
    folder = prepare_gguf(llama_file)
    assert (folder / "config.json").is_file() and folder.parent.parent == cache


def test_truncated_tensor_data(llama_file: Path, cache: Path) -> None:
    truncate(llama_file, drop=1000)
    _assert_refused(llama_file, cache, "probably truncated", f"it has {llama_file.stat().st_size} bytes")


def test_truncated_header(llama_file: Path, cache: Path) -> None:
    truncate(llama_file, keep=200)
    _assert_refused(llama_file, cache, "probably truncated", "it has 200 bytes")


@pytest.mark.parametrize("data", [b"PK\x03\x04" + bytes(400), b""], ids=["zip", "empty"])
def test_not_a_gguf_file(tmp_path: Path, cache: Path, data: bytes) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    _assert_refused(path, cache, "is not a GGUF file", "magic number")


@pytest.mark.parametrize("type_name", ["IQ2_XXS", "TQ1_0", "IQ4_NL"])
def test_tensor_type_we_do_not_dequantize(tmp_path: Path, cache: Path, type_name: str) -> None:
    path = write_tensors_gguf(
        tmp_path / "iq.gguf",
        {
            "token_embd.weight": (np.zeros((8, 256), np.float32), "F32"),
            "blk.0.attn_q.weight": (np.ones((4, 256), np.float32), type_name),
        },
    )
    _assert_refused(path, cache, "blk.0.attn_q.weight", type_name, "cannot dequantize")


def test_tensor_type_number_outside_the_enum(llama_file: Path, cache: Path) -> None:
    """A type number no GGML release defines (a newer or corrupt file)."""
    set_tensor_type_number(llama_file, "blk.0.ffn_up.weight", 250)
    _assert_refused(llama_file, cache, "250", "is not a valid GGMLQuantizationType", "newer llama.cpp")


@pytest.mark.parametrize("architecture", ["gpt2", "phi2"])
def test_unsupported_architecture(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path, architecture: str
) -> None:
    path = write_checkpoint_gguf(
        tiny_checkpoints.path("llama"), tmp_path / "other.gguf", architecture=architecture, tokenizer=False
    )
    _assert_refused(path, cache, f"unsupported architecture {architecture!r}", "general.architecture")


def test_tensor_shape_disagrees_with_metadata(tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path) -> None:
    def halve_k(name: str, values: np.ndarray) -> np.ndarray:
        return values[: values.shape[0] // 2] if name == "blk.1.attn_k.weight" else values

    path = write_checkpoint_gguf(
        tiny_checkpoints.path("llama"), tmp_path / "shape.gguf", tensor_hook=halve_k, tokenizer=False
    )
    _assert_refused(path, cache, "blk.1.attn_k.weight has shape (16, 64)", "implies (32, 64)")


def test_missing_tensor(tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path) -> None:
    def drop_gate(name: str, values: np.ndarray) -> np.ndarray | None:
        return None if name == "blk.0.ffn_gate.weight" else values

    path = write_checkpoint_gguf(
        tiny_checkpoints.path("qwen2"), tmp_path / "gap.gguf", tensor_hook=drop_gate, tokenizer=False
    )
    _assert_refused(path, cache, "tensor blk.0.ffn_gate.weight is missing")


def test_missing_metadata_key(tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path) -> None:
    """A file for an architecture we serve but without its hyper-parameters (written under
    another prefix) names the missing key."""
    src = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "src.gguf", tokenizer=False)
    contents = read_gguf(src)
    assert contents.arch_value("block_count") == 2  # the key the damaged copy below lacks
    data = src.read_bytes().replace(b"llama.block_count", b"llama.block_kount")
    path = tmp_path / "nokey.gguf"
    path.write_bytes(data)
    _assert_refused(path, cache, "metadata key llama.block_count is missing")


def test_folder_with_two_gguf_files(llama_file: Path, tmp_path: Path, cache: Path) -> None:
    second = tmp_path / "tiny-llama-q8.gguf"
    second.write_bytes(llama_file.read_bytes())
    with pytest.raises(GGUFError) as info:
        checkpoint_folder(str(tmp_path))
    message = str(info.value)
    assert str(tmp_path) in message and "2 GGUF files" in message
    assert llama_file.name in message and second.name in message
    assert not cache.exists() or not any(cache.rglob("config.json"))


def test_missing_gguf_file(tmp_path: Path, cache: Path) -> None:
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(GGUFError, match=f"GGUF file {missing} does not exist"):
        prepare_gguf(missing)
    with pytest.raises((GGUFError, ModelSourceError)) as info:
        checkpoint_folder(str(missing))
    assert str(missing) in str(info.value) and "does not exist" in str(info.value)
    assert not cache.exists() or not any(cache.rglob("*"))


def test_tokenizer_that_cannot_be_converted(tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path) -> None:
    """A failure late in the build (after the config checks passed) leaves no folder either."""
    ok = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "ok.gguf")
    path = tmp_path / "bert-tok.gguf"
    # tokenizer.ggml.model "gpt2" -> "bert" (same length): a tokenizer transformers has no GGUF builder for
    length = (4).to_bytes(8, "little")  # a GGUF string: u64 length, then the bytes
    path.write_bytes(ok.read_bytes().replace(length + b"gpt2", length + b"bert"))
    assert path.read_bytes() != ok.read_bytes()
    _assert_refused(path, cache, "its tokenizer cannot be converted", "'bert'")
