"""The embedded default model: deterministic build, atomic cache install, loads and runs."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from runtime.checkpoints import model_cache, tiny_model
from runtime.engine.model_runner import ModelRunner
from tests.support.harness import Harness


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def built_twice(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    a = tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny_a"))
    b = tiny_model.build_tiny_model(tmp_path_factory.mktemp("tiny_b"))
    return a, b


def test_build_is_byte_identical(built_twice: tuple[Path, Path]) -> None:
    a, b = built_twice
    fa, fb = _files(a), _files(b)
    assert set(fa) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    assert fa.keys() == fb.keys()
    for name in fa:
        assert fa[name] == fb[name], name


def test_tokenizer_loads_with_autotokenizer(built_twice: tuple[Path, Path]) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built_twice[0])
    assert 2000 <= len(tok) <= 4096
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    ids = tok("Hello world, the model reads 12 tokens!")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world, the model reads 12 tokens!"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<s><|user|>\nHi</s>\n<|assistant|>\n"


def test_default_model_path_builds_once_into_cache_and_runs(
    built_twice: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    paths: list[Path] = []
    threads = [threading.Thread(target=lambda: paths.append(tiny_model.default_model_path())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert paths[0] == paths[1] == tmp_path / "cache" / tiny_model.TINY_MODEL_NAME
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [tiny_model.TINY_MODEL_NAME]  # no temp leftovers
    assert _files(paths[0]) == _files(built_twice[0])
    assert tiny_model.default_model_path() == paths[0]

    runner = ModelRunner(paths[0], device="cpu", dtype="float32", max_total_tokens=1024, load_progress=False)
    assert runner.model_config.architecture == "LlamaForCausalLM"
    assert (runner.model_config.num_hidden_layers, runner.model_config.hidden_size) == (4, 256)
    (req,) = Harness(runner).generate([[1, 45, 74, 523, 335]], 5)
    assert len(req.output_ids) == 5 and all(0 <= t < runner.vocab_size for t in req.output_ids)


def test_cache_root_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TINYSERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_cache.cache_root() == tmp_path / "tinyserve"
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "x"))
    assert model_cache.cache_root() == tmp_path / "x"
