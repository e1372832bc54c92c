"""A GGUF file made into a checkpoint folder that every process reads like any other.

``prepare_gguf`` runs once, before the server's children start (``launch.py``), and puts
into the tinyserve cache a folder keyed by the file (path, size, modification time):
``config.json`` from the metadata, the tokenizer and chat template that transformers
converts from the file, ``generation_config.json`` when the model recommends sampling defaults
(the file's ``general.sampling.*`` metadata, else the caller's ``fallback_sampling`` for a model
tinyserve ships: ``runtime.checkpoints.sampling_defaults``) and ``gguf.json`` (the file's path and
its tensor index). Parsing a GGUF header walks every entry of its token tables, seconds for a 49k
vocabulary, so it is done here once instead of in the tokenizer, the detokenizer and every
scheduler rank, and not at all on later starts. The tensors stay in the GGUF file: nothing is copied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from runtime.checkpoints.gguf.config import hf_config, needs_qk_unpermute
from runtime.checkpoints.gguf.reader import GGUFContents, GGUFError, TensorEntry, read_gguf, shared_parse
from runtime.checkpoints.model_cache import build_once, cache_root
from runtime.checkpoints.sampling_defaults import GENERATION_CONFIG, gguf_sampling

logger = logging.getLogger(__name__)

GGUF_INDEX = "gguf.json"
# Bump when what prepare writes changes: the folder name includes it (4: generation_config.json).
PREPARE_VERSION = 4


@dataclass(frozen=True)
class GGUFIndex:
    """What ``gguf.json`` records: the file, how to tell it changed, and its tensors (the
    hyper-parameters are in ``config.json``)."""

    file: Path
    size: int
    mtime_ns: int
    architecture: str  # general.architecture: gguf's tensor name table, the Q/K interleave
    tensors: tuple[TensorEntry, ...]

    @property
    def unpermute_qk(self) -> bool:
        return needs_qk_unpermute(self.architecture)

    @classmethod
    def read(cls, folder: Path) -> "GGUFIndex":
        raw = json.loads((folder / GGUF_INDEX).read_text())
        return cls(
            Path(raw["file"]),
            int(raw["size"]),
            int(raw["mtime_ns"]),
            str(raw["architecture"]),
            tuple(TensorEntry.from_json(t) for t in raw["tensors"]),
        )


def is_gguf_folder(folder: Path) -> bool:
    """A folder ``prepare_gguf`` made (its weights are in a GGUF file)."""
    return (folder / GGUF_INDEX).is_file()


def find_gguf_file(path: Path) -> Path | None:
    """``path`` itself when it is a ``.gguf`` file, the one ``.gguf`` file of a folder without
    a config.json, else None; GGUFError for a folder holding several, or a ``.gguf`` path
    that does not exist (otherwise taken for a checkpoint folder, and reported as one)."""
    if path.suffix == ".gguf" and not path.exists():
        raise GGUFError(f"GGUF file {path} does not exist")
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise GGUFError(
            f"{path} holds {len(files)} GGUF files ({', '.join(f.name for f in files)}); "
            f"give --model-path the one to serve"
        )
    return files[0] if files else None


def prepare_gguf(path: str | Path, fallback_sampling: Mapping[str, float] | None = None) -> Path:
    """The checkpoint folder for the GGUF file ``path`` (built on first use, then reused).
    ``fallback_sampling``: the sampling defaults of a model tinyserve ships, used when the file has no
    sampler metadata of its own; part of the folder's key, so that the same file prepared without
    them (a plain ``--model-path FILE``) gets a folder of its own instead of whichever came first."""
    path = Path(path).resolve()
    if not path.is_file():
        raise GGUFError(f"GGUF file {path} does not exist")
    stat = path.stat()
    fallback = dict(fallback_sampling or {})
    identity = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{PREPARE_VERSION}|{json.dumps(fallback, sort_keys=True)}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    final = cache_root() / "gguf" / f"{path.stem}-{key}"
    return build_once(
        final,
        lambda tmp: _build(path, stat.st_size, stat.st_mtime_ns, tmp, fallback),
        f"the checkpoint of {path.name}",
    )


def _build(path: Path, size: int, mtime_ns: int, out: Path, fallback_sampling: dict[str, float]) -> None:
    contents = read_gguf(path)
    config = hf_config(contents)  # checks architecture, metadata and every tensor's shape
    _write_tokenizer(contents, out)
    _write_generation_config(contents, fallback_sampling, out)
    index: dict[str, Any] = {
        "file": str(path),
        "size": size,
        "mtime_ns": mtime_ns,
        "architecture": contents.architecture,
        "tensors": [t.to_json() for t in contents.tensors.values()],
    }
    (out / GGUF_INDEX).write_text(json.dumps(index) + "\n")
    # config.json last: build_once treats a folder with one as complete.
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_generation_config(contents: GGUFContents, fallback: dict[str, float], out: Path) -> None:
    """generation_config.json with the model's sampling defaults, where it has any: the file's own
    sampler metadata wins over ``fallback`` (a newer file of a shipped model says what it wants)."""
    sampling = gguf_sampling(contents.metadata)
    origin = "the file's general.sampling.* metadata"
    if not sampling and fallback:
        sampling, origin = dict(fallback), "tinyserve's shipped default for this model"
    if sampling:
        (out / GENERATION_CONFIG).write_text(json.dumps(sampling, indent=2, sort_keys=True) + "\n")
        logger.info("%s: sampling defaults %s, from %s", contents.path.name, sampling, origin)


def _write_tokenizer(contents: GGUFContents, out: Path) -> None:
    """The tokenizer (and chat template) transformers converts from the file's metadata. A file
    without one (weights only) gets none: the server then needs --tokenizer-path."""
    if "tokenizer.ggml.model" not in contents.metadata:
        logger.warning("%s has no tokenizer (no tokenizer.ggml.* metadata)", contents.path)
        return
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # lazy: a slow import

    folder, name = str(contents.path.parent), contents.path.name
    with shared_parse(contents):  # (the file parsed once, not once more for each of transformers' reads)
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        except (ValueError, KeyError, NotImplementedError) as exc:
            # AutoTokenizer first reads the model's config from the file, which transformers' GGUF
            # loader refuses for architectures it does not load (OLMoE's): the fast tokenizer it builds
            # from the same tokenizer.ggml.* metadata does without that config.
            try:
                tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)
            except (ValueError, KeyError, NotImplementedError):
                raise GGUFError(f"{contents.path}: its tokenizer cannot be converted: {exc}") from None
            logger.info("%s: tokenizer converted without a model config (%s)", contents.path, exc)
    tokenizer.save_pretrained(str(out))
    _drop_tokens_beyond_the_file(out, int(contents.metadata["tokenizer.ggml.tokens#count"]))
    os.chmod(out, 0o755)


def _drop_tokens_beyond_the_file(out: Path, count: int) -> None:
    """transformers converts a byte-level ("gpt2") vocabulary through GPT2Tokenizer, whose default
    special token ``<|endoftext|>`` it adds after the file's tokens when the file has none (Llama 3
    files, for one): an id the model has no embedding row for, so a prompt with that text in it
    would be refused as out of the vocabulary. Only the file's own tokens are kept."""
    path = out / "tokenizer.json"
    if not path.is_file():
        return
    spec = json.loads(path.read_text(encoding="utf-8"))
    added = spec.get("added_tokens") or []
    kept = [token for token in added if int(token["id"]) < count]
    if len(kept) != len(added):
        logger.info(
            "dropping tokens the GGUF file does not have: %s",
            ", ".join(t["content"] for t in added if int(t["id"]) >= count),
        )
        spec["added_tokens"] = kept
        path.write_text(json.dumps(spec, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
