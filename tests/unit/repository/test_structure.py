"""House rules the import graph does not see: a product or benchmark module is one idea (at most
``MAX_MODULE_LINES`` lines: past that it is two ideas, split by design), and no code outside
``runtime/engine/models/`` names a model class (the engine reaches models through the
``CausalLM`` protocol and the registry)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support import PRODUCT_PACKAGES, REPO_ROOT

MAX_MODULE_LINES = 500
MODELS = REPO_ROOT / "runtime" / "engine" / "models"
PROTOCOL_NAMES = {"CausalLM", "CheckpointTargets"}  # models/base.py: what everyone may name


def product_files() -> list[Path]:
    files = [REPO_ROOT / "launch.py"]
    for package in PRODUCT_PACKAGES:
        files += sorted((REPO_ROOT / package).rglob("*.py"))
    return files


def oversized(files: list[Path], limit: int) -> list[tuple[str, int]]:
    """``(file name, lines)`` of each file longer than ``limit`` lines."""
    return [(p.as_posix(), n) for p in files if (n := len(p.read_text().splitlines())) > limit]


def test_every_product_and_benchmark_module_is_at_most_500_lines() -> None:
    benchmarks = sorted((REPO_ROOT / "bench").glob("*.py"))
    assert len(product_files()) > 100 and len(benchmarks) > 20
    assert oversized(product_files() + benchmarks, MAX_MODULE_LINES) == []


def test_the_size_rule_finds_a_long_module(tmp_path: Path) -> None:
    (tmp_path / "long.py").write_text("x = 1\n" * 3)
    (tmp_path / "short.py").write_text("x = 1\n" * 2)
    assert oversized([tmp_path / "long.py", tmp_path / "short.py"], 2) == [((tmp_path / "long.py").as_posix(), 3)]


def model_class_names() -> set[str]:
    """Every class defined in a model module (the protocol's own names excepted)."""
    names: set[str] = set()
    for path in MODELS.glob("*.py"):
        names |= {node.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ClassDef)}
    return names - PROTOCOL_NAMES


def names_used(path: Path) -> set[str]:
    """Identifiers a module refers to: names, attributes and imported names (not string contents:
    an architecture name in a checkpoint's config.json is data)."""
    used: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            used |= {alias.name.rpartition(".")[2] for alias in node.names}
    return used


def test_no_code_outside_models_names_a_model_class() -> None:
    classes = model_class_names()
    assert {"LlamaForCausalLM", "LlamaDecoderLayer"} <= classes
    wrong = [
        f"{p.relative_to(REPO_ROOT)}: {sorted(names_used(p) & classes)}"
        for p in product_files()
        if MODELS not in p.parents and names_used(p) & classes
    ]
    assert wrong == []
