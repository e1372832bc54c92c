"""The built package carries everything it needs: the CPU kernels compile from an installed copy.

An editable install reads the sources in place, so a file missing from the package data (the C
headers the kernels include, once) goes unnoticed there and the kernels silently fall back to
torch ops. This builds the wheel, unpacks it as pip would install it, and builds the kernels
from that copy alone in a fresh process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support import PRODUCT_PACKAGES, REPO_ROOT

pytestmark = pytest.mark.slow

_CHECK = """
import json, sys
import runtime
from runtime.engine.cpu import kernel_library
lib = kernel_library.load()
print(json.dumps({"runtime": runtime.__file__, "level": kernel_library.level(), "loaded": lib is not None}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from a clean copy of the sources (a checkout's build/ folder can hold files
    an earlier build packed, which would hide one the package data no longer names)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md", "LICENSE", "launch.py"):
        shutil.copy(REPO_ROOT / name, source / name)
    for package in PRODUCT_PACKAGES:
        shutil.copytree(REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    (path,) = out.glob("tinyserve-*.whl")
    return path


def test_the_wheel_ships_the_kernel_sources_and_headers(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = REPO_ROOT / "runtime" / "engine" / "cpu" / "csrc"
    expected = {f"runtime/engine/cpu/csrc/{p.name}" for p in csrc.iterdir() if p.suffix in (".c", ".h")}
    assert any(n.endswith(".h") for n in expected) and expected <= names
    assert "launch.py" in names and not any(n.startswith(("tests/", "bench/")) for n in names)


def test_the_wheel_ships_the_chat_page(wheel: Path) -> None:
    """GET / reads tokenizer_proc/http/static/chat.html from the installed package (package data)."""
    page = "tokenizer_proc/http/static/chat.html"
    with zipfile.ZipFile(wheel) as z:
        assert page in z.namelist()
        assert z.read(page) == (REPO_ROOT / page).read_bytes()


def test_the_kernels_build_from_the_installed_copy(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINYSERVE_CPU")}
    env.update(PYTHONPATH=str(site), TINYSERVE_CACHE=str(tmp_path / "cache"))  # a fresh build, from `site`
    done = subprocess.run(
        [sys.executable, "-c", _CHECK], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["runtime"]).is_relative_to(site)
    assert result["loaded"], (
        f"no kernels built from the installed copy (level {result['level']}): {done.stderr[-3000:]}"
    )
    assert list((tmp_path / "cache" / "kernels").glob("cpu_kernels-*.so"))
