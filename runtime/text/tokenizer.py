"""The one way every process loads the server's tokenizer.

The tokenizer process (prompts, chat rendering), the detokenizer (text deltas) and the
scheduler (stop strings) must agree token for token, so they all load it here, from the
same path (``ServerArgs.resolved_tokenizer_path()``). This module imports nothing from
the process packages, so each of them can import it without a cycle.

Which class a folder's tokenizer is, is transformers' ``AutoTokenizer`` decision; making it
imports torch and the model-config machinery (~3 s of CPU in each of the tokenizer and
detokenizer processes, which otherwise never touch torch). So the decision is made once per
folder and recorded in the cache (``tokenizer_classes/``, keyed by the folder and its small
files' sizes and times); a later load of the same folder calls the recorded class's
``from_pretrained`` itself, which is the call ``AutoTokenizer`` ends in for a local folder.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from runtime.checkpoints.model_cache import cache_root

logger = logging.getLogger(__name__)

# the files AutoTokenizer's decision may read (configs, vocabularies, templates): not the weights
_DECISION_SUFFIXES = frozenset({".json", ".jinja", ".model", ".txt", ".tiktoken", ".vocab"})


def load_tokenizer(path: str, chat_template: str | None = None) -> Any:
    """The HF tokenizer at ``path``; ``chat_template`` (a Jinja file, ``--chat-template``)
    replaces its own template (only the tokenizer process renders chats)."""
    record = _record_path(path)
    tokenizer_class = _recorded_class(record) if record is not None else None
    if tokenizer_class is not None:
        tokenizer = tokenizer_class.from_pretrained(path)
    else:
        from transformers import AutoTokenizer  # lazy: a slow import the clients never need

        tokenizer = AutoTokenizer.from_pretrained(path)
        if record is not None:
            _record_class(record, type(tokenizer))
    if chat_template is not None:
        with open(chat_template, encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    return tokenizer


def _record_path(path: str) -> Path | None:
    """Where the class decided for the folder ``path`` is recorded (None: not a local folder)."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    files = sorted(
        (entry.name, stat.st_size, stat.st_mtime_ns)
        for entry in folder.iterdir()
        if entry.suffix in _DECISION_SUFFIXES and entry.is_file() and (stat := entry.stat())
    )
    key = hashlib.sha256(json.dumps([str(folder.resolve()), files]).encode()).hexdigest()[:32]
    return cache_root() / "tokenizer_classes" / f"{key}.json"


def _recorded_class(record: Path) -> Any:
    """The recorded tokenizer class, or None (no record, or one that no longer names a transformers class)."""
    try:
        entry = json.loads(record.read_text())
        module, name = entry["module"], entry["name"]
        if not module.startswith("transformers."):
            return None
        found = getattr(importlib.import_module(module), name)
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return None
    return found if isinstance(found, type) else None


def _record_class(record: Path, tokenizer_class: type) -> None:
    """Record AutoTokenizer's decision (atomically: the tokenizer and detokenizer processes may
    both make it on a folder's first start). A cache that cannot be written records nothing."""
    if not tokenizer_class.__module__.startswith("transformers."):
        return  # (remote code: decided afresh each time)
    entry = {"module": tokenizer_class.__module__, "name": tokenizer_class.__qualname__}
    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=record.parent, suffix=".tmp", delete=False) as f:
            json.dump(entry, f)
        os.replace(f.name, record)
    except OSError as exc:
        logger.debug("could not record the tokenizer class in %s: %s", record.parent, exc)
