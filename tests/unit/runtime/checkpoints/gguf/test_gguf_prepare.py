"""prepare_gguf: a GGUF file becomes a cached checkpoint folder once, and the right one.

Parsing a real GGUF header takes seconds (its token tables), so a second start must reuse the
folder without reading the file; a file replaced or touched since must not be served from a
stale folder. The tokenizer transformers converts from the file must tokenize like the
source checkpoint's tokenizer and carry its chat template, since the server tokenizes with it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime.checkpoints.gguf import prepare as prepare_module
from runtime.checkpoints.gguf.prepare import GGUFIndex, is_gguf_folder, prepare_gguf
from runtime.checkpoints.gguf.reader import GGUFError
from runtime.checkpoints.model_source import checkpoint_folder, has_tokenizer
from runtime.engine.loading.gguf_tensors import iterate_gguf_weights
from runtime.engine.model_config import ModelConfig
from tests.support.checkpoints import TinyCheckpoints
from tests.support.gguf_files import write_checkpoint_gguf

TEXTS = (
    "Hello world, the quick brown fox jumps over 12345 lazy dogs!",
    "  leading spaces\tand tabs\nnew lines; punctuation?! (brackets) 3.14159",
    "<|user|>\nspecial tokens stay whole</s>",
    "e\u0301te\u0301 caf\u00e9, x(brackets) abc123def I'm here's",  # decomposed accents: NFC or not
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private cache (never the user's), so each test sees only the folders it made."""
    root = tmp_path / "cache"
    monkeypatch.setenv("TINYSERVE_CACHE", str(root))
    return root


def _prepared_folders(cache: Path) -> list[Path]:
    return sorted(p.parent for p in (cache / "gguf").glob("*/config.json"))


def test_second_prepare_reuses_the_folder_without_parsing(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "llama.gguf", tokenizer=False)
    first = prepare_gguf(path)
    assert is_gguf_folder(first) and first.parent == cache / "gguf"

    def no_parse(p: Any) -> None:
        raise AssertionError(f"{p} was parsed again")

    monkeypatch.setattr(prepare_module, "read_gguf", no_parse)
    assert prepare_gguf(path) == first
    assert checkpoint_folder(str(path)) == first  # what launch.py and ModelRunner call
    assert checkpoint_folder(str(tmp_path)) == first  # the folder holding the one .gguf file
    assert _prepared_folders(cache) == [first]


def test_changed_file_gets_a_new_folder(tiny_checkpoints: TinyCheckpoints, tmp_path: Path, cache: Path) -> None:
    path = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "llama.gguf", tokenizer=False)
    first = prepare_gguf(path)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # touched
    touched = prepare_gguf(path)
    assert touched != first
    write_checkpoint_gguf(tiny_checkpoints.path("llama"), path, weight_type="F16", tokenizer=False)  # replaced
    replaced = prepare_gguf(path)
    assert replaced not in (first, touched)
    assert _prepared_folders(cache) == sorted([first, touched, replaced])
    index = GGUFIndex.read(replaced)
    assert (index.file, index.size, index.mtime_ns) == (path.resolve(), path.stat().st_size, path.stat().st_mtime_ns)
    assert {t.type_name for t in index.tensors if len(t.shape) == 2} == {"F16"}


def test_weights_refuse_a_file_changed_after_prepare(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """A scheduler reading a prepared folder whose file changed since must not map the new
    bytes with the old tensor offsets."""
    path = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "llama.gguf", tokenizer=False)
    folder = prepare_gguf(path)
    with open(path, "ab") as f:
        f.write(b"\0" * 64)
    config = ModelConfig.from_pretrained(folder)
    with pytest.raises(GGUFError, match="changed after it was prepared"):
        next(iterate_gguf_weights(folder, ["model.embed_tokens.weight"], config, progress=False))
    path.unlink()
    with pytest.raises(GGUFError, match="no longer exists"):
        next(iterate_gguf_weights(folder, ["model.embed_tokens.weight"], config, progress=False))


def test_index_records_the_unpermute_rule(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """Only llama-architecture files (Mistral included) have their Q/K rows interleaved."""
    for name, unpermute in (("llama", True), ("mistral", True), ("qwen2", False), ("qwen3", False)):
        path = write_checkpoint_gguf(tiny_checkpoints.path(name), tmp_path / f"{name}.gguf", tokenizer=False)
        index = GGUFIndex.read(prepare_gguf(path))
        assert index.unpermute_qk is unpermute, name


@pytest.mark.parametrize("name", ["llama", "qwen2"])  # BOS added or not; GPT-2 or Qwen2 split regex
def test_tokenizer_from_gguf_tokenizes_like_the_source(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path, name: str
) -> None:
    from transformers import AutoTokenizer

    src = tiny_checkpoints.path(name)
    folder = prepare_gguf(write_checkpoint_gguf(src, tmp_path / f"{name}.gguf"))
    assert has_tokenizer(folder)
    ours, source = AutoTokenizer.from_pretrained(str(folder)), AutoTokenizer.from_pretrained(str(src))
    # The file's tokens and no more. transformers adds GPT2Tokenizer's / Qwen2Tokenizer's default
    # "<|endoftext|>" to a vocabulary without one (the source Qwen2 tokenizer has it, id 384, past
    # the model's embedding); prepare drops it, so no text can tokenize outside the vocabulary.
    vocab = ModelConfig.from_pretrained(src).vocab_size
    assert ours.get_vocab() == {t: i for t, i in source.get_vocab().items() if i < vocab}
    assert max(ours("<|endoftext|>").input_ids) < vocab
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == source(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=True) == source.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == source.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        source.bos_token_id,
        source.eos_token_id,
        source.pad_token_id,
    )
    assert ours.chat_template == source.chat_template
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == source.apply_chat_template(MESSAGES, tokenize=False)
    assert ours.apply_chat_template(MESSAGES) == source.apply_chat_template(MESSAGES)


def test_weights_only_file_prepares_without_a_tokenizer(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    folder = prepare_gguf(write_checkpoint_gguf(tiny_checkpoints.path("qwen3"), tmp_path / "w.gguf", tokenizer=False))
    assert (folder / "config.json").is_file() and not has_tokenizer(folder)


def test_prepared_weights_are_the_files_tensors(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """Every tensor the model reads is found under its HF name, with the source values (F32)."""
    from safetensors.numpy import load_file

    src = tiny_checkpoints.path("qwen2")
    folder = prepare_gguf(write_checkpoint_gguf(src, tmp_path / "q.gguf", tokenizer=False))
    source = load_file(str(src / "model.safetensors"))
    got = dict(iterate_gguf_weights(folder, list(source), ModelConfig.from_pretrained(folder), progress=False))
    assert sorted(got) == sorted(source)
    for name, weight in got.items():
        assert np.array_equal(weight.load().numpy(), source[name]), name


def test_launch_resolves_a_gguf_model_path(tiny_checkpoints: TinyCheckpoints, tmp_path: Path) -> None:
    """launch.py prepares the file once, before any child starts; children get the folder, the
    API keeps the name the user gave; a weights-only file needs --tokenizer-path."""
    from launch import resolve_paths
    from runtime.checkpoints.model_source import ModelSourceError
    from runtime.config.args import ServerArgs

    path = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "llama.gguf")
    resolved = resolve_paths(ServerArgs(model_path=str(path)))
    assert resolved.model_path == str(prepare_gguf(path))
    assert resolved.tokenizer_path is None and resolved.served_model_name == str(path)

    (tmp_path / "bare").mkdir()
    bare = write_checkpoint_gguf(tiny_checkpoints.path("llama"), tmp_path / "bare" / "w.gguf", tokenizer=False)
    with pytest.raises(ModelSourceError, match="has no tokenizer; give --tokenizer-path"):
        resolve_paths(ServerArgs(model_path=str(bare)))
    paired = resolve_paths(ServerArgs(model_path=str(bare), tokenizer_path=str(path)))
    assert paired.tokenizer_path == str(prepare_gguf(path)) and paired.model_path == str(prepare_gguf(bare))
