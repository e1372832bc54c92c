"""The LoRA flags: how --lora-paths entries read and what the checks refuse before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.config.args import ServerArgs
from runtime.config.lora_args import LoraRef, lora_enabled, parse_lora_path


def test_entries_read_as_sglang_reads_them() -> None:
    assert parse_lora_path("sql=/a/b") == LoraRef("sql", "/a/b")
    assert parse_lora_path("/a/b") == LoraRef("/a/b", "/a/b")  # a bare path is named by itself
    assert parse_lora_path('{"lora_name": "x", "lora_path": "/p", "pinned": true}') == LoraRef("x", "/p", True)
    for bad in ("=p", "x=", '{"lora_name": "x"}'):
        with pytest.raises(ValueError, match="--lora-paths"):
            parse_lora_path(bad)


def test_lora_paths_imply_enable_lora(tmp_path: Path) -> None:
    args = ServerArgs.from_cli(["--lora-paths", f"a={tmp_path}"])
    assert lora_enabled(args) and args.lora_paths == [f"a={tmp_path}"]
    assert not lora_enabled(ServerArgs())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-lora-rank", "8"], "--max-lora-rank applies to a LoRA server"),
        (["--lora-paths", "a=/does/not/exist"], "is not a folder"),
        (["--lora-paths", "a={tmp}", "a={tmp}"], "names 'a' twice"),
        (["--enable-lora", "--lora-target-modules", "embed_tokens"], "is not one of"),
        (["--enable-lora", "--max-loras-per-batch", "0"], "--max-loras-per-batch must be >= 1"),
        (["--lora-paths", "a={tmp}", "b={tmp}", "--max-loaded-loras", "1"], "more than --max-loaded-loras"),
        (["--enable-lora", "--is-embedding"], "takes no adapters"),
        (
            ["--lora-paths", '{"lora_name": "a", "lora_path": "{tmp}", "pinned": true}', "--max-loras-per-batch", "1"],
            "may be pinned",
        ),
    ],
)
def test_inconsistent_flags_are_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit):
        ServerArgs.from_cli([flag.replace("{tmp}", str(tmp_path)) for flag in flags])
    assert message in capsys.readouterr().err
