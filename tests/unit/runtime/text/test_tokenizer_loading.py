"""``load_tokenizer``: AutoTokenizer's decision of a folder's class is recorded once, and a load from
the record is the same tokenizer (class, vocabulary, special tokens, encodings, decodings, chat
rendering) without importing torch, for every family's tokenizer the suite serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from runtime.checkpoints.model_source import minilm_folder
from runtime.text import tokenizer as tokenizer_module
from tests.support import REPO_ROOT
from tests.support.checkpoints import CHECKPOINT_NAMES, ENCODER_CHECKPOINT_NAMES, TinyCheckpoints

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\nnew lines", "naïve café — 東京 🙂", "x=1; y = [2, 3]"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture
def record_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    return tmp_path / "tokenizer_classes"


def _behaviour(tok: Any) -> dict[str, Any]:
    """Everything the server's three processes use a tokenizer for."""
    ids = [tok(text).input_ids for text in TEXTS]
    seen: dict[str, Any] = {
        "class": type(tok),
        "vocab": tok.get_vocab(),
        "special": tok.all_special_tokens,
        "bos_eos_pad": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id),
        "ids": ids,
        "decoded": [tok.decode(i) for i in ids] + [tok.decode(i, skip_special_tokens=True) for i in ids],
        "pieces": [tok.convert_ids_to_tokens(i) for i in ids],
    }
    if tok.chat_template is not None:
        seen["chat"] = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return seen


def _assert_recorded_load_is_autotokenizers(folder: Path, record_cache: Path) -> None:
    from transformers import AutoTokenizer

    reference = _behaviour(AutoTokenizer.from_pretrained(str(folder)))
    first = tokenizer_module.load_tokenizer(str(folder))  # decides (AutoTokenizer) and records
    (record,) = list(record_cache.glob("*.json"))
    assert json.loads(record.read_text())["name"] == type(first).__qualname__
    recorded = tokenizer_module.load_tokenizer(str(folder))
    assert _behaviour(first) == reference
    assert _behaviour(recorded) == reference


@pytest.mark.parametrize("name", CHECKPOINT_NAMES + ENCODER_CHECKPOINT_NAMES)
def test_a_recorded_class_loads_the_same_tokenizer(
    name: str, tiny_checkpoints: TinyCheckpoints, record_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = tokenizer_module._recorded_class
    monkeypatch.setattr(tokenizer_module, "_recorded_class", lambda r: calls.append(r.name) or real(r))
    _assert_recorded_load_is_autotokenizers(tiny_checkpoints.path(name), record_cache)
    assert len(calls) == 2  # both loads looked for a record; the second found it (asserted above by class)


def test_the_real_models_tokenizers_load_the_same_from_the_record(record_cache: Path) -> None:
    """SmolLM2's prepared folder (a GGUF file's tokenizer, converted) and MiniLM's (a WordPiece one)."""
    from runtime.checkpoints.model_source import checkpoint_folder

    for folder in (checkpoint_folder(None, need_weights=False), minilm_folder()):
        _assert_recorded_load_is_autotokenizers(folder, record_cache)
        for record in record_cache.glob("*.json"):
            record.unlink()


def test_a_changed_folder_is_decided_afresh(
    tiny_checkpoints: TinyCheckpoints, tmp_path: Path, record_cache: Path
) -> None:
    """A record names the folder and its files' sizes and times: editing tokenizer_config.json (here to
    another class) is a new decision, never the stale class."""
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoints.path("llama"), folder)
    before = type(tokenizer_module.load_tokenizer(str(folder)))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    other = "PreTrainedTokenizerFast" if before.__name__ != "PreTrainedTokenizerFast" else "LlamaTokenizer"
    config["tokenizer_class"] = other
    config_path.write_text(json.dumps(config))
    from transformers import AutoTokenizer

    assert type(tokenizer_module.load_tokenizer(str(folder))) is type(AutoTokenizer.from_pretrained(str(folder)))
    assert len(list(record_cache.glob("*.json"))) == 2


def test_a_record_that_names_no_transformers_class_is_ignored(
    tiny_checkpoints: TinyCheckpoints, record_cache: Path
) -> None:
    folder = str(tiny_checkpoints.path("llama"))
    expected = type(tokenizer_module.load_tokenizer(folder))
    (record,) = list(record_cache.glob("*.json"))
    for entry in ({"module": "os", "name": "system"}, {"module": "transformers", "name": "NoSuchTokenizer"}, "junk"):
        record.write_text(json.dumps(entry))
        assert type(tokenizer_module.load_tokenizer(folder)) is expected


def test_a_load_from_the_record_does_not_import_torch(tiny_checkpoints: TinyCheckpoints, record_cache: Path) -> None:
    """The point of the record: the tokenizer and detokenizer processes start without torch."""
    folder = str(tiny_checkpoints.path("qwen3"))
    tokenizer_module.load_tokenizer(folder)  # records
    code = (
        "import sys; from runtime.text.tokenizer import load_tokenizer; "
        f"tok = load_tokenizer({folder!r}); print(type(tok).__name__, 'torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env={**os.environ, "TINYSERVE_CACHE": str(record_cache.parent)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == [type(tokenizer_module.load_tokenizer(folder)).__name__, "False"]
