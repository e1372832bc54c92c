"""The type check: mypy over the paths ``[tool.mypy] files`` names in pyproject.toml (every product
package and launch.py; strict on memory/, runtime/protocol/, runtime/client/ and detokenizer_proc/:
the config says which flags)."""

from __future__ import annotations

import importlib
import sys

from tests.support import REPO_ROOT
from tests.support.background_typecheck import typecheck_result

# A cold run (a fresh cache: torch's annotations are read afresh) takes ~40 s of one core; the limit
# only stops a hung checker.
TIMEOUT_S = 900
STRICT_PATHS = ("memory", "runtime/protocol", "runtime/client", "detokenizer_proc")


def test_mypy_finds_no_errors() -> None:
    # Started at the end of collection and run beside the tests (tests/support/background_typecheck.py).
    proc = typecheck_result(TIMEOUT_S)
    assert "No module named mypy" not in proc.stderr, "mypy is not installed: pip install -e '.[test]'"
    assert proc.returncode == 0, f"mypy exited {proc.returncode}:\n{proc.stdout}{proc.stderr}"


def test_mypy_checks_the_strict_packages() -> None:
    """The strict packages stay among the checked paths (a path dropped from ``files`` is not checked)."""
    tomllib = importlib.import_module("tomllib" if sys.version_info >= (3, 11) else "tomli")  # (tomli: mypy's own dep)
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    assert set(STRICT_PATHS) <= set(config["files"])
    strict_modules = {m for o in config["overrides"] if o.get("disallow_untyped_defs") for m in o["module"]}
    assert {p.replace("/", ".") + ".*" for p in STRICT_PATHS} <= strict_modules
