"""The repository stands alone: no file points outside it, and it carries its license."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support import REPO_ROOT as REPO

TEXT_SUFFIXES = {".py", ".md", ".toml", ".c", ".h", ".txt", ".cfg", ".ini", ".sh", ".yml", ".yaml", ""}
# Spelled in pieces so that this file does not match itself.
OUTSIDE_REFERENCES = ("../" + "shared", "DESIGN" + ".md")


def repository_text_files() -> list[Path]:
    """Source, docs and configuration: everything but hidden folders (.git, .venv, caches),
    build metadata and generated results."""
    files = []
    for root, dirs, names in os.walk(REPO):
        dirs[:] = [
            d
            for d in dirs
            if not d.startswith(".") and not d.endswith(".egg-info") and d not in ("__pycache__", "results", "build")
        ]
        files += [Path(root) / n for n in names if Path(n).suffix in TEXT_SUFFIXES]
    return files


def test_no_file_points_outside_the_repository() -> None:
    files = repository_text_files()
    assert any(f.name == "architecture.md" for f in files) and len(files) > 50
    hits = [
        f"{f.relative_to(REPO)}: {ref}"
        for f in files
        for ref in OUTSIDE_REFERENCES
        if ref in f.read_text(errors="replace")
    ]
    assert hits == []


def test_license_is_apache_2() -> None:
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
